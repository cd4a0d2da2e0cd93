"""
Weights for inference: one-row products through RowLinear, int8 (llama.cpp's Q8_0 blocks) through Int8Linear,
both on rowdot.cpp where it builds, the weights in huge pages, and for_inference, the one entry point
sample.py, eval.py and bench.py use. Decoding one token reads every weight once, so its speed is the bytes
per weight and the bandwidth of the kernel that reads them.
"""

import ctypes
import hashlib
import os
import platform
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention.kernels
from configurator import ConfigError
from device import precision


# ----------------------------------------------------------------------------------------------------
# rowdot.cpp: our one-row kernel (float32, bfloat16, int8 in Q8_0 blocks), built here on first use with the
# compiler torch.compile uses too, once per CPU (-march=native), and kept under torch's extension cache. Where
# it cannot be built (no compiler, another OS) everything runs on torch's own kernels: the same products, slower.

KERNEL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rowdot.cpp")
KERNEL_OFF = "SMALLGPT_KERNEL"  # =0: never build or use rowdot.cpp (torch's kernels only)
STALE_LOCK_SECONDS = 300  # a build takes 5-30 s: a lock file older than this was left by one that died
_kernel = {}  # "op": torch.ops.smallgpt.rowdot or None, "why": the reason it is None
_building = threading.Lock()


def cpu_identity():
    """What -march=native compiles for: the CPU's model and flags (Linux), else the platform and torch's ISA."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"


def rowdot_kernel():
    """torch.ops.smallgpt.rowdot, built on first use, or None where it cannot be (kernel_status() says why)."""
    if "op" not in _kernel:
        with _building:  # (a server's threads: one builds, the others wait for its answer)
            if "op" not in _kernel:
                _kernel.update(zip(("op", "why"), find_kernel()))
    return _kernel["op"]


def find_kernel():
    """(op, "") or (None, why not)."""
    if os.environ.get(KERNEL_OFF, "1") == "0":
        return None, f"{KERNEL_OFF}=0"
    if not sys.platform.startswith("linux"):
        return None, "built on Linux only"
    try:
        return build_kernel(), ""
    except Exception as e:  # no compiler, headers, ninja: torch's kernels instead, said once
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        reason = next((line for line in lines if any(w in line for w in ("error:", "not found", "required"))),
                      lines[0].split(":")[0])  # the compiler's own words, else torch's first
        why = f"could not be built: {reason[:200]}"
        print(f"note: rowdot.cpp {why} (a C++ compiler and ninja build it); decoding on a CPU uses torch's slower "
              "kernels", file=sys.stderr)
        return None, why


def kernel_status():
    """'rowdot.cpp' when our kernel runs here, else why not (bench.py's machine lines)."""
    return "rowdot.cpp (built for this CPU)" if rowdot_kernel() is not None else f"torch's ({_kernel['why']})"


def build_kernel():
    from torch.utils.cpp_extension import load

    flags = ["-O3", "-march=native", "-fopenmp"]
    with open(KERNEL_SOURCE, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(source + cpu_identity().encode() + " ".join(flags).encode() + torch.__version__.encode())
    name = f"smallgpt_rowdot_{digest.hexdigest()[:12]}"  # another CPU, source or torch: another build
    try:  # a build interrupted (Ctrl-C) leaves its lock file, on which torch's next load would wait forever
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, False), "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_SECONDS:
            os.remove(lock)
    except (ImportError, OSError):
        pass
    load(name=name, sources=[KERNEL_SOURCE], extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False)
    op = torch.ops.smallgpt.rowdot
    torch.library.register_fake("smallgpt::rowdot", lambda x, weight, scale, bias: x.new_empty(x.size(0), weight.size(0)))
    torch.library.register_fake("smallgpt::one_query_attention", lambda q, k, v, mask: q.new_empty(q.shape))  # contiguous, as the op's
    attention.kernels.ONE_QUERY["op"] = torch.ops.smallgpt.one_query_attention  # a compiled CPU step's attention
    return op


def reference_rowdot(x, weight, scale=None, bias=None):
    """What rowdot.cpp computes, in torch: x (M, K) times weight (N, K) in float32, returned in x's dtype. For
    int8 weights (scale: their blocks'), x is quantised in blocks of 32 too, each block's dot product is an
    exact integer, and the row is their sum times both blocks' scales (llama.cpp's Q8_0 x Q8_0)."""
    bias = None if bias is None else bias.float()
    if scale is None:
        return F.linear(x.float(), weight.float(), bias).to(x.dtype)
    qx, sx = quantize_blocks(x, half_scales=False)
    wb, xb = in_blocks(weight.float()).transpose(0, 1), in_blocks(qx.float()).transpose(0, 1)  # (blocks, N or M, 32)
    dots = torch.bmm(xb, wb.transpose(1, 2))  # (blocks, M, N): integers below 2^24, exact in float32
    y = (dots * sx.t()[:, :, None] * scale.float().t()[:, None, :]).sum(0)
    return (y if bias is None else y + bias).to(x.dtype)


def rowdot_op():
    """rowdot.cpp's op, or a RuntimeError (which measuring reads as "cannot run here")."""
    op = rowdot_kernel()
    if op is None:
        raise RuntimeError(f"rowdot.cpp does not run here: {_kernel['why']}")
    return op


def rowdot(x, weight, scale=None, bias=None):
    """rowdot.cpp's product where it runs here, else reference_rowdot (the same numbers up to summation order)."""
    op = rowdot_kernel()
    return (op or reference_rowdot)(x, weight, scale, bias)


# ----------------------------------------------------------------------------------------------------
# Huge pages: a decode step reads every weight once, and with 4 KiB pages the TLB misses on every page of
# them; 2 MiB pages read the same weights up to 1.4x faster on a Xeon whose cache holds them
# (docs/benchmarks.md). Linux gives them to memory advised MADV_HUGEPAGE before it is touched.

HUGE = 2 << 20
MADV_HUGEPAGE = 14


def in_huge_pages(t):
    """A copy of t in memory advised for 2 MiB pages (Linux; t itself elsewhere, or when it is small)."""
    nbytes = t.numel() * t.element_size()
    if not sys.platform.startswith("linux") or nbytes < 2 * HUGE or t.device.type != "cpu":
        return t
    raw = torch.empty(nbytes + HUGE, dtype=torch.uint8)  # untouched: pages are chosen when first written
    offset = -raw.data_ptr() % HUGE
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(nbytes - nbytes % HUGE), MADV_HUGEPAGE)
    except (OSError, AttributeError):
        return t
    out = raw[offset : offset + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def weights_in_huge_pages(model):
    """Every large parameter and buffer of the model moved into huge pages, in place (tied weights stay tied)."""
    done = {}
    for module in model.modules():
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t is None:
                continue
            if id(t) not in done:  # a weight laid out transposed (TRANSPOSED products) keeps its layout
                transposed = t.dim() == 2 and not t.is_contiguous() and t.t().is_contiguous()
                done[id(t)] = in_huge_pages(t.detach().t()).t() if transposed else in_huge_pages(t.detach().contiguous())
            if isinstance(t, nn.Parameter):
                t.data = done[id(t)]
            else:
                setattr(module, name, done[id(t)])
    return model


def onednn_linear(row, weight, bias):
    return torch.ops.mkldnn._linear_pointwise(row, weight, bias, "none", [], "")


_bag_indices = {}  # (in_features, bags) -> (indices, offsets)


def bags_linear(row, weight, bias):
    """row @ weight.T as a weighted sum of weight.T's rows: fbgemm's embedding_bag reads them at memory speed
    with one bag per thread where BLAS's matrix-vector product does not (AMD, docs/research_log.md). It wants
    weight stored transposed (TRANSPOSED), so that weight.t() is the contiguous table; the bags' partial
    sums are added after."""
    k = weight.size(1)
    bags = max(1, min(torch.get_num_threads(), k))
    if (k, bags) not in _bag_indices:
        _bag_indices[k, bags] = (torch.arange(k), torch.arange(bags) * k // bags)
    indices, offsets = _bag_indices[k, bags]
    y = F.embedding_bag(indices, weight.t(), offsets, mode="sum", per_sample_weights=row[0]).sum(0, keepdim=True)
    return y if bias is None else y + bias


# One row times a weight matrix, six ways (row: 1 x in_features). MKL streams the weights at memory speed
# in "linear" on Intel CPUs and at one thread's bandwidth on AMD ones (or under MKL_CBWR=COMPATIBLE, its
# generic code), where "bags" reads them with every thread on some CPUs, and on others MKL's kernel for the
# other layout ("linear_t": the same F.linear over the weight stored transposed) reads a tall matrix
# 1.3-1.6x faster than its own row-major one; aten's own bf16 kernel reads bf16 weights at under half
# fp32's bytes/s in "linear" but not in mv (docs/research_log.md). Which is fastest differs by CPU, dtype
# and the matrix's shape, so each shape of a model gets its own, measured. Their order is the order of
# preference: a later one is chosen only when it is clearly faster.
ROW_PRODUCTS = {
    "linear": F.linear,
    "addmv": lambda row, weight, bias: torch.mv(weight, row[0]) if bias is None else torch.addmv(bias, weight, row[0]),
    "mv": lambda row, weight, bias: torch.mv(weight, row[0]) if bias is None else torch.mv(weight, row[0]) + bias,
    "onednn": onednn_linear,
    "linear_t": F.linear,
    "bags": bags_linear,
    "rowdot": lambda row, weight, bias: rowdot_op()(row, weight, None, bias),
}
TRANSPOSED = {"linear_t", "bags"}  # products that read weights stored transposed (weight.t() contiguous); the others, as stored
ROW_OVERRIDE = "SMALLGPT_ROW_PRODUCT"
MIN_GAIN = 1.2  # a later product must beat the chosen one by this much: near ties keep the earlier one, run after run
DROP_BELOW = 1 / 3  # a product under this fraction of the best one's speed in the first timed round is not timed again
MEASURED_BYTES = 64 << 20  # at most this much of a shape's weights (at least one matrix) is streamed per timing
TIMED_BYTES = 320 << 20  # rounds per product: enough to stream about this much (5 to 15; small shapes are noisier)
_chosen = {}  # (dtype, out_features, in_features) -> (name, {name: GB/s}): the decision, once per process


def laid_out(weight, product):
    """weight's values stored as `product` reads them best: transposed for TRANSPOSED, else row-major."""
    return weight.t().contiguous().t() if product in TRANSPOSED else weight.contiguous()


def shape_key(weight):
    return weight.dtype, *weight.shape


def use_row_product(model, product):
    """Every RowLinear of the model computes one row with `product` (a name, or {shape_key: name} as
    row_products gives), its weight laid out for it (in place: the same Parameters, so a tied head stays
    tied; the embedding's lookups read the same values)."""
    for m in model.modules():
        if isinstance(m, RowLinear):
            m.product = product if isinstance(product, str) else product[shape_key(m.weight)]
            m.weight.data = laid_out(m.weight.data, m.product)


RUN_ERRORS = (RuntimeError, AttributeError, NotImplementedError)  # e.g. oneDNN without bf16 or fp16, or no oneDNN


def runs_here(name, linears):
    """Whether row product `name` runs on these (weight, bias) pairs on this CPU and build."""
    try:
        with torch.no_grad():
            for w, b in linears:
                ROW_PRODUCTS[name](torch.zeros(1, w.size(1), dtype=w.dtype), laid_out(w, name), b)
    except RUN_ERRORS:
        return False
    return True


def time_row_products(linears, rounds=5, names=ROW_PRODUCTS):
    """{name: GB/s} of each row product (of names) over these (weight, bias) pairs (all of one shape, or
    not), best of interleaved rounds; 0.0 for one that cannot run here, and a product far behind the best
    after the first timed round keeps that round's figure (its time is not worth spending)."""
    generator = torch.Generator().manual_seed(0)
    rows = {w.size(1): torch.randn(1, w.size(1), generator=generator).to(w.dtype) for w, _ in linears}
    best = dict.fromkeys(names, float("inf"))
    products = {name: ROW_PRODUCTS[name] for name in names}
    transposed = [(laid_out(w, "bags"), b) for w, b in linears] if TRANSPOSED & set(products) else []
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms up (and pages the weights in)
            for name, product in list(products.items()):
                start = time.perf_counter()
                try:
                    for w, b in transposed if name in TRANSPOSED else linears:
                        product(rows[w.size(1)], w, b)
                except RUN_ERRORS:
                    del products[name]
                    continue
                if r:
                    best[name] = min(best[name], time.perf_counter() - start)
            if r == 1:
                leader = min(best.values())
                products = {name: p for name, p in products.items() if leader >= DROP_BELOW * best[name]}
    size = sum(w.numel() * w.element_size() for w, _ in linears)
    return {name: size / seconds / 1e9 for name, seconds in best.items()}  # 0.0: cannot run here


SEVERAL_ROWS = 16  # a prefill's chunk, a server's batch: what F.linear computes over a RowLinear's weight
TRANSPOSED_SLOWDOWN = 1.5  # F.linear over several rows may be this much slower on a transposed weight, no more
TIMED_MACS = 1 << 21  # each of transposed_is_fine's timings repeats F.linear until it has done this many multiply-adds


def transposed_is_fine(weight, bias, rounds=2):
    """Whether F.linear over several rows is not much slower on weight stored transposed than on it stored
    row-major (timed on its first 1024 output rows, each timing at least TIMED_MACS): a TRANSPOSED
    product lays the weight out for one row, and prefills and batches read the same weight through F.linear.
    Without fast bf16 (AVX2) torch's bf16 matmul over a transposed weight is 7-14x slower
    (docs/research_log.md), which no one-row gain repays."""
    if min(weight.shape) == 1:  # a single row or column: both layouts are the same memory
        return True
    weight = weight[:1024]
    bias = None if bias is None else bias[:1024]
    x = torch.randn(SEVERAL_ROWS, weight.size(1), generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    calls = max(1, TIMED_MACS // (SEVERAL_ROWS * weight.numel()))
    row_major, transposed = weight.contiguous(), laid_out(weight, "bags")
    best = fastest({"row-major": lambda: [F.linear(x, row_major, bias) for _ in range(calls)],
                    "transposed": lambda: [F.linear(x, transposed, bias) for _ in range(calls)]}, rounds)
    return best["transposed"] <= TRANSPOSED_SLOWDOWN * best["row-major"]


def fastest(runs, rounds):
    """{name: seconds}: the best time of each run() over `rounds` interleaved rounds, after one that warms up."""
    best = dict.fromkeys(runs, float("inf"))
    with torch.no_grad():
        for r in range(rounds + 1):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if r:
                    best[name] = min(best[name], time.perf_counter() - start)
    return best


def pick_row_product(speeds):
    """The name to use, from time_row_products' figures (a product not timed counts as 0): by ROW_PRODUCTS'
    order, a later one only at MIN_GAIN times the speed of the one chosen so far."""
    chosen = next(iter(ROW_PRODUCTS))
    for name in ROW_PRODUCTS:
        if speeds.get(name, 0.0) >= MIN_GAIN * speeds.get(chosen, 0.0):
            chosen = name
    return chosen


def by_shape(linears, chosen, key, override_name, names, decide):
    """{shape_key: name} for these (weight, bias) pairs: each shape decided once per process, kept in
    `chosen` under key(shape_key), by decide(pairs, measured) -> (name, figures), where measured are the
    shape's first matrices up to MEASURED_BYTES (at least one); the environment variable override_name,
    when set to one of names, decides every shape without measuring."""
    override = os.environ.get(override_name)
    if override is not None and override not in names:
        raise ConfigError(f"{override_name}={override!r}: use one of {', '.join(names)}, or unset it")
    shapes = {}
    for w, b in linears:
        shapes.setdefault(shape_key(w), []).append((w, b))
    for shape, pairs in shapes.items():
        if key(shape) in chosen:
            continue
        if override:
            chosen[key(shape)] = (override, {})
            continue
        measured, size = [], 0
        for w, b in pairs:
            if size < MEASURED_BYTES:
                measured.append((w, b))
                size += w.numel() * w.element_size()
        chosen[key(shape)] = decide(pairs, measured)
    return {shape: chosen[key(shape)][0] for shape in shapes}


def row_products(linears):
    """{shape_key: name}: the row product for each shape of one-row Linears among these (weight, bias) pairs
    on this CPU, measured once per process and shape over the model's matrices of that shape (in all under
    a second or two for GPT-2 small), as device.precision decides bf16. SMALLGPT_ROW_PRODUCT=name chooses
    without measuring."""

    def decide(pairs, measured):
        transposed = transposed_is_fine(*pairs[0])
        size = sum(w.numel() * w.element_size() for w, _ in measured)
        speeds = time_row_products(measured, rounds=max(5, min(15, TIMED_BYTES // size)),
                                   names=[name for name in ROW_PRODUCTS if transposed or name not in TRANSPOSED])
        return pick_row_product(speeds), speeds

    return by_shape(linears, _chosen, lambda shape: shape, ROW_OVERRIDE, ROW_PRODUCTS, decide)


def row_product_choices():
    """{'dtype out x in': 'name (GB/s of each)'} for the decisions this process made: bench.py's machine lines."""
    return {f"{str(dtype).replace('torch.', '')} {n}x{k}": name + (
                " (" + ", ".join(f"{p} {v:.1f}" for p, v in speeds.items()) + " GB/s)" if speeds else f" ({ROW_OVERRIDE})")
            for (dtype, n, k), (name, speeds) in _chosen.items()}


# A server's batch: several rows at once. F.linear (MKL's gemm on most builds) packs the weight for its
# kernel on every call, which at 32 rows costs as much as the product on some CPUs; oneDNN over a copy of
# the weight packed once at load (_reorder_linear_weight, for that many rows) does not. Chosen per shape by
# measurement like the one-row products (1.17x the server's tokens/s on an AMD EPYC Zen 1), for serve.py
# only: the copy doubles the weights' memory, which one stream's prefill does not repay.
BATCH_PRODUCTS = ("linear", "onednn_packed")
BATCH_OVERRIDE = "SMALLGPT_BATCH_PRODUCT"
BATCH_MIN_GAIN = 1.05  # a packed copy is kept at this much of F.linear's speed: a near tie costs memory, not speed
_chosen_batch = {}  # (dtype, out_features, in_features, rows) -> (name, {name: GFLOP/s})


def prepack(weight, rows):
    """weight (any layout) packed for oneDNN's inner product over `rows` rows: a copy, not a view."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)


def time_batch_products(linears, rows, rounds=5):
    """{name: GFLOP/s} of F.linear and of oneDNN over prepacked weights for `rows` rows over these (weight,
    bias) pairs, best of interleaved rounds; 0.0 where oneDNN cannot (no bf16 inner product on AVX2)."""
    generator = torch.Generator().manual_seed(0)
    x = {w.size(1): torch.randn(rows, w.size(1), generator=generator).to(w.dtype) for w, _ in linears}
    try:
        packed = [(prepack(w, rows), b) for w, b in linears]
        onednn_linear(x[linears[0][0].size(1)], *packed[0])
    except RUN_ERRORS:
        packed = None
    runs = {"linear": lambda: [F.linear(x[w.size(1)], w, b) for w, b in linears]}
    if packed is not None:
        runs["onednn_packed"] = lambda: [onednn_linear(x[w.size(1)], p, b) for (w, _), (p, b) in zip(linears, packed)]
    best = dict.fromkeys(BATCH_PRODUCTS, float("inf")) | fastest(runs, rounds)
    flops = sum(2 * rows * w.numel() for w, _ in linears)
    return {name: flops / seconds / 1e9 for name, seconds in best.items()}


def batch_products(linears, rows):
    """{shape_key: name}: how RowLinears of these (weight, bias) pairs compute `rows` rows (BATCH_PRODUCTS),
    measured once per process, shape and row count over up to MEASURED_BYTES of the shape's matrices; a
    packed copy only at BATCH_MIN_GAIN times F.linear's speed. SMALLGPT_BATCH_PRODUCT=name chooses without
    measuring."""

    def decide(pairs, measured):
        speeds = time_batch_products(measured, rows)
        return "onednn_packed" if speeds["onednn_packed"] >= BATCH_MIN_GAIN * speeds["linear"] else "linear", speeds

    return by_shape(linears, _chosen_batch, lambda shape: (*shape, rows), BATCH_OVERRIDE, BATCH_PRODUCTS, decide)


class RowLinear(nn.Linear):
    """A Linear that computes a single row (one token being decoded) with a chosen product (ROW_PRODUCTS),
    since the fastest one-row kernel differs between CPUs by up to 4x; more rows (a prefill, a batch) take
    F.linear, or oneDNN over `packed`, a copy of the weight prepacked by for_inference(batch_rows=...)
    (stale if the weight changes after). Under torch.compile one row is rowdot.cpp's op where it runs here
    (faster in a compiled step than inductor's mm), else F.linear: the eager kernels are chosen for eager mode."""

    product = "linear"
    packed = None

    def forward(self, x):
        if torch.compiler.is_compiling():  # a compiled graph picks its own kernels (inductor cannot lower oneDNN's op),
            op = _kernel.get("op")  # (built when the RowLinear was made: never inside a trace)
            if (op is not None and x.numel() == x.size(-1) and self.weight.is_contiguous() and x.device.type == "cpu"
                    and self.weight.dtype in (torch.float32, torch.bfloat16)):
                # but calls ours for one row (an op with a fake): faster than inductor's extern mm here
                return op(x.reshape(1, -1), self.weight, None, self.bias).view(*x.shape[:-1], -1)
            return F.linear(x, self.weight, self.bias)
        if x.numel() != x.size(-1):
            if self.packed is not None:
                return onednn_linear(x.reshape(-1, x.size(-1)), self.packed, self.bias).view(*x.shape[:-1], -1)
            return F.linear(x, self.weight, self.bias)
        y = ROW_PRODUCTS[self.product](x.reshape(1, -1), self.weight, self.bias)
        return y.view(*x.shape[:-1], -1)


BLOCK = 32  # int8 weights per scale (llama.cpp's Q8_0)


def in_blocks(t):
    """t (rows, K) as (rows, ceil(K / 32), 32): its rows in blocks of BLOCK, the last one padded with zeros."""
    N, K = t.shape
    return F.pad(t, (0, -K % BLOCK)).view(N, -(-K // BLOCK), BLOCK)  # (sizes given: N may be 0)


def quantize_blocks(weight, half_scales=True):
    """(int8 (N, K), float16 scales (N, ceil(K / 32))): each row in blocks of 32 weights, one scale per block,
    as llama.cpp's Q8_0 makes them (gguf's quantize, bit for bit: the scale amax / 127 kept in float16, each
    weight rounded half away from zero); a last, partial block takes the scale of its own weights.
    half_scales=False keeps them in float32 (how rowdot.cpp quantises activations)."""
    w = weight.detach().float()
    K = w.size(1)
    blocks = in_blocks(w)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    v = blocks * torch.where(d == 0, 0.0, 1 / d)
    a = v.abs()
    q = v.sign() * (a.floor() + (2 * (a - a.floor())).floor())  # gguf's np_roundf
    scale = d[..., 0].half() if half_scales else d[..., 0]
    return q.clamp(-127, 127).to(torch.int8).flatten(1)[:, :K].contiguous(), scale


def dequantize_blocks(q, scale):
    """The float32 weights that int8 blocks and their scales stand for."""
    K = q.size(1)
    return (in_blocks(q.float()) * scale.float()[..., None]).flatten(1)[:, :K]


class Int8Linear(nn.Module):
    """A Linear for inference with its weight stored as int8 in blocks of 32 along each row, one scale per
    block (quantize_blocks: llama.cpp's Q8_0, so each weight is off by at most half its block's step plus the
    scale's float16 rounding). Up to DECODE_ROWS rows go through rowdot.cpp, which quantises the activations
    in blocks too (Q8_0 x Q8_0; reference_rowdot, the same arithmetic in torch and much slower, where it
    cannot run); more rows (a prefill) through a bf16 matmul over the dequantised weights. The result comes
    back in the input's dtype."""

    DECODE_ROWS = 16  # up to this many rows, the int8 kernel; above (a prefill), a dequantised bf16 matmul

    def __init__(self, linear):
        super().__init__()
        weight, scale = quantize_blocks(linear.weight)
        rowdot_kernel()  # built (or found wanting) now, not first inside a compiled step's tracing
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    def forward(self, x):
        rows = x.reshape(-1, x.size(-1))
        if rows.size(0) <= self.DECODE_ROWS:
            y = rowdot(rows.float(), self.weight, self.scale, self.bias)
        else:  # the one-row kernel is several times slower than AMX bf16 on hundreds of rows
            weight = dequantize_blocks(self.weight, self.scale).to(torch.bfloat16)
            y = F.linear(rows.to(torch.bfloat16), weight, None if self.bias is None else self.bias.to(torch.bfloat16))
        return y.to(x.dtype).view(*x.shape[:-1], self.weight.size(0))


def replace_linears(model, make):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))


def row_linear(linear, product):
    rowdot_kernel()  # built (or found wanting) now, not first inside a compiled step's tracing
    new = RowLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: a tied head stays tied
    new.product = product
    return new


def quantize_int8(model):
    """Replaces every Linear (the blocks' and the LM head) by an Int8Linear, in place; the token
    embedding stays as it is (a lookup reads one row). For inference on CPU; returns the model."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weights are for CPU inference (torch's int8 weight-only kernel); use bfloat16 on GPUs")
    replace_linears(model, Int8Linear)
    return model.eval()


WEIGHTS_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")  # what for_inference takes


def inference_weights(name, device_type):
    """The weight format `auto` means on a device: bf16 on a GPU with native bf16 (half the bytes each
    decode step reads, and tensor cores), else float32 (a CPU's exact default: bf16 or int8 there is a
    choice to make, measured in docs/benchmarks.md); any other name as it is."""
    if name != "auto":
        return name
    if device_type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bfloat16"
    return "float32"


def precision_line(weights_dtype, device):
    """sample.py's and serve.py's first stderr line: the weight format that runs and why the device's
    compute is what it is."""
    device_type = torch.device(device).type
    return f"precision: {inference_weights(weights_dtype, device_type)} weights | {precision(device_type).why}"


def for_inference(model, weights_dtype, batch_rows=0):
    """The model in eval mode with its weights in weights_dtype (auto: inference_weights; float32, bfloat16,
    float16, or int8 = quantize_int8), in place. On CPU, one-token steps go through RowLinear with the row
    product measured fastest here for each weight's shape (row_products), and with batch_rows (a server's
    batch) each shape whose F.linear over that many rows is clearly slower than oneDNN's over a packed copy
    keeps such a copy (batch_products)."""
    weights_dtype = inference_weights(weights_dtype, next(model.parameters()).device.type)
    if weights_dtype == "int8":
        return weights_in_huge_pages(quantize_int8(model))
    model.eval().to(dtype=getattr(torch, weights_dtype))
    if next(model.parameters()).device.type == "cpu":
        products = row_products(linear_weights(model, nn.Linear))
        replace_linears(model, lambda linear: row_linear(linear, products[shape_key(linear.weight)]))
        use_row_product(model, products)
        if batch_rows > 1:  # timed on the weights as the row products laid them out, which F.linear reads
            batch = batch_products(linear_weights(model, RowLinear), batch_rows)
            for m in model.modules():
                if isinstance(m, RowLinear) and batch[shape_key(m.weight)] == "onednn_packed":
                    try:
                        m.packed = prepack(m.weight.detach(), batch_rows)
                    except RUN_ERRORS as e:  # only where SMALLGPT_BATCH_PRODUCT forced it: measuring skips it
                        raise ConfigError(f"{BATCH_OVERRIDE}=onednn_packed: oneDNN cannot pack {m.weight.dtype} "
                                          f"weights on this CPU ({str(e).splitlines()[0]}); unset it") from None
        weights_in_huge_pages(model)
    return model


def linear_weights(model, kind):
    """(weight, bias) of each distinct weight of the model's `kind` modules (a tied head counted once)."""
    return list({id(m.weight): (m.weight.detach(), m.bias) for m in model.modules() if type(m) is kind}.values())
