"""
Which device, and which dtypes run fast on it: one decision that train.py, sample.py and bench.py share.

On CPUs the answer differs by a factor of 100 between machines. On an AMX Xeon a bf16 matmul runs 3-6x
faster than fp32; on an AVX2 CPU (most laptops and desktops, AMD Zen 2/3) torch has no bf16 matmul kernel
worth the name and one runs 30-100x slower than fp32. So the choice follows what this torch build runs
here: its reported CPU capability, whether oneDNN has bf16 support, whether the CPU has bf16 matrix
instructions, and then a matmul timed once per process (a few milliseconds), because oneDNN also
"supports" bf16 by emulation on CPUs (or under ONEDNN_MAX_CPU_ISA limits) where it is slower than fp32.

SMALLGPT_BF16=1 treats bf16 as fast whatever this finds, SMALLGPT_BF16=0 as slow.
"""

import math
import os
import platform
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from configurator import ConfigError

DEVICES = ("auto", "cpu", "cuda", "mps")  # the device key's values in every script
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")  # the dtype key's: autocast's compute dtype
OVERRIDE = "SMALLGPT_BF16"
MIN_SPEEDUP = 1.5  # bf16 must beat fp32 by this much to be chosen: near 1x, fp32's precision wins


@dataclass(frozen=True)
class Precision:
    """What runs fast here. bf16_fast: bf16 matrix products beat fp32 on this device; autocast: the
    training compute dtype that follows from it; why: one line for the log."""

    device_type: str
    bf16_fast: bool
    autocast: str
    why: str

    @property
    def newton_schulz(self):
        """Muon's orthogonalisation dtype: five chained matmuls per matrix per step."""
        return torch.bfloat16 if self.bf16_fast else torch.float32


def pick_device(name):
    """The device name for a device key's value; on CUDA, also TF32 for fp32 matmuls and convolutions
    (every script: sample, serve, eval and bench ran full-IEEE fp32 before); on CPU, keep_freed_memory()."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available; use device=cpu or device=auto")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS is not available; use device=cpu or device=auto")
    if name == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if name == "cpu":
        keep_freed_memory()
    return name


MALLOC_OVERRIDE = "SMALLGPT_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HEAP_KEEP = 1 << 30


@lru_cache(maxsize=None)
def keep_freed_memory():
    """Tells glibc's malloc to keep freed memory for reuse (up to 1 GiB of it) instead of handing it back
    to the kernel. By default a freed block over its mmap threshold (at most 32 MB) is unmapped and a
    freed heap top over 128 KB is trimmed, so the next training step's tensors of the same sizes fault
    their pages back in, zeroed by the kernel: a CPU step of a GPT-2-vocabulary model spent more time
    in the kernel than in torch (docs/research_log.md, 2026-12-01). True when set; False off glibc (macOS,
    Windows, musl) or with SMALLGPT_MALLOC=0 (the process's memory then shrinks back after a peak)."""
    if os.environ.get(MALLOC_OVERRIDE) == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_TRIM_THRESHOLD, HEAP_KEEP)) and bool(mallopt(M_MMAP_THRESHOLD, HEAP_KEEP))


def cpu_facts():
    """What torch reports about this CPU (cpuinfo's flags are the hardware's, whatever limits the
    environment puts on torch; the capability and oneDNN's bf16 flag follow those limits)."""
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    try:
        onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn_bf16 = False
    return {
        "name": caps.get("cpu_name") or platform.processor() or platform.machine(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": onednn_bf16,
        "bf16_instructions": [k for k in ("amx_bf16", "avx512_bf16") if caps.get(k)],
        "threads": torch.get_num_threads(),
    }


def bf16_matmul_speedup(n=512, rounds=9, min_seconds=0.003):
    """fp32 time / bf16 time of an n x n x n matmul (about 0.1 s): paired_speedup's median over rounds,
    after a warm-up call of each (oneDNN builds its kernels on the first). Each timing repeats its product
    for about min_seconds, both dtypes alike: a short timing and a long one meet another process's load
    unequally (the long one is preempted, the short one slips between), which skews their ratio."""
    g = torch.Generator().manual_seed(0)  # its own: the global RNG (dropout, resumed runs) must not move
    a = torch.randn(n, n, generator=g)
    b = torch.randn(n, n, generator=g)

    def timer(x, y):
        x @ y  # the warm-up (oneDNN's kernels built), then one timed: how many repeats make min_seconds
        start = time.perf_counter()
        x @ y
        repeats = max(1, math.ceil(min_seconds / max(time.perf_counter() - start, 1e-9)))

        def timed():
            start = time.perf_counter()
            for _ in range(repeats):
                x @ y
            return (time.perf_counter() - start) / repeats
        return timed

    return paired_speedup(timer(a, b), timer(a.bfloat16(), b.bfloat16()), rounds)


def paired_speedup(time_slow, time_fast, rounds):
    """The median over rounds of time_slow() / time_fast(), the two timed back to back in each round
    (A, B, A, B ...). The ratio of two separate bests moved with the other core's load (one CPU read
    0.3x to 48.8x across runs), and so did the precision a run trained in; a paired round shares its load,
    and the median needs most rounds disturbed, one side only, before it moves."""
    ratios = []
    for _ in range(rounds):
        slow = time_slow()
        ratios.append(slow / max(time_fast(), 1e-12))
    return statistics.median(ratios)


def decide_cpu(facts, speedup=None, override=None):
    """(bf16_fast, why) for a CPU. facts: cpu_facts(); speedup: bf16_matmul_speedup(), measured only
    when the facts leave the question open (None: not measured); override: SMALLGPT_BF16's value."""
    seen = (f"{facts['name']}, torch {facts['capability']}, oneDNN bf16 {'yes' if facts['onednn_bf16'] else 'no'}, "
            f"bf16 instructions {'+'.join(facts['bf16_instructions']) or 'none'}, {facts['threads']} threads")
    if override is not None:
        if override not in ("0", "1"):
            raise ConfigError(f"{OVERRIDE}={override!r}: use 1 (bf16 is fast here) or 0 (it is not), or unset it")
        return override == "1", f"{OVERRIDE}={override} ({seen})"
    if not facts["onednn_bf16"]:
        return False, f"oneDNN has no bf16 support here ({seen})"
    if not facts["bf16_instructions"]:
        return False, f"no AMX or AVX512-BF16 instructions: bf16 would be emulated ({seen})"
    if speedup is None:
        return False, f"bf16 matmul not measured ({seen})"
    fast = speedup >= MIN_SPEEDUP
    return fast, f"a bf16 matmul ran {speedup:.1f}x fp32's speed (median of paired rounds; {MIN_SPEEDUP}x chooses it) ({seen})"


@lru_cache(maxsize=None)
def precision(device_type):
    """The decision for this process's device, made once."""
    override = os.environ.get(OVERRIDE)
    if device_type == "cuda":
        # pre-Ampere GPUs emulate bf16: fp16 autocast there, and fp32 for Muon (fp16 overflows in it)
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        fast = native if override is None else override == "1"
        name = torch.cuda.get_device_name()
        return Precision("cuda", fast, "bfloat16" if native else "float16",
                         f"{name}: {'native' if native else 'no native'} bf16")
    if device_type == "mps":
        return Precision("mps", False, "float32", "MPS: fp32 (bf16 autocast on MPS not measured here)")
    facts = cpu_facts()
    needs_measuring = override is None and facts["onednn_bf16"] and facts["bf16_instructions"]
    fast, why = decide_cpu(facts, bf16_matmul_speedup() if needs_measuring else None, override)
    return Precision("cpu", fast, "bfloat16" if fast else "float32", "CPU " + why)


def pick_dtype(name, device_type):
    """The training compute dtype: name, or for 'auto' what precision() found fast."""
    return precision(device_type).autocast if name == "auto" else name


def autocast(device_type, dtype):
    """The autocast context for a compute dtype name; float32 is no autocast at all."""
    if dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, dtype))


# ----------------------------------------------------------------------------------------------------
# Distributed


def attempt_store(rank, size):
    """init_process_group's store for a worker that torchrun restarted (--max-restarts): the rendezvous
    store with keys of this attempt's own. Without it the new group reads the killed group's addresses and
    fails to connect (pytorch/pytorch#167288, seen here with gloo). {} (torch's default) on a first start."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        return {}
    from datetime import timedelta

    from torch.distributed.rendezvous import _create_c10d_store

    store = _create_c10d_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, size,
                               timedelta(minutes=10))
    return {"store": dist.PrefixStore(f"smallgpt/attempt_{attempt}", store), "rank": rank, "world_size": size}


class Dist:
    """Rank, world size and the collectives this script needs; a no-op world of one without torchrun."""

    def __init__(self, device_type, timeout=None):
        """timeout: seconds a collective waits for a peer (None: torch's, 10 min for nccl, 30 for gloo)."""
        from datetime import timedelta

        self.enabled = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self.failed = False  # set when the run ends with an error: close() then skips its barrier
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.size = int(os.environ.get("WORLD_SIZE", 1))
        if self.enabled:
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                    timeout=None if timeout is None else timedelta(seconds=timeout),
                                    **attempt_store(self.rank, self.size))
        self.master = self.rank == 0

    def mean(self, tensor):
        if self.enabled:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            tensor /= self.size
        return tensor

    def sum(self, tensor):
        if self.enabled:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
        return tensor

    def any(self, flag, device):
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all(self, flag):
        """A boolean tensor true on every rank (an all-reduce of its minimum)."""
        t = flag.to(torch.int32).reshape(1)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t[0].bool()

    def gather(self, obj):
        if not self.enabled:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def close(self):
        if self.enabled and not self.failed:
            # A barrier first: it waits with the GIL released, so gloo's worker thread can free the last
            # collective's work (all_gather_object's holds Python tensors). Without it the DDP reducer,
            # freed later with the GIL held, joined that thread while it waited for the GIL: a deadlock
            # at exit seen about once in a few CI runs.
            dist.barrier()
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# MFU

# Dense tensor-core peaks, FLOP/s, from NVIDIA's datasheets (sparsity halved away): (name pattern, bf16/fp16,
# tf32 or, without TF32, fp32). Most specific first; a name matches at word boundaries ("L40" is not "L4",
# "H20" is not "H200"), and the NVL and PCIe parts are their own rows.
CUDA_PEAK_FLOPS = [
    (r"B200", 2250e12, 1100e12),
    (r"GB200", 2500e12, 1250e12),
    (r"H200 NVL", 835e12, 418e12), (r"H200", 989e12, 494e12), (r"GH200", 989e12, 494e12),
    (r"H100 NVL", 835e12, 418e12), (r"H100 PCIe", 756e12, 378e12), (r"H100", 989e12, 494e12),
    (r"H800 PCIe", 756e12, 378e12), (r"H800", 989e12, 494e12),
    (r"H20", 148e12, 74e12),
    (r"A100", 312e12, 156e12), (r"A800", 312e12, 156e12),
    (r"L40S", 362e12, 183e12), (r"L40", 181e12, 90.5e12), (r"L4", 121e12, 60e12),
    (r"A10G", 70e12, 35e12), (r"A10", 125e12, 62.5e12),
    (r"RTX 4090", 165e12, 82.6e12), (r"RTX 3090", 71e12, 35.6e12),
    (r"V100", 125e12, 15.7e12), (r"T4", 65e12, 8.1e12),  # no TF32: fp32's own peak
]  # fmt: skip


def peak_flops_of(name, dtype="bfloat16"):
    """A GPU's dense peak for a compute dtype (float32 runs use TF32, which train.py allows), or None."""
    import re

    for pattern, half, single in CUDA_PEAK_FLOPS:
        if re.search(rf"\b{pattern}\b", name):
            return single if dtype == "float32" else half
    return None


def cuda_peak_flops(device, dtype="bfloat16"):
    return peak_flops_of(torch.cuda.get_device_name(device), dtype)


def estimate_mfu(model, tokens_per_sec, seq_len, device=None, peak_flops=None, dtype="bfloat16"):
    """Model FLOPs utilisation: achieved training FLOP/s over the device's peak. peak_flops wins; else a
    CUDA device's dense tensor-core peak for the compute dtype from the table; else (CPU, unknown GPU) None: a CPU's
    peak must be measured (bench.py does)."""
    if peak_flops is None and device is not None and torch.device(device).type == "cuda":
        peak_flops = cuda_peak_flops(device, dtype)
    if peak_flops is None:
        return None
    return model.flops_per_token(seq_len) * tokens_per_sec / peak_flops
