"""plot.py: one PNG of several runs, the summary without matplotlib, one line for a folder without metrics."""

import pytest

from conftest import one_error_line, run_main, run_script


def test_plot_draws_one_png_of_several_runs(tmp_path, trained_run):
    pytest.importorskip("matplotlib")
    out = tmp_path / "runs.png"
    result = run_main("plot.py", trained_run, trained_run, f"--out={out}")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert result.stdout.count("best val") == 2 and f"wrote {out}" in result.stdout


def test_plot_without_matplotlib_prints_the_summary(tmp_path, trained_run):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "matplotlib.py").write_text("raise ImportError('hidden for this test')\n")
    result = run_script("plot.py", trained_run, f"--out={tmp_path / 'x.png'}", env={"PYTHONPATH": str(shim)})
    assert result.returncode == 0, result.stderr
    assert "best val" in result.stdout and "matplotlib is not installed" in result.stdout
    assert not (tmp_path / "x.png").exists()


def test_plot_of_a_directory_without_metrics_is_one_error_line(tmp_path):
    result = run_main("plot.py", str(tmp_path))
    assert result.returncode == 2 and "no metrics.jsonl" in one_error_line(result)
