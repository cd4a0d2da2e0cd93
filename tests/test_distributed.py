"""train.py under torchrun on CPU (gloo): DDP and FSDP2 must train exactly like one process."""

import pytest

from conftest import TINY_RUN, read_metrics, run_main, run_script

pytestmark = pytest.mark.slow


def step_losses(out_dir):
    return [r["loss"] for r in read_metrics(out_dir) if "loss" in r]


def torchrun(out_dir, dataset, *extra):
    result = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY_RUN,
                        f"--dataset={dataset}", f"--out_dir={out_dir}", "--max_iters=5", *extra,
                        env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return step_losses(out_dir)


def test_ddp_and_fsdp_match_one_process(tmp_path, char_dataset):
    """2 processes x 2 accumulation steps each = 1 process x 4: FSDP2 with AdamW, and DDP with Muon, whose
    Newton-Schulz each rank does for its share of the matrices and broadcasts (optim.Muon's shard)."""
    def single(name, *extra):
        result = run_main("train.py", *TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / name}",
                          "--max_iters=5", "--gradient_accumulation_steps=4", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        return step_losses(tmp_path / name)

    muon = ["--optimizer=muon", "--learning_rate=1e-2"]
    one, one_muon = single("single"), single("single_muon", *muon)
    fsdp = torchrun(tmp_path / "fsdp", char_dataset, "--gradient_accumulation_steps=4", "--fsdp=True")
    ddp = torchrun(tmp_path / "ddp", char_dataset, "--gradient_accumulation_steps=4", *muon)
    assert len(one) == len(fsdp) == len(one_muon) == len(ddp) == 5
    assert max(abs(a - b) for a, b in zip(one, fsdp)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(one_muon, ddp)) <= 1e-5
    assert one[0] != one[-1] and one_muon[-1] != one[-1]  # both trained, differently


def test_a_config_error_under_torchrun_is_in_its_failure_summary(tmp_path, char_dataset):
    """Each worker's one-line error goes to torchrun's error file, so torchrun's closing summary shows it
    (it said "To enable traceback see: ..." there, the line itself buried in the output above)."""
    result = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY_RUN,
                        f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--eval_iters=3",
                        "--gradient_accumulation_steps=2", env={"OMP_NUM_THREADS": "1"})
    summary = result.stderr[result.stderr.index("Root Cause") :]
    assert result.returncode != 0
    assert "traceback : error: eval_iters=3 must be divisible by the number of processes (2)" in summary, summary


def kill_one_worker_at(out_dir, dataset, iteration, *torchrun_flags, sig=None, stopped_until=None, extra=()):
    """torchrun with 2 workers (60 steps, a checkpoint every 20, init_from=auto); kill -9 of one worker once
    `iteration` is logged. Returns (seconds from the kill to the end, return code, output). With
    sig=SIGSTOP (a node that falls silent: no connection is reset), seconds until a line containing
    stopped_until appears; then the stopped worker is killed, as a lost node's processes would be."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *torchrun_flags,
            "train.py", *TINY_RUN, f"--dataset={dataset}", f"--out_dir={out_dir}", "--max_iters=60",
            "--eval_interval=20", "--gradient_accumulation_steps=2", "--init_from=auto", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: nothing outlives the test
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(f"iter {iteration}:"):
                break
        ps = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout.split("\n")[1:]
        workers = [int(pid) for pid, ppid in (row.split() for row in ps if row.strip()) if int(ppid) == proc.pid]
        assert len(workers) == 2
        killed = time.time()
        os.kill(workers[1], sig or signal.SIGKILL)
        if stopped_until is not None:
            import threading

            def kill_all():  # torchrun's workers have sessions of their own: killed one by one
                for pid in workers:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

            guard = threading.Timer(90, kill_all)  # without a working timeout the wait would be 30 minutes
            guard.start()
            for line in proc.stdout:
                seen.append(line)
                if stopped_until in line:
                    break
            seconds = time.time() - killed
            guard.cancel()
            if proc.poll() is None:
                os.kill(workers[1], signal.SIGKILL)
            return seconds, proc.wait(timeout=120), "".join(seen) + proc.communicate(timeout=120)[0]
        output = proc.communicate(timeout=120)[0]
        return time.time() - killed, proc.returncode, output
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_killed_worker_ends_the_job_and_a_restart_resumes_bit_exact(tmp_path, char_dataset):
    from checkpoint import load_checkpoint

    straight = torchrun(tmp_path / "straight", char_dataset, "--max_iters=60", "--eval_interval=20",
                        "--gradient_accumulation_steps=2")  # first: the runs below leave killed workers behind them
    # no restarts: the job ends (gloo sees the peer gone), with torchrun naming the killed worker; the last
    # checkpoint (iteration 40) loads. torchrun looks at its workers every 3 s here, not 0.1: on a busy
    # machine it could stop rank 0 before rank 0 had seen the peer gone and said so
    seconds, code, output = kill_one_worker_at(tmp_path / "dies", char_dataset, 45, "--monitor-interval=3")
    assert code != 0 and seconds < 60 and "Signal 9 (SIGKILL)" in output
    assert "error: rank 0: another process of this job is gone" in output and "restart with --init_from=auto" in output
    assert load_checkpoint(str(tmp_path / "dies" / "ckpt.pt"))["iter_num"] == 40
    # --max-restarts=1 with init_from=auto: the restarted workers resume from it and end as if never killed
    seconds, code, output = kill_one_worker_at(tmp_path / "restarts", char_dataset, 45, "--max-restarts=1")
    assert code == 0 and "init_from=auto: resuming" in output, output[-3000:]
    assert step_losses(tmp_path / "restarts") == straight and len(straight) == 60


def test_a_silent_worker_ends_the_job_after_dist_timeout(tmp_path, char_dataset):
    """A node lost across hosts resets no connection: its peers wait in their next collective. SIGSTOP
    stands in for it; with --dist_timeout=3 the other rank gives up after 3 s with the one line (torch's
    default would wait 30 minutes on gloo), and the last checkpoint (iteration 20) loads."""
    import signal

    from checkpoint import load_checkpoint

    silent = "another process of this job is gone or silent"
    seconds, code, output = kill_one_worker_at(tmp_path, char_dataset, 25, sig=signal.SIGSTOP, stopped_until=silent,
                                               extra=["--dist_timeout=3"])
    assert silent in output and "Timed out" in output and "restart with --init_from=auto" in output, output[-3000:]
    assert seconds < 60 and code != 0  # "Timed out" above: the timeout ended it (its wait may start before the stop)
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 20


def test_ddp_fine_tuning_on_conversations_matches_one_process(tmp_path, trained_run, chat_data):
    """SFT with LoRA: 2 processes x 2 micro-batches = 1 process x 4, though each micro-batch holds another
    count of trained tokens (the loss is normalised by the whole step's count, over both processes)."""
    from conftest import SFT_RUN

    keys = [*SFT_RUN, f"--init_from={trained_run}", f"--dataset={chat_data[1]}", "--max_iters=3", "--eval_interval=3",
            "--eval_iters=2", "--gradient_accumulation_steps=4", "--lora_rank=4", "--lora_targets=all"]
    one = run_main("train.py", *keys, f"--out_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *keys,
                     f"--out_dir={tmp_path / 'two'}", env={"OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(a) == len(b) == 3 and max(abs(x - y) for x, y in zip(a, b)) <= 1e-5 and a[0] != a[-1]
