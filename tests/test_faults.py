"""Fault injection: SIGKILL a training run at random moments, including in the middle of writing a
checkpoint, resume, repeat; the result must equal an uninterrupted run's bit for bit, and no checkpoint
on disk may ever be unreadable.

The fast variant (4 kills) runs in CI; the long one runs on demand:
    FAULT_KILLS=25 python -m pytest tests/test_faults.py -s
"""

import os
import random
import signal
import subprocess
import sys

import pytest
import torch

import train
from checkpoint import load_checkpoint
from conftest import ROOT, TINY_RUN, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")]

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
