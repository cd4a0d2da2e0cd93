"""
The optimizers, one builder each in OPTIMIZERS (adding one: a function and a line there), the learning
rate schedule and gradient clipping. Muon runs its Newton-Schulz iterations in a dtype that is fast on
the device (device.py), compiled with the model, and shared out across DDP's ranks.
"""

import math

import torch

from device import precision


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
    move between the two; ns_dtype belongs to the machine, not to the run, and is not saved.

    compiled: Newton-Schulz through torch.compile (one fused graph per matrix shape instead of ~20 kernel
    launches per matrix; what nanochat and modded-nanogpt do on GPUs). shard=(rank, world size) under DDP:
    every rank has the same averaged gradients, so each keeps the momentum of every matrix (elementwise,
    cheap) but orthogonalises only its share, chosen by size, and broadcasts the updated matrices; the
    result is what one process computes, without every rank repeating the same Newton-Schulz."""

    def __init__(self, params, ns_dtype=torch.bfloat16, compiled=False, shard=None, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.orthogonalise = torch.compile(newton_schulz, dynamic=False) if compiled else newton_schulz
        self.shard = shard

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        rank, owner = (self.shard[0], owners([p.numel() for _, p in todo], self.shard[1])) if self.shard else (0, None)
        sent = []
        for i, (group, p) in enumerate(todo):
            lr, momentum = group["lr"], group["momentum"]
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            if owner is None or owner[i] == rank:
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = self.orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * lr_scale(group["adjust_lr_fn"], p.shape))
            if owner is not None:  # in the same order on every rank; the owner's copy overwrites the others'
                sent.append(torch.distributed.broadcast(p, src=owner[i], async_op=True))
        for work in sent:
            work.wait()
        return loss


def owners(sizes, world_size):
    """A rank for each of the matrices of these sizes: the largest first, each to the least loaded rank
    (the same answer on every rank)."""
    load, owner = [0] * world_size, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(world_size), key=load.__getitem__)
        load[owner[i]] += sizes[i]
    return owner


def lr_scale(adjust_lr_fn, shape):
    """torch.optim.Muon's per-matrix rate factor: 'original' keeps updates of unit RMS per column,
    'match_rms_adamw' (Liu et al. 2025) sizes them like AdamW's so one learning rate serves both."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 1.0


# ----------------------------------------------------------------------------------------------------
# Builders: (model, c, device_type, ns_dtype, shard) -> a list of optimizers. c has the training config's
# attributes learning_rate, weight_decay, beta1, beta2, muon_momentum, compile; ns_dtype is Muon's
# Newton-Schulz dtype (None: what precision() finds fast here; a resumed run passes the one it started
# with); shard is (rank, world size) under DDP, else None.


def adamw_everywhere(model, c, device_type, ns_dtype=None, shard=None):
    """adamw() over every trainable parameter."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [adamw(params, c.weight_decay, c.learning_rate, (c.beta1, c.beta2), device_type)]


def muon_for_matrices(model, c, device_type, ns_dtype=None, shard=None):
    """Muon (Jordan et al. 2024: momentum orthogonalised by Newton-Schulz) for the blocks' matrices, its
    rate scaled to match AdamW's update size (Liu et al. 2025) so one learning_rate serves both; AdamW for
    the embeddings, the head, norm gains and biases."""
    hidden = {id(p) for p in model.blocks.parameters() if p.dim() == 2}
    muon = Muon([p for p in model.blocks.parameters() if id(p) in hidden], ns_dtype=ns_dtype or precision(device_type).newton_schulz,
                compiled=c.compile, shard=shard, lr=c.learning_rate, weight_decay=c.weight_decay,
                momentum=c.muon_momentum, adjust_lr_fn="match_rms_adamw")
    rest = [p for p in model.parameters() if id(p) not in hidden]
    return [muon, adamw(rest, c.weight_decay, c.learning_rate, (c.beta1, c.beta2), device_type)]


OPTIMIZERS = {"adamw": adamw_everywhere, "muon": muon_for_matrices}


def build_optimizers(model, c, device_type, ns_dtype=None, shard=None):
    return OPTIMIZERS[c.optimizer](model, c, device_type, ns_dtype, shard)


def get_lr(it, c):
    """Linear warmup from lr/(warmup+1) (never 0: step 0 must learn too), then a cosine down to min_lr
    at lr_decay_iters, then min_lr."""
    decay_iters = c.lr_decay_iters if c.lr_decay_iters is not None else c.max_iters
    if it < c.warmup_iters:
        return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
    if it >= decay_iters:
        return c.min_lr
    progress = (it - c.warmup_iters) / max(1, decay_iters - c.warmup_iters)
    return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c.learning_rate - c.min_lr)


def clip_gradients(parameters, max_norm):
    """Scales the gradients so their global norm is at most max_norm (0 = leave them) and returns the norm
    before clipping, which is what gets logged."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
