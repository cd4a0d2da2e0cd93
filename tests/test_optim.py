"""optim.py: AdamW's decay groups, the learning-rate schedule, gradient clipping, Muon against torch.optim.Muon."""

import copy
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import optim
import train
from conftest import build
from optim import Muon, adamw_everywhere, newton_schulz


def test_optimizer_decays_matrices_only():
    model = build(mlp="swiglu", norm="rmsnorm", qk_norm=True)
    (opt,) = adamw_everywhere(model, SimpleNamespace(weight_decay=0.1, learning_rate=1e-3, beta1=0.9, beta2=0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["fused"] is True


def test_learning_rate_schedule():
    c = train.TrainConfig(learning_rate=1.0, min_lr=0.1, warmup_iters=10, lr_decay_iters=110, max_iters=200)
    assert optim.get_lr(0, c) == pytest.approx(1 / 11)  # not zero at step 0
    assert optim.get_lr(4, c) == pytest.approx(5 / 11)
    assert optim.get_lr(10, c) == pytest.approx(1.0)  # peak right after warmup
    assert optim.get_lr(60, c) == pytest.approx(0.55)  # half way down the cosine
    assert optim.get_lr(85, c) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.75)))
    assert optim.get_lr(110, c) == pytest.approx(0.1)
    assert optim.get_lr(150, c) == pytest.approx(0.1)
    assert optim.get_lr(50, replace(c, lr_decay_iters=None)) == pytest.approx(
        0.1 + 0.45 * (1 + math.cos(math.pi * 40 / 190)))  # None decays over max_iters


def test_clip_gradients_scales_to_max_norm_and_returns_pre_clip_norm():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    norm = optim.clip_gradients(params, 1.0)
    assert norm.item() == pytest.approx(5.0)
    assert torch.cat([p.grad.flatten() for p in params]).norm().item() == pytest.approx(1.0, rel=1e-5)
    assert params[0].grad[0].item() == pytest.approx(0.6, rel=1e-5)
    assert optim.clip_gradients(params, 10.0).item() == pytest.approx(1.0, rel=1e-5)  # below max: unchanged
    assert optim.clip_gradients(params, 0.0).item() == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Muon


def muon_pair(ns_dtype, adjust_lr_fn, nesterov=True):
    torch.manual_seed(0)
    shapes = [(48, 16), (16, 48), (32, 32)]  # tall, wide, square
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    return ours, theirs, Muon(ours, ns_dtype=ns_dtype, **kwargs), torch.optim.Muon(theirs, **kwargs)


def step_both(ours, theirs, opt_ours, opt_theirs, steps=4):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(ours, theirs):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_in_bf16_is_torch_muon_bit_for_bit(adjust_lr_fn, nesterov):
    ours, theirs, opt_ours, opt_theirs = muon_pair(torch.bfloat16, adjust_lr_fn, nesterov)
    step_both(ours, theirs, opt_ours, opt_theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(opt_ours.state[a]["momentum_buffer"], opt_theirs.state[b]["momentum_buffer"])


def test_muon_in_fp32_is_torch_muon_within_bf16_rounding():
    ours, theirs, opt_ours, opt_theirs = muon_pair(torch.float32, "match_rms_adamw")
    before = [p.detach().clone() for p in ours]
    step_both(ours, theirs, opt_ours, opt_theirs, steps=1)
    for a, b, p0 in zip(ours, theirs, before):
        ours_update, torch_update = a.detach() - p0, b.detach() - p0
        relative = (ours_update - torch_update).norm() / torch_update.norm()
        assert 1e-6 < relative < 2e-2  # different, by about bf16's rounding, and no more


def test_newton_schulz_in_fp32_is_closer_to_the_exact_iteration():
    g = torch.randn(64, 24, generator=torch.Generator().manual_seed(2))
    args = ((3.4445, -4.7750, 2.0315), 5, 1e-7)
    exact = newton_schulz(g.double(), *args, torch.float64)
    error = {dtype: (newton_schulz(g, *args, dtype).double() - exact).abs().max().item()
             for dtype in (torch.float32, torch.bfloat16)}
    assert error[torch.float32] < 1e-5 < error[torch.bfloat16]


def test_a_torch_muon_state_resumes_in_ours():
    """Checkpoints written with torch.optim.Muon (earlier versions) load into ours and continue alike."""
    ours, theirs, opt_ours, opt_theirs = muon_pair(torch.bfloat16, "match_rms_adamw")
    step_both(theirs, ours, opt_theirs, opt_ours, steps=2)  # the same steps, so the weights agree
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    resumed = Muon(fresh, ns_dtype=torch.bfloat16, lr=1.0)
    resumed.load_state_dict(copy.deepcopy(opt_theirs.state_dict()))  # as from a file: no shared buffers
    step_both(fresh, theirs, resumed, opt_theirs, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(fresh, theirs))


SHARD_SHAPES = [(48, 16), (16, 48), (32, 32), (64, 16), (8, 8), (24, 40)]


def muon_steps(shard=None, steps=3):
    """Muon (fp32 Newton-Schulz) over SHARD_SHAPES for a few steps of seeded gradients, the same on every
    rank (as DDP leaves them): the final weights."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHARD_SHAPES]
    opt = Muon(params, ns_dtype=torch.float32, shard=shard, lr=0.02, weight_decay=0.1, momentum=0.9,
               adjust_lr_fn="match_rms_adamw")
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params]


def sharded_muon_worker(rank, world_size, init_file, out):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.save(muon_steps(shard=(rank, world_size)), f"{out}/{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_muon_sharded_over_ranks_is_one_process_bit_for_bit(tmp_path):
    """Under DDP each rank orthogonalises its share of the matrices and broadcasts them (gloo, 2 ranks):
    every rank ends with exactly the weights one process computes."""
    owner = optim.owners([a * b for a, b in SHARD_SHAPES], 2)
    assert sorted(set(owner)) == [0, 1]  # both ranks have work: largest first, to the least loaded
    assert optim.owners([10, 1, 1, 8], 2) == [0, 1, 1, 1]
    torch.multiprocessing.spawn(sharded_muon_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    one = muon_steps()
    for rank in range(2):
        ranks = torch.load(tmp_path / f"{rank}.pt")
        assert all(torch.equal(a, b) for a, b in zip(ranks, one)), rank
