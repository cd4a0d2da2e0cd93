"""torchrun on CPU (gloo): DDP and FSDP2 must train exactly like one process."""

import pytest

from conftest import TINY_RUN, read_metrics, run_script

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
    single = run_script("train.py", *TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'single'}",
                        "--max_iters=5", "--gradient_accumulation_steps=4")
    assert single.returncode == 0, single.stderr[-3000:]
    one = step_losses(tmp_path / "single")
    # 2 processes x 2 accumulation steps each = 1 process x 4
    ddp = torchrun(tmp_path / "ddp", char_dataset, "--gradient_accumulation_steps=4")
    fsdp = torchrun(tmp_path / "fsdp", char_dataset, "--gradient_accumulation_steps=4", "--fsdp=True")
    assert len(one) == len(ddp) == len(fsdp) == 5
    assert max(abs(a - b) for a, b in zip(one, ddp)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(ddp, fsdp)) <= 1e-5
    assert one[0] != one[-1]  # it trained
