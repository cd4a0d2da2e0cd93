"""interpret.py: the command line draws the maps and writes the scores probes.py computes; train.py's
--log_heads logs them and plot.py draws them."""

import json
import os

import pytest
from conftest import TINY_RUN, read_metrics, run_main


def test_interpret_draws_maps_and_writes_scores(tmp_path, trained_run):
    pytest.importorskip("matplotlib")
    png = tmp_path / "maps.png"
    drawn = run_main("interpret.py", f"--out_dir={trained_run}", "--start=The king spoke", f"--png={png}")
    assert drawn.returncode == 0 and png.stat().st_size > 10_000, drawn.stderr
    one = run_main("interpret.py", f"--out_dir={trained_run}", "--probe=True", "--layer=1", "--head=0",
                   f"--png={tmp_path / 'one.png'}")
    assert one.returncode == 0 and "layer 1, head 0" in one.stdout, one.stderr
    scored = run_main("interpret.py", f"--out_dir={trained_run}", "--scores=True", f"--json={tmp_path / 's.json'}")
    assert scored.returncode == 0 and "layer head  previous  duplicate  induction  copying" in scored.stdout
    saved = json.loads((tmp_path / "s.json").read_text())
    assert len(saved["induction"]) == 2 and len(saved["induction"][0]) == 2 and "icl" in saved


@pytest.mark.parametrize("args, message", [
    (["--out_dir=/nonexistent/run"], "no such checkpoint"),
    (["--start=The \u00bf"], "characters not in the vocabulary: '\u00bf'"),
    (["--layer=2"], "layer=2 does not exist: the model has 2 layers, 0 to 1"),
    (["--layer=0", "--head=5"], "head=5 does not exist"),
    (["--head=1"], "give --layer too"),
    (["--scores=True", "--probe_len=40"], "probe_len=40"),
])
def test_bad_input_is_one_line(trained_run, args, message):
    result = run_main("interpret.py", f"--out_dir={trained_run}", *args)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_training_logs_head_scores_and_plot_draws_them(tmp_path, char_dataset):
    import train

    train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'run'}", "--max_iters=4",
                "--eval_interval=2", "--log_heads=True"])
    evals = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 2, 4]
    assert all(0 < r["induction_score"] < 1 and 0 < r["previous_token_score"] < 1 and abs(r["icl_score"]) < 1
               for r in evals)
    plotted = run_main("plot.py", str(tmp_path / "run"))
    assert plotted.returncode == 0 or "matplotlib is not installed" in plotted.stdout


def test_the_maps_go_into_the_runs_folder_by_default(tmp_path, trained_run, monkeypatch):
    """Not into the current folder (a stray attention.png was left in the repository's root)."""
    pytest.importorskip("matplotlib")
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(os.path.join(trained_run, "ckpt.pt"), run / "ckpt.pt")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    drawn = run_main("interpret.py", f"--out_dir={run}", "--start=The king")
    assert drawn.returncode == 0 and f"wrote {run / 'attention.png'}" in drawn.stdout, drawn.stderr
    assert (run / "attention.png").exists() and not list((tmp_path / "elsewhere").iterdir())
