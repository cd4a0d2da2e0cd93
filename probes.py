"""
Probes of a model's attention: the weights its forward pass computes, and per-head scores on the repeated
random-token probe of Olsson et al. (2022), "In-context learning and induction heads".

A library: train.py's log_heads and log_stability call it each evaluation, and interpret.py draws and
prints what it returns (its docstring explains the scores).
"""

from collections import namedtuple
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from attention import attention_scores
from configurator import ConfigError


# ----------------------------------------------------------------------------------------------------
# Attention weights, from the forward pass itself


@contextmanager
def recording(model, weights=True):
    """Within it, each forward of model records, per softmax attention layer, its attention weights
    (B, H, T, keys), the keys its mask hid (True) and its largest visible score, into the yielded list (one
    entry per layer; None for linear-attention layers). The weights are the explicit path's (the reference
    SDPA is tested against: attention.attention_explicit, step for step), and they also make the layer's
    output, so they are what the model computed. weights=False records the largest score alone and leaves
    the layer's own path (SDPA) to compute: train.py's log_stability."""
    records = [None] * len(model.blocks)
    originals = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if not attn.softmax:  # e.g. linear attention: nothing to record
            continue

        def attend(q, k, v, mask, dropout_p=0.0, i=i, original=attn.attend):
            if not weights:
                records[i] = Record(None, None, attention_scores(q.float(), k.float(), mask).max())
                return original(q, k, v, mask, dropout_p)
            scores = attention_scores(q, k, mask)
            w = F.softmax(scores.float(), dim=-1)
            records[i] = Record(w.detach(), torch.isneginf(scores).detach(), scores.detach().float().max())
            w = F.dropout(w.to(q.dtype), p=dropout_p)
            return w @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)

        originals.append((attn, attn.attend))
        attn.attend = attend
    try:
        yield records
    finally:
        for attn, original in originals:
            attn.attend = original


Record = namedtuple("Record", "weights hidden max_logit")


def attention_maps(model, ids):
    """(logits (1, T, vocab), [per layer: (weights (H, T, T), hidden (H, T, T)) or None]) for one sequence."""
    with torch.no_grad(), recording(model) as maps:
        logits, _ = model(torch.tensor([ids], dtype=torch.long))
    return logits, [None if m is None else (m.weights[0], m.hidden[0]) for m in maps]


def image_attention(model, pixels):
    """A vision transformer's class-token attention over its patches, per layer: (H, images, rows, cols)
    each, the patches in their places (row by row), and each head's mean attention distance per layer
    (layers, H): for every patch query, the pixel distance between patch centres averaged under its weights
    over the patch keys (Dosovitskiy et al. 2021, fig. 7: low where a head looks nearby, high where it looks
    across the image), averaged over queries and images."""
    c = model.config
    side = c.image_size // c.patch_size
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2).float()
    distance = torch.cdist(grid, grid) * c.patch_size  # (P, P) in pixels
    with torch.no_grad(), recording(model) as records:
        model(pixels)
    cls_maps, distances = [], []
    for r in records:
        w = r.weights.float()  # (B, H, 1 + P, 1 + P)
        cls_maps.append(w[:, :, 0, 1:].reshape(w.size(0), w.size(1), side, side).transpose(0, 1))
        patches = w[:, :, 1:, 1:] / w[:, :, 1:, 1:].sum(-1, keepdim=True)
        distances.append((patches * distance).sum(-1).mean(dim=(0, 2)))
    return cls_maps, torch.stack(distances)


# ----------------------------------------------------------------------------------------------------
# Scores on the repeated random-token probe


def probe_tokens(vocab_size, n, rows, seed):
    """(rows, 2n): per row, n distinct random token ids, then the same n again (distinct, so each token of
    the second copy has exactly one earlier occurrence)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.stack([torch.randperm(vocab_size, generator=g)[:n] for _ in range(rows)])
    return torch.cat([first, first], dim=1)


def default_probe_len(config):
    return min(64, config.block_size // 2, config.vocab_size)


def copying_scores(model):
    """(layers, heads): sum(eig)/sum(|eig|) of each head's direct token -> logit matrix
    W_E W_V^h W_O^h W_U (vocab x vocab), from its d x d equivalent W_O^h W_U W_E W_V^h (same nonzero
    eigenvalues), norms and positions ignored as in Olsson et al.'s copying analysis."""
    E, U = model.tok_emb.weight.float(), model.lm_head.weight.float()  # (V, C) each
    rows = []
    for block in model.blocks:
        attn = block.attn
        H, KV, D = attn.n_head, attn.n_kv_head, attn.head_dim
        Wv = attn.qkv.weight.float()[(H + KV) * D :]  # (KV * D, C)
        Wo = attn.proj.weight.float()  # (C, H * D)
        row = []
        for h in range(H):
            g = h // (H // KV)
            v, o = Wv[g * D : (g + 1) * D], Wo[:, h * D : (h + 1) * D]  # (D, C), (C, D)
            with torch.autocast(E.device.type, enabled=False):  # CUDA's autocast would hand eigvals bf16
                m = (v @ E.T) @ (U @ o)  # (D, V) (V, D): d x d
            eig = torch.linalg.eigvals(m.cpu() if m.device.type == "mps" else m)  # MPS has no linalg_eig
            total = eig.abs().sum().item()
            row.append(eig.real.sum().item() / total if total > 0 else 0.0)
        rows.append(row)
    return rows


def head_scores(model, n=None, rows=16, seed=0):
    """The probe's scores: {"previous", "duplicate", "induction", "copying": per layer a list of per-head
    floats (None for a linear-attention layer's attention scores), "chance": the induction score of
    uniform attention, "icl": second copy's loss - first copy's, "loss_first", "loss_second", "probe_len"}."""
    config = model.config
    n = n or default_probe_len(config)
    if not 2 <= n <= min(config.vocab_size, (config.context_limit or 2 * n) // 2):
        raise ConfigError(f"probe_len={n}: the probe needs 2 copies within block_size={config.block_size} and "
                          f"n distinct tokens of the {config.vocab_size} (2 <= n <= {min(config.vocab_size, config.block_size // 2)})")
    idx = probe_tokens(config.vocab_size, n, rows, seed).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), recording(model) as maps:
            logits, _ = model(idx)
    finally:
        model.train(was_training)
    second = torch.arange(n, 2 * n)
    every = torch.arange(1, 2 * n)
    scores = {"previous": [], "duplicate": [], "induction": []}
    for m in maps:
        if m is None:
            for key in scores:
                scores[key].append(None)
            continue
        w = m.weights  # (B, H, 2n, 2n)
        scores["previous"].append(w[:, :, every, every - 1].mean(dim=(0, 2)).tolist())
        scores["duplicate"].append(w[:, :, second, second - n].mean(dim=(0, 2)).tolist())
        scores["induction"].append(w[:, :, second, second - n + 1].mean(dim=(0, 2)).tolist())
    # losses: predicting tokens 1..n-1 of the first copy (random: nothing to learn from) against tokens
    # n+1..2n-1 of the second (each predictable from the first copy)
    nats = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), idx[:, 1:].flatten(), reduction="none").view(rows, -1)
    first, later = nats[:, : n - 1].mean().item(), nats[:, n:].mean().item()
    return {**scores, "copying": copying_scores(model), "chance": (1.0 / (second + 1).double()).mean().item(),
            "icl": later - first, "loss_first": first, "loss_second": later, "probe_len": n}


def best(values):
    """The largest score over every head of every layer that has one (None if none has)."""
    flat = [v for layer in values if layer is not None for v in layer]
    return max(flat) if flat else None
