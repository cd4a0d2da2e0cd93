"""The bad-input catalogue (docs/reliability.md): each case exits non-zero with a one-line message that
says what is wrong, and leaves no partial file behind."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import sample
import train
from checkpoint import CheckpointError, RunLock, load_checkpoint
from conftest import ROOT, TINY_RUN, make_text
from dataset import HEADER, char_tokenizer_for, prepare_text, write_tokens


def fails(capsys, main, *args):
    """Runs a script's main; returns (exit status, stderr), checking the message is one line."""
    with pytest.raises(SystemExit) as exit:
        main(list(args))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return exit.value.code, err


def train_fails(capsys, tmp_path, dataset, *args):
    out = tmp_path / "out"
    code, err = fails(capsys, train.main, *TINY_RUN, f"--dataset={dataset}", f"--out_dir={out}", *args)
    assert not out.exists(), "a refused run must leave nothing behind"
    return code, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n_embd=30", "--n_head=4"], "GPTConfig.n_embd=30 must be divisible by n_head=4"),
        (["--n_head=4", "--n_kv_head=3"], "GPTConfig.n_head=4 must be divisible by n_kv_head=3"),
        (["--n_embd=36", "--n_head=4", "--pos_emb=rope"], "needs an even head size; n_embd/n_head = 9"),
        (["--warmup_iters=50", "--max_iters=10"], "warmup_iters=50 must be in [0, max_iters=10]"),
        (["--learning_rate=0"], "learning_rate=0.0 must be > 0"),
        (["--learning_rate=-1e-3"], "learning_rate=-0.001 must be > 0"),
        (["--batch_size=0"], "batch_size=0 must be >= 1"),
        (["--block_size=20000"], "fewer than block_size + 1 = 20001; use a smaller block_size or more data"),
        (["--dropout=1.5"], "GPTConfig.dropout=1.5 must be in [0, 1)"),
        (["--beta2=1.0"], "beta2=1.0 must be in [0, 1)"),
        (["--fsdp=True"], "fsdp=True needs torchrun"),
        (["--dataset=no_such_data"], "dataset 'no_such_data' not found"),
    ],
)
def test_invalid_training_values(capsys, tmp_path, char_dataset, args, message):
    code, err = train_fails(capsys, tmp_path, char_dataset, "--max_iters=20", *args)
    assert code == 2 and message in err


def test_empty_and_missing_data(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, err = train_fails(capsys, tmp_path, tmp_path / "empty")
    assert code == 2 and "no meta.json; prepare the dataset first: python data/prepare.py YOUR_FILES --out=empty" in err
    text = make_text(5000)
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "d"))
    write_tokens(tmp_path / "d" / "val.bin", np.zeros(0, dtype=np.int64), len(set(text)))
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "val.bin: 0 tokens, fewer than block_size + 1" in err


def test_corrupt_token_files(capsys, tmp_path):
    text = make_text(5000)
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "d"))
    path = tmp_path / "d" / "train.bin"
    good = path.read_bytes()
    path.write_bytes(good[:-1])  # odd byte length
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "train.bin: 9063 bytes, but its header promises 4500 tokens (9064 bytes)" in err and "truncated" in err
    path.write_bytes(b"NOTATOKN" + good[8:])
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "train.bin: not a token file (bad header)" in err
    tokens = np.frombuffer(good[HEADER.itemsize:], np.uint16).copy()
    tokens[100] = 200  # beyond the 37-character vocabulary
    path.write_bytes(good[: HEADER.itemsize] + tokens.tobytes())
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "train.bin: token id 200 >= vocabulary size" in err


def test_unwritable_out_dir(capsys, tmp_path, char_dataset):
    (tmp_path / "file").write_text("not a directory")
    code, err = fails(capsys, train.main, *TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'file' / 'out'}",
                      "--max_iters=2")
    assert code == 2 and "cannot write to out_dir" in err and "Not a directory" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top_p=0"], "top_p=0.0 must be in (0, 1]"),
        (["--top_p=1.01"], "top_p=1.01 must be in (0, 1]"),
        (["--temperature=-0.1"], "temperature=-0.1 must be >= 0"),
        (["--max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
        (["--num_samples=0"], "num_samples=0 must be >= 1"),
        (["--start=\u00bfQu\u00e9?"], "characters not in the vocabulary: '\u00bf\u00e9'"),
    ],
)
def test_invalid_sampling_values(capsys, trained_run, args, message):
    code, err = fails(capsys, sample.main, f"--out_dir={trained_run}", "--device=cpu", *args)
    assert code == 2 and message in err


# ---------------------------------------------------------------------------------------------------
# Checkpoints


class Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_objects_are_refused(tmp_path, capsys):
    torch.save({"format": 1, "model": {}, "payload": Exploit()}, tmp_path / "ckpt.pt")
    with pytest.raises(CheckpointError, match="refused: it contains pickled Python objects"):
        load_checkpoint(str(tmp_path / "ckpt.pt"))
    code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
    assert code == 2 and f"{tmp_path / 'ckpt.pt'}: refused" in err


def test_truncated_and_foreign_checkpoints(tmp_path, capsys, trained_run):
    good = open(os.path.join(trained_run, "ckpt.pt"), "rb").read()
    (tmp_path / "ckpt.pt").write_bytes(good[: len(good) // 2])
    code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
    assert code == 2 and f"{tmp_path / 'ckpt.pt'}: truncated or corrupt checkpoint" in err
    (tmp_path / "ckpt.pt").write_bytes(b"\x00" * 1000)
    code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
    assert code == 2 and "truncated or corrupt checkpoint" in err
    torch.save({"weights": torch.zeros(3)}, tmp_path / "ckpt.pt")
    code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
    assert code == 2 and "not a checkpoint written by train.py" in err


def test_checkpoint_whose_weights_do_not_fit_its_config(tmp_path, capsys, trained_run):
    state = torch.load(os.path.join(trained_run, "ckpt.pt"), weights_only=True)
    state["model_config"]["n_layer"] = 3  # a different architecture than the weights
    torch.save(state, tmp_path / "ckpt.pt")
    code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
    assert code == 2 and "weights do not match its model config" in err
    state["model_config"]["n_layer"] = 2
    state["model_config"]["vocab_size"] = 99  # a different vocabulary
    torch.save(state, tmp_path / "ckpt.pt")
    code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
    assert code == 2 and "size mismatch for tok_emb.weight" in err


# ---------------------------------------------------------------------------------------------------
# Locks, disk full


def test_second_run_on_the_same_out_dir_is_refused(tmp_path, capsys, char_dataset):
    holder = RunLock(str(tmp_path)).acquire()
    try:
        code, err = fails(capsys, train.main, *TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path}",
                          "--max_iters=2")
        assert code == 2 and "is in use by another run" in err and f'"pid": {os.getpid()}' in err
    finally:
        holder.release()
    assert not (tmp_path / "ckpt.pt").exists()


def test_stale_lock_of_a_killed_run_is_taken_over(tmp_path, char_dataset, capsys):
    # a process that takes the lock and dies by SIGKILL, never releasing it
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import os, signal, checkpoint; " \
           f"checkpoint.RunLock({str(tmp_path)!r}).acquire(); os.kill(os.getpid(), signal.SIGKILL)"
    subprocess.run([sys.executable, "-c", code], check=False)
    assert '"pid"' in (tmp_path / "lock").read_text()  # the dead run's note is still there
    train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--max_iters=2"])
    assert "took over the lock of a run that ended without releasing it" in capsys.readouterr().out
    assert (tmp_path / "lock").read_text() == ""  # released at the end


DISK_FULL = """
import errno, os, sys
sys.path.insert(0, {root!r})
real_fsync = os.fsync
def fsync(fd):
    if "ckpt.pt.tmp." in os.readlink(f"/proc/self/fd/{{fd}}"):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_fsync(fd)
os.fsync = fsync
import train
train.main(sys.argv[1:])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, char_dataset):
    args = [*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path}"]
    train.main([*args, "--max_iters=5"])
    before = (tmp_path / "ckpt.pt").read_bytes()
    result = subprocess.run([sys.executable, "-c", DISK_FULL.format(root=str(ROOT)), *args, "--init_from=resume",
                             "--max_iters=10"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    assert "No space left on device" in result.stderr and "the previous checkpoint is untouched" in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    assert not list(tmp_path.glob("*.tmp.*"))
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 5

