"""
Weights for inference: one-row products through RowLinear, int8 through Int8Linear, and for_inference, the one
entry point sample.py and bench.py use. Decoding one token reads every weight once, so its speed is the
bytes per weight and the bandwidth of the kernel that reads them.
"""

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from configurator import ConfigError
from device import precision


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


# One row times a weight matrix, five ways (row: 1 x in_features). MKL streams the weights at memory speed
# in "linear" on Intel CPUs and at one thread's bandwidth on AMD ones (or under MKL_CBWR=COMPATIBLE, its
# generic code), where "bags" reads them with every thread; aten's own bf16 kernel reads bf16 weights at
# under half fp32's bytes/s in "linear" but not in mv (docs/research_log.md). Their order is the order of
# preference: a later one is chosen only when it is clearly faster.
ROW_PRODUCTS = {
    "linear": F.linear,
    "addmv": lambda row, weight, bias: torch.mv(weight, row[0]) if bias is None else torch.addmv(bias, weight, row[0]),
    "mv": lambda row, weight, bias: torch.mv(weight, row[0]) if bias is None else torch.mv(weight, row[0]) + bias,
    "onednn": onednn_linear,
    "bags": bags_linear,
}
TRANSPOSED = {"bags"}  # products that read weights stored transposed (weight.t() contiguous); the others, as stored
ROW_OVERRIDE = "SMALLGPT_ROW_PRODUCT"
MIN_GAIN = 1.2  # a later product must beat the chosen one by this much: near ties keep the earlier one, run after run
MEASURED_BYTES = 128 << 20  # at most this much of the model's weights is streamed per timing
_chosen = {}  # dtype -> (name, {name: GB/s}): the decision, once per process


def laid_out(weight, product):
    """weight's values stored as `product` reads them best: transposed for TRANSPOSED, else row-major."""
    return weight.t().contiguous().t() if product in TRANSPOSED else weight.contiguous()


def use_row_product(model, product):
    """Every RowLinear of the model computes one row with `product`, its weight laid out for it (in place: the
    same Parameters, so a tied head stays tied; the embedding's lookups read the same values)."""
    for m in model.modules():
        if isinstance(m, RowLinear):
            m.product = product
            m.weight.data = laid_out(m.weight.data, product)


def time_row_products(linears, rounds=5):
    """{name: GB/s} of each row product over these (weight, bias) pairs, best of interleaved rounds."""
    generator = torch.Generator().manual_seed(0)
    rows = {w.size(1): torch.randn(1, w.size(1), generator=generator).to(w.dtype) for w, _ in linears}
    best = dict.fromkeys(ROW_PRODUCTS, float("inf"))
    products = dict(ROW_PRODUCTS)
    transposed = [(laid_out(w, "bags"), b) for w, b in linears] if TRANSPOSED & set(products) else []
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms up (and pages the weights in)
            for name, product in list(products.items()):
                start = time.perf_counter()
                try:
                    for w, b in transposed if name in TRANSPOSED else linears:
                        product(rows[w.size(1)], w, b)
                except (RuntimeError, AttributeError, NotImplementedError):  # e.g. oneDNN without fp16, or no oneDNN
                    del products[name]
                    continue
                if r:
                    best[name] = min(best[name], time.perf_counter() - start)
    size = sum(w.numel() * w.element_size() for w, _ in linears)
    return {name: size / seconds / 1e9 for name, seconds in best.items()}  # 0.0: not available here


def pick_row_product(speeds):
    """The name to use, from time_row_products' figures: by ROW_PRODUCTS' order, a later one only at
    MIN_GAIN times the speed of the one chosen so far."""
    chosen = next(iter(ROW_PRODUCTS))
    for name in ROW_PRODUCTS:
        if speeds[name] >= MIN_GAIN * speeds[chosen]:
            chosen = name
    return chosen


def row_product(linears):
    """The row product for one-row Linears of this dtype on this CPU: measured once per process over the
    first model's (weight, bias) pairs (under a second), as device.precision decides bf16.
    SMALLGPT_ROW_PRODUCT=name chooses without measuring."""
    dtype = linears[0][0].dtype
    if dtype not in _chosen:
        override = os.environ.get(ROW_OVERRIDE)
        if override is not None and override not in ROW_PRODUCTS:
            raise ConfigError(f"{ROW_OVERRIDE}={override!r}: use one of {', '.join(ROW_PRODUCTS)}, or unset it")
        if override:
            _chosen[dtype] = (override, {})
        else:
            kept, size = [], 0
            for w, b in linears:
                if size < MEASURED_BYTES:
                    kept.append((w, b))
                    size += w.numel() * w.element_size()
            speeds = time_row_products(kept)
            _chosen[dtype] = (pick_row_product(speeds), speeds)
    return _chosen[dtype][0]


def row_product_choices():
    """{dtype: 'name (GB/s of each)'} for the decisions this process made: bench.py's machine lines."""
    return {str(dtype).replace("torch.", ""): name + (" (" + ", ".join(f"{n} {v:.1f}" for n, v in speeds.items()) + " GB/s)"
                                                      if speeds else f" ({ROW_OVERRIDE})")
            for dtype, (name, speeds) in _chosen.items()}


class RowLinear(nn.Linear):
    """A Linear that computes a single row (one token being decoded) with a chosen product (ROW_PRODUCTS),
    since the fastest one-row kernel differs between CPUs by up to 4x; more rows (a prefill, a batch) take
    F.linear."""

    product = "linear"

    def forward(self, x):
        if x.numel() != x.size(-1):
            return F.linear(x, self.weight, self.bias)
        y = ROW_PRODUCTS[self.product](x.reshape(1, -1), self.weight, self.bias)
        return y.view(*x.shape[:-1], -1)


class Int8Linear(nn.Module):
    """A Linear for inference with its weight stored as int8 and one bf16 scale per output row
    (symmetric, per-channel, weight-only quantisation: each weight is off by at most half a step,
    max|row|/254, plus the scale's bf16 rounding). Activations run in bf16; the result comes back in
    the input's dtype."""

    DECODE_ROWS = 16  # up to this many rows, the int8 kernel; above (a prefill), a dequantised bf16 matmul

    def __init__(self, linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.register_buffer("weight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias)

    def forward(self, x):
        rows = x.reshape(-1, x.size(-1)).to(torch.bfloat16)
        if rows.size(0) <= self.DECODE_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scale)
        else:  # the int8 kernel is several times slower than AMX bf16 on hundreds of rows
            y = F.linear(rows, self.weight.to(torch.bfloat16) * self.scale[:, None])
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*x.shape[:-1], -1)


def replace_linears(model, make):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))


def row_linear(linear, product):
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


def for_inference(model, weights_dtype):
    """The model in eval mode with its weights in weights_dtype (auto: inference_weights; float32, bfloat16,
    float16, or int8 = quantize_int8), in place. On CPU, one-token steps go through RowLinear with the row
    product measured fastest here (row_product)."""
    weights_dtype = inference_weights(weights_dtype, next(model.parameters()).device.type)
    if weights_dtype == "int8":
        return quantize_int8(model)
    model.eval().to(dtype=getattr(torch, weights_dtype))
    if next(model.parameters()).device.type == "cpu":
        linears = {id(m.weight): (m.weight.detach(), m.bias) for m in model.modules() if type(m) is nn.Linear}
        product = row_product(list(linears.values()))
        replace_linears(model, lambda linear: row_linear(linear, product))
        use_row_product(model, product)
    return model
