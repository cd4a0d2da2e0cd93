"""eval.py: bits per byte right by construction, the stride honest, bad input refused (issue 16)."""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import eval as evaluation
from checkpoint import load_checkpoint, load_model, save_checkpoint
from conftest import run_main, run_script

TEXT = "The king speak thou noble heart.\nThe queen hath love, the lord doth war.\n" * 6


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return str(path)


def test_windows_score_every_target_once():
    for n, block, stride in [(100, 32, 32), (100, 32, 8), (33, 32, 32), (2, 32, 5), (97, 16, 3)]:
        spans = evaluation.windows(n, block, stride)
        scored = [t for begin, end, k in spans for t in range(end - k + 1, end + 1)]
        assert scored == list(range(1, n))  # targets 1..n-1, each once, in order
        assert all(end - begin <= block and end - k - begin >= min(block - stride, end - k - begin) for begin, end, k in spans)


def test_a_model_with_zero_logits_scores_log2_vocab_bits_per_token(tmp_path, trained_run, text_file):
    state = load_checkpoint(os.path.join(trained_run, "ckpt.pt"))
    state["model"] = {k: torch.zeros_like(v) if k in ("tok_emb.weight", "lm_head.weight") else v
                      for k, v in state["model"].items()}
    (tmp_path / "zero").mkdir()
    save_checkpoint(str(tmp_path / "zero" / "ckpt.pt"), state)
    r = evaluation.main([f"--out_dir={tmp_path / 'zero'}", f"--text={text_file}", "--device=cpu"])
    vocab = state["model_config"]["vocab_size"]
    assert r["tokens"] == len(TEXT) - 1 and r["bytes"] == len(TEXT.encode()) - 1
    assert r["loss"] == pytest.approx(math.log(vocab), abs=1e-9)
    assert r["bits_per_byte"] == pytest.approx(math.log2(vocab) * r["tokens"] / r["bytes"], abs=1e-9)


def test_loss_and_bytes_match_a_hand_computation(trained_run, text_file):
    model, state = load_model(trained_run)
    from tokenizer import tokenizer_from_meta

    ids = torch.tensor(tokenizer_from_meta(state["tokenizer"]).encode(TEXT))
    B = model.config.block_size
    nats = 0.0
    with torch.no_grad():
        for begin in range(0, len(ids) - 1, B):  # non-overlapping windows, every position scored
            x, y = ids[begin : begin + B], ids[begin + 1 : begin + B + 1]
            x = x[: len(y)]
            nats += F.cross_entropy(model(x[None])[0][0].double(), y, reduction="sum").item()
    r = evaluation.main([f"--out_dir={trained_run}", f"--text={text_file}", "--device=cpu", "--batch_size=3"])
    assert r["loss"] * r["tokens"] == pytest.approx(nats, rel=1e-6)
    assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / (len(TEXT.encode()) - 1), rel=1e-6)
    # a character model: bits per byte = nats per character / ln 2 * characters / bytes
    assert r["bits_per_byte"] == pytest.approx(r["loss"] / math.log(2) * r["tokens"] / r["bytes"], rel=1e-12)


def test_with_a_stride_each_token_is_the_last_position_of_its_own_window(trained_run, text_file, monkeypatch, capsys):
    monkeypatch.setattr(__import__("configurator"), "PROGRESS_SECONDS", 0.0)
    model, state = load_model(trained_run)
    from tokenizer import tokenizer_from_meta

    ids = torch.tensor(tokenizer_from_meta(state["tokenizer"]).encode(TEXT))
    B, stride = model.config.block_size, 5
    losses, targets = evaluation.score(model.eval(), ids, stride, 4, "cpu", torch.autocast("cpu", enabled=False))
    assert targets.tolist() == ids[1:].tolist()
    spans = evaluation.windows(len(ids), B, stride)  # a line per batch of 4 windows but the last (a log's progress)
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == [
        f"scoring: {i} of {len(spans)} windows" for i in range(4, len(spans), 4)]
    with torch.no_grad():
        for begin, end, n in spans:
            for t in range(end - n + 1, end + 1):  # target index t, predicted from tokens begin..t-1
                window = ids[begin:t]
                assert len(window) >= min(B - stride, t)  # context it is promised
                expected = F.cross_entropy(model(window[None])[0][0, -1].double(), ids[t]).item()
                assert losses[t - 1].item() == pytest.approx(expected, abs=1e-5)


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, trained_run, char_dataset):
    out = tmp_path / "result.json"
    strange = tmp_path / "strange.txt"
    strange.write_text("The king \u00a7 speaks")
    cases = [
        ([f"--text={strange}"], "characters not in the vocabulary"),
        ([f"--text={tmp_path / 'missing.txt'}"], "cannot read it as UTF-8 text"),
        (["--stride=0", "--stride=999"], "stride=999 must be in [1, block_size=32]"),
        (["--dataset=/no/such/data"], "dataset '/no/such/data' not found"),
    ]
    for args, message in cases:
        result = run_main("eval.py", f"--out_dir={trained_run}", f"--json={out}", "--device=cpu", *args)
        assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
        assert not out.exists()


def test_another_tokenizers_dataset_is_refused(tmp_path, trained_run):
    from conftest import make_text
    from dataset import prepare_text
    from tokenizer import char_tokenizer_for

    text = make_text(5000, seed=9).upper()
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "upper"))
    result = run_main("eval.py", f"--out_dir={trained_run}", f"--dataset={tmp_path / 'upper'}", "--device=cpu")
    assert result.returncode == 2 and "but the model was trained with" in result.stderr


def test_the_checkpoints_own_dataset_by_default_and_json(tmp_path, trained_run):
    out = tmp_path / "r.json"
    result = run_main("eval.py", f"--out_dir={trained_run}", f"--json={out}", "--device=cpu")
    assert result.returncode == 0, result.stderr
    saved = json.loads(out.read_text())
    assert saved["source"].endswith("/val") and saved["tokens"] > 1000 and 0 < saved["bits_per_byte"] < 8


def test_training_logs_val_bits_per_byte(trained_run):
    """The generated verse is ASCII: a byte per character, so bits per byte = nats per character / ln 2."""
    from conftest import read_metrics

    evals = [r for r in read_metrics(trained_run) if "val_loss" in r]
    assert evals and all(r["val_bpb"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-9) for r in evals)


def test_tasks_without_lm_eval_installed_is_one_line(tmp_path, trained_run):
    """As if lm_eval were not installed (sys.modules[name] = None makes its import fail), whether or not it is."""
    code = ("import sys, runpy; sys.modules['lm_eval'] = None; sys.argv = ['eval.py'] + sys.argv[1:]; "
            "runpy.run_path('eval.py', run_name='__main__')")
    result = run_script("-c", code, f"--out_dir={trained_run}", "--tasks=hellaswag", "--device=cpu",
                        f"--json={tmp_path / 'r.json'}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install -r requirements-eval.txt" in result.stderr and not (tmp_path / "r.json").exists()


MEASURE_RSS = """
import resource, sys
import eval as evaluation
real = evaluation.score
def score(*args):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = real(*args)
    print("rss_kb", before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
    return out
evaluation.score = score
evaluation.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_strided_evaluation_of_a_book_needs_no_more_memory_than_a_plain_one(tmp_path, char_dataset):
    """eval.py --stride=64 over a 1 MB text: its peak RSS stays within 2x of the same evaluation without a
    stride, and what scoring adds to the loaded model is at most the plain one's plus 32 MB. The
    per-window loss tensors it kept made a heap that fragmented with each batch's freed logits (689 MB
    against 305 MB here; 7.6 GB at stride 16 with a 2k BPE; the issue's 23.9 GB)."""
    from conftest import TINY_RUN, make_text

    book = tmp_path / "book.txt"
    book.write_text(make_text(1_000_000, seed=3))
    out = tmp_path / "run"
    trained = run_main("train.py", *TINY_RUN, "--block_size=128", "--max_iters=2", f"--dataset={char_dataset}",
                       f"--out_dir={out}")
    assert trained.returncode == 0, trained.stderr
    peaks = {}
    for stride in (0, 64):
        result = run_script("-c", MEASURE_RSS, f"--out_dir={out}", f"--text={book}", f"--stride={stride}", "--device=cpu")
        assert result.returncode == 0, result.stderr
        before, peak = map(int, result.stderr.split("rss_kb")[1].split()[:2])
        peaks[stride] = (before, peak)
    (plain_before, plain), (strided_before, strided) = peaks[0], peaks[64]
    assert strided <= 2 * plain, peaks  # the bound
    # and the growth itself: before the fix 132-178 MB against 0-58 MB plain here; after, 0 against 0
    assert strided - strided_before <= plain - plain_before + 32 * 1024, peaks


def test_int8_weights_score_through_the_decode_kernel_close_to_float32(trained_run, text_file, monkeypatch):
    """--weights_dtype=int8: every product of every window has at most DECODE_ROWS rows (what decoding runs)."""
    import quantize

    base = evaluation.main([f"--out_dir={trained_run}", f"--text={text_file}", "--device=cpu", "--batch_size=3"])
    rows, rowdot = [], quantize.rowdot
    monkeypatch.setattr(quantize, "rowdot", lambda x, *a: (rows.append(x.size(0)), rowdot(x, *a))[1])
    r = evaluation.main([f"--out_dir={trained_run}", f"--text={text_file}", "--device=cpu", "--batch_size=3",
                         "--weights_dtype=int8"])
    assert r["weights_dtype"] == "int8" and r["tokens"] == base["tokens"]
    assert rows and max(rows) <= quantize.Int8Linear.DECODE_ROWS
    assert r["loss"] != base["loss"] and abs(r["loss"] - base["loss"]) < 0.02, (r["loss"], base["loss"])
    rows.clear()  # a batch wider than DECODE_ROWS windows: in groups
    wide = evaluation.main([f"--out_dir={trained_run}", f"--text={text_file}", "--device=cpu", "--batch_size=20",
                            "--stride=4", "--weights_dtype=int8"])
    assert rows and max(rows) <= quantize.Int8Linear.DECODE_ROWS and wide["tokens"] == base["tokens"]
    done = run_main("eval.py", f"--out_dir={trained_run}", "--tasks=hellaswag", "--weights_dtype=int8")
    assert done.returncode == 2 and "--tasks scores with float32 weights" in done.stderr
