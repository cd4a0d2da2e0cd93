import copy
import os

import pytest
import torch

import device
from configurator import ConfigError
from conftest import TINY_RUN, run_main
from optim import Muon, newton_schulz

AMX = {"name": "Xeon", "capability": "AVX512", "onednn_bf16": True, "bf16_instructions": ["amx_bf16"], "threads": 2}
AVX2 = {"name": "EPYC", "capability": "AVX2", "onednn_bf16": False, "bf16_instructions": [], "threads": 2}
AVX512_NO_BF16 = {**AMX, "bf16_instructions": []}  # Skylake-X, Cascade Lake: oneDNN emulates bf16


# ---------------------------------------------------------------------------------------------------
# The decision


@pytest.mark.parametrize(
    "facts, speedup, override, fast, why",
    [
        (AVX2, None, None, False, "oneDNN has no bf16 support"),
        (AVX512_NO_BF16, None, None, False, "no AMX or AVX512-BF16"),
        (AMX, 3.6, None, True, "ran 3.6x fp32's speed"),
        (AMX, 0.3, None, False, "ran 0.3x"),  # oneDNN capped below AMX/AVX512-BF16: emulated, slower
        (AMX, 1.1, None, False, "ran 1.1x"),  # about even: fp32's precision wins
        (AMX, None, None, False, "not measured"),
        (AVX2, None, "1", True, "SMALLGPT_BF16=1"),
        (AMX, 3.6, "0", False, "SMALLGPT_BF16=0"),
    ],
)
def test_decide_cpu_picks_bf16_only_where_it_runs_fast(facts, speedup, override, fast, why):
    chosen, reason = device.decide_cpu(facts, speedup, override)
    assert chosen is fast
    assert why in reason and facts["capability"] in reason  # the log line says what torch reported


def test_a_bad_override_is_a_config_error():
    with pytest.raises(ConfigError, match="SMALLGPT_BF16='yes': use 1"):
        device.decide_cpu(AMX, 3.6, "yes")


@pytest.mark.parametrize("override, autocast, ns", [("1", "bfloat16", torch.bfloat16), ("0", "float32", torch.float32)])
def test_the_override_sets_every_cpu_choice(monkeypatch, override, autocast, ns):
    monkeypatch.setenv(device.OVERRIDE, override)
    device.precision.cache_clear()
    try:
        chosen = device.precision("cpu")
        assert (chosen.autocast, chosen.newton_schulz) == (autocast, ns)
        assert device.pick_dtype("auto", "cpu") == autocast
        assert device.pick_dtype("float16", "cpu") == "float16"  # a dtype the user set is kept
    finally:
        device.precision.cache_clear()


def test_this_machine_gets_a_consistent_decision():
    """Whatever CPU runs the tests: bf16 is chosen only with oneDNN bf16 and bf16 instructions."""
    device.precision.cache_clear()
    facts, chosen = device.cpu_facts(), device.precision("cpu")
    if chosen.bf16_fast and device.OVERRIDE not in os.environ:
        assert facts["onednn_bf16"] and facts["bf16_instructions"]
    assert chosen.why.startswith("CPU ") and facts["capability"] in chosen.why


def test_train_says_what_it_chose_first(tmp_path, char_dataset, monkeypatch):
    monkeypatch.setenv(device.OVERRIDE, "0")
    device.precision.cache_clear()  # decided once per process: again with the override, and again after
    try:
        result = run_main("train.py", *TINY_RUN[:-2], "--optimizer=muon", "--max_iters=2", f"--dataset={char_dataset}",
                          f"--out_dir={tmp_path}", "--device=cpu")
    finally:
        device.precision.cache_clear()
    assert result.returncode == 0, result.stderr
    first = result.stdout.splitlines()[0]
    assert first.startswith("precision: float32 (chosen), Muon's Newton-Schulz in float32 | CPU SMALLGPT_BF16=0")


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


def test_measuring_leaves_the_global_rng_alone():
    """Training calls it after restoring a checkpoint's RNG state: moving it would break exact resume."""
    state = torch.get_rng_state()
    assert device.bf16_matmul_speedup(n=64, repeats=1) > 0
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------------------------------------------
# The CPU heap

FAULTS_OF_TRAINING_STEPS = """
import resource, torch, device
from model import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=50257))
opt = torch.optim.AdamW(model.parameters())
x = torch.randint(0, 50257, (8, 33))
def faults_of_steps(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for step in range(n):
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_steps(2)  # the first steps fault their pages in either way
default = faults_of_steps(6)
name = device.pick_device("cpu")
faults_of_steps(4)  # again, now into a heap that keeps them (it settles over a few steps)
print(name, device.keep_freed_memory(), default, faults_of_steps(6))
"""


@pytest.mark.skipif(not (os.uname().sysname == "Linux" and __import__("platform").libc_ver()[0] == "glibc"),
                    reason="the heap setting is glibc's (Linux); elsewhere keep_freed_memory() does nothing")
def test_cpu_runs_reuse_freed_memory_instead_of_faulting_it_back():
    """Each training step frees and re-allocates tensors of the same sizes (here 51 MB of logits and their
    gradient); by default glibc unmaps the big ones and every step faults them back in, page by page.
    After pick_device('cpu') they are reused (measured: 303,100-334,355 page faults in 6 steps against 2-21,989
    over 12 runs; the heap settles over a few steps, so 4 run first)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != device.MALLOC_OVERRIDE}
    done = subprocess.run([sys.executable, "-c", FAULTS_OF_TRAINING_STEPS], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    name, kept, default, after = done.stdout.split()
    assert (name, kept) == ("cpu", "True")
    assert int(default) > 4 * int(after), (default, after)
