"""
The optimizers: AdamW, and Muon with its Newton-Schulz iterations in a dtype that is fast on the device.
"""

import math

import torch


def adamw(params, weight_decay, learning_rate, betas, device_type):
    """AdamW with weight decay on matrices (embeddings and Linear weights) only; biases and norm gains
    are not decayed. The fused kernel where the device has one (about 3x faster than foreach on a
    2-core AMX CPU)."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cuda", "cpu", "mps"))


def newton_schulz(g, coefficients, steps, eps, dtype):
    """Orthogonalises g (approximately U V^T of its SVD) with torch.optim.Muon's quintic iteration,
    computed in dtype. torch's own always uses bf16, which on a CPU without bf16 matrix instructions
    runs 30-100x slower than fp32: there, fp32 is both faster and more exact."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update (Nesterov momentum, orthogonalised, decoupled weight decay, its lr
    scaling) with the orthogonalisation in ns_dtype. Same hyperparameters and state, so checkpoints
    move between the two; ns_dtype belongs to the machine, not to the run, and is not saved."""

    def __init__(self, params, ns_dtype=torch.bfloat16, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * lr_scale(group["adjust_lr_fn"], p.shape))
        return loss


def lr_scale(adjust_lr_fn, shape):
    """torch.optim.Muon's per-matrix rate factor: 'original' keeps updates of unit RMS per column,
    'match_rms_adamw' (Liu et al. 2025) sizes them like AdamW's so one learning rate serves both."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 1.0
