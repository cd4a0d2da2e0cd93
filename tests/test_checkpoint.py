"""checkpoint.py: loading refuses bad files in one line; the run lock; atomic writes under disk full and SIGKILL."""

import builtins
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

import sample
import train
from checkpoint import CheckpointError, RunLock, load_checkpoint
from conftest import ROOT, TINY_RUN, fails, read_metrics


# ---------------------------------------------------------------------------------------------------
# Loading


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
    for seed in range(3):  # random bytes are damage, not a security risk (they read as a pickle's opcodes)
        (tmp_path / "ckpt.pt").write_bytes(random.Random(seed).randbytes(4096))
        code, err = fails(capsys, sample.main, f"--out_dir={tmp_path}")
        assert code == 2 and "truncated or corrupt checkpoint" in err and "arbitrary code" not in err, err
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


def test_out_dir_given_as_the_checkpoint_file_names_the_folder(trained_run, capsys):
    import sample

    with pytest.raises(SystemExit) as exit:
        sample.main([f"--out_dir={trained_run}/ckpt.pt", "--device=cpu"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == (f"error: {trained_run}/ckpt.pt is the checkpoint file; out_dir takes its "
                                               f"folder: --out_dir={trained_run}")


def test_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        sample.main([f"--out_dir={tmp_path}"])
    assert exit.value.code == 2 and "no such checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# Locks


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


def test_run_lock_without_fcntl(tmp_path, monkeypatch):
    """Where fcntl does not exist (Windows) the lock is skipped, and says it took nothing over."""
    from checkpoint import RunLock

    real_import = builtins.__import__

    def no_fcntl(name, *args, **kwargs):
        if name == "fcntl":
            raise ImportError("No module named 'fcntl'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_fcntl)
    lock = RunLock(str(tmp_path / "run")).acquire()
    assert lock.took_over is None and os.path.isdir(tmp_path / "run")
    lock.release()


def test_unwritable_out_dir(capsys, tmp_path, char_dataset):
    (tmp_path / "file").write_text("not a directory")
    code, err = fails(capsys, train.main, *TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'file' / 'out'}",
                      "--max_iters=2")
    assert code == 2 and "cannot write to out_dir" in err and "Not a directory" in err


# ---------------------------------------------------------------------------------------------------
# Atomic writes: disk full, SIGKILL


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


# Fault injection: SIGKILL a training run at random moments, including in the middle of writing a
# checkpoint, resume, repeat; the result must equal an uninterrupted run's bit for bit, and no checkpoint
# on disk may ever be unreadable. The fast variant (4 kills) runs in CI; the long one runs on demand:
#     FAULT_KILLS=25 python -m pytest tests/test_checkpoint.py::test_sigkill_at_random_moments_loses_nothing -s

KILLS = int(os.environ.get("FAULT_KILLS", "4"))
ITERS = max(60, 8 * KILLS)  # long enough that every planned kill lands before the run ends
RUN = [*TINY_RUN, f"--max_iters={ITERS}", "--eval_interval=3", "--eval_iters=1", "--dropout=0.1"]

# Runs train.py; on the N-th checkpoint write, after the data is in the temporary file and before the
# rename, the process kills itself: the worst moment to die.
KILL_IN_SAVE = """
import os, signal, sys
sys.path.insert(0, {root!r})
real_fsync, seen = os.fsync, [0]
def fsync(fd):
    name = os.readlink(f"/proc/self/fd/{{fd}}")
    if "ckpt.pt.tmp." in name:
        seen[0] += 1
        if seen[0] == {n}:
            os.kill(os.getpid(), signal.SIGKILL)
    return real_fsync(fd)
os.fsync = fsync
import train
train.main(sys.argv[1:])
"""


def history(out_dir):
    """Every logged value that must not depend on interruptions (not timings)."""
    keep = ("iter", "loss", "ce", "lr", "grad_norm", "train_loss", "val_loss")
    return [{k: r[k] for k in keep if k in r} for r in read_metrics(out_dir)]


def start(args, kill_in_save=None):
    code = ["-c", KILL_IN_SAVE.format(root=str(ROOT), n=kill_in_save)] if kill_in_save else ["train.py"]
    return subprocess.Popen([sys.executable, *code, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_sigkill_at_random_moments_loses_nothing(tmp_path, char_dataset):
    kills_wanted = KILLS
    rng = random.Random(int(os.environ.get("FAULT_SEED", "0")))
    train.main([*RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'reference'}"])

    out = tmp_path / "killed"
    ckpt = out / "ckpt.pt"
    kills = resumes = in_save = checks = 0
    while True:
        resume = ckpt.exists()
        args = [*RUN, f"--dataset={char_dataset}", f"--out_dir={out}"] + (["--init_from=resume"] if resume else [])
        resumes += resume
        if kills < kills_wanted and kills % 3 == 2:  # every third kill: in the middle of a checkpoint write
            proc = start(args, kill_in_save=rng.randint(1, 3))
            proc.communicate(timeout=300)
            in_save += proc.returncode == -signal.SIGKILL
        elif kills < kills_wanted:  # after a random number of steps
            proc = start(args)
            steps = rng.randint(1, 12)
            for line in proc.stdout:
                steps -= line.startswith("iter ")
                if steps == 0:
                    proc.kill()
                    break
            proc.communicate(timeout=300)
        else:
            proc = start(args)
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            break
        if proc.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert proc.returncode == 0, proc.stderr.read()[-2000:] if proc.stderr else ""
            break  # it finished before the kill came
        if ckpt.exists():  # whatever moment it died at, the checkpoint on disk is whole
            load_checkpoint(str(ckpt))
            checks += 1

    assert kills >= min(kills_wanted, 2), f"only {kills} kills landed"
    assert history(out) == history(tmp_path / "reference")
    final, reference = load_checkpoint(str(ckpt)), load_checkpoint(str(tmp_path / "reference" / "ckpt.pt"))
    differing = [k for k in reference["model"] if not torch.equal(reference["model"][k], final["model"][k])]
    assert final["iter_num"] == ITERS and differing == []
    assert not list(out.glob("*.tmp.*"))
    print(f"\nfault injection: {kills} SIGKILLs ({in_save} during a checkpoint write), {resumes} resumes, "
          f"{checks} checkpoints read back after a kill, all readable; final weights and "
          f"{len(history(out))} logged records identical to the uninterrupted run (0 bytes lost)")
