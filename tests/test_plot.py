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


def test_a_long_study_title_stays_inside_the_figure(tmp_path, monkeypatch):
    """ablate.py's plots put the legend beside the axes; a long title centred over the narrowed axes ran
    off the figure's left edge ("osition schemes"). The title lies inside the figure."""
    pytest.importorskip("matplotlib")
    import ablate

    outside = []

    def checking_save(plt, fig, path):
        fig.tight_layout()
        fig.canvas.draw()
        for text in [*fig.texts, *(ax.title for ax in fig.axes)]:  # the figure's and the axes' titles
            box = text.get_window_extent()
            if text.get_text() and (box.x0 < -1 or box.x1 > fig.bbox.x1 + 1):
                outside.append(text.get_text())
        plt.close(fig)
        return path

    monkeypatch.setattr(ablate, "save", checking_save)
    rows = {name: {"curves": [[(0, 4.2), (1000, 3.0 + i), (2000, 2.5 + i)]]} for i, name in
            enumerate(["none (NoPE)", "learned", "sinusoidal", "rope", "alibi", "t5"])}
    title = "Position schemes on Tiny Shakespeare [shrunk: --quick=True --max_iters=100 --seeds=1; figures not the study's]"
    assert ablate.plot(rows, str(tmp_path), title) == str(tmp_path / "loss_curves.png")
    assert not outside, outside
