"""
Weights for inference: bf16 through MatVecLinear, int8 through Int8Linear, and for_inference, the one
entry point sample.py and bench.py use. Decoding one token reads every weight once, so its speed is the
bytes per weight and the bandwidth of the kernel that reads them.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from device import precision


class MatVecLinear(nn.Linear):
    """A Linear that computes a single row (one token being decoded) as a matrix-vector product. On CPU,
    torch 2.13 sends a one-row bf16 linear through a matrix-matrix path that reads bf16 weights at under
    half fp32's bytes/s; addmv reads them at 60-100% of fp32's rate (at half the bytes), so GPT-2 small
    decodes faster in bf16 than in fp32 instead of slower (docs/research_log.md). More rows (a prefill,
    a batch) take the usual path.

    fuse_bias: the bias inside addmv (one rounding). On CPUs without fast bf16 (AVX2), aten's bf16 addmv
    with a bias runs at a quarter of mv's speed, so there the bias is added after mv."""

    fuse_bias = True

    def forward(self, x):
        if x.numel() != x.size(-1):
            return F.linear(x, self.weight, self.bias)
        row = x.reshape(-1)
        if self.bias is None:
            y = torch.mv(self.weight, row)
        elif self.fuse_bias:
            y = torch.addmv(self.bias, self.weight, row)
        else:
            y = torch.mv(self.weight, row) + self.bias
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


def matvec_linear(linear, fuse_bias=True):
    new = MatVecLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    new.weight, new.bias = linear.weight, linear.bias  # the same Parameters: a tied head stays tied
    new.fuse_bias = fuse_bias
    return new


def quantize_int8(model):
    """Replaces every Linear (the blocks' and the LM head) by an Int8Linear, in place; the token
    embedding stays as it is (a lookup reads one row). For inference on CPU; returns the model."""
    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 weights are for CPU inference (torch's int8 weight-only kernel); use bfloat16 on GPUs")
    replace_linears(model, Int8Linear)
    return model.eval()


WEIGHTS_DTYPES = ("float32", "bfloat16", "float16", "int8")  # what for_inference takes


def for_inference(model, weights_dtype):
    """The model in eval mode with its weights in weights_dtype (float32, bfloat16, float16, or int8 =
    quantize_int8), in place. bf16 on CPU decodes through MatVecLinear, its bias fused where bf16 is
    fast (device.precision)."""
    if weights_dtype == "int8":
        return quantize_int8(model)
    model.eval().to(dtype=getattr(torch, weights_dtype))
    if weights_dtype == "bfloat16" and next(model.parameters()).device.type == "cpu":
        fuse_bias = precision("cpu").bf16_fast
        replace_linears(model, lambda linear: matvec_linear(linear, fuse_bias))
    return model
