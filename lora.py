"""
LoRA (Hu et al. 2021): fine-tuning that freezes a base model and trains a low-rank update B A beside
chosen weight matrices, W x + (alpha / r) B A x, with B zero at the start, so the model begins exactly as
the base. train.py applies it (lora_rank > 0); a checkpoint then holds the adapters alone, with the base
it needs (its out_dir and its checkpoint's sha256); loading it (checkpoint.model_from_checkpoint) merges
them into the base's weights, so sample, serve, eval and export see a plain model.

Tokens the fine-tune adds to the vocabulary (the chat template's) cannot stay frozen: their rows of the
token table and of an untied head are trained too, as small parameters of their own (NewRows), not the
whole table.
"""

import hashlib
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

TARGETS = {"qkv": "attn.qkv", "attn_proj": "attn.proj", "mlp_fc": "mlp.fc", "mlp_proj": "mlp.proj"}
# every matrix of the blocks: QLoRA (Dettmers et al. 2023) found adapters on every linear layer needed to
# match full fine-tuning, and on qkv alone (litgpt's q and v) the chat tasks learned almost nothing new
# (docs/ablations.md, section 11)
DEFAULT_TARGETS = "all"


def parse_targets(text):
    """lora_targets' comma list -> the module suffixes (blocks' attn.qkv, ...); a ValueError names a bad one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TARGETS and t != "all"]
    if bad or not names:
        raise ValueError(f"lora_targets={text!r}: use a comma list of {', '.join(TARGETS)} (or all)")
    return list(TARGETS.values()) if "all" in names else [TARGETS[t] for t in names]


class LoRALinear(nn.Linear):
    """A frozen Linear plus (alpha / rank) B A. Its weight and bias keep the Linear's names, so the base's
    state dict loads as it is; lora_a and lora_b are the only trained tensors. A starts as PEFT's and
    litgpt's (Kaiming-uniform), B at zero: the output is the base's, exactly, until B moves."""

    def __init__(self, linear, rank, alpha, dropout):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = dict(device=linear.weight.device, dtype=linear.weight.dtype)
        self.lora_a = nn.Parameter(torch.empty(rank, linear.in_features, **like))
        self.lora_b = nn.Parameter(torch.zeros(linear.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale

    def merged(self):
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        with torch.no_grad():
            linear.weight = nn.Parameter(self.weight + (self.lora_b @ self.lora_a) * self.scale)
        linear.bias = None if self.bias is None else nn.Parameter(self.bias.detach())
        return linear


class NewRows(nn.Module):
    """The trained rows [first, first + k) of a frozen token table (an Embedding) or head (a Linear): the
    table's own rows there are replaced by `rows` in the forward."""

    def __init__(self, module, first, rows=None):
        super().__init__()
        self.module, self.first = module, first
        module.weight.requires_grad_(False)
        k = module.weight.size(0) - first
        self.rows = rows if rows is not None else nn.Parameter(module.weight.detach()[first:].clone())
        assert self.rows.size(0) == k

    @property
    def weight(self):  # the frozen table (GPT.get_num_params counts it)
        return self.module.weight

    def forward(self, x):
        if isinstance(self.module, nn.Embedding):
            new = x >= self.first
            return torch.where(new[..., None], F.embedding((x - self.first).clamp_min(0), self.rows), self.module(x))
        out = F.linear(x, self.module.weight[: self.first])
        return torch.cat([out, F.linear(x, self.rows)], dim=-1)

    def merged(self):
        with torch.no_grad():
            self.module.weight[self.first :] = self.rows
        self.module.weight.requires_grad_(True)
        return self.module


def apply(model, rank, alpha, dropout, targets, new_rows_from=None):
    """Freezes model and adds adapters, in place: LoRALinear on every block's target matrices, and, when
    new_rows_from is an id, NewRows for the token table's (and an untied head's) rows from there on.
    Returns the model; trainable(model) names what the optimizer and the checkpoint hold."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.blocks:
        for suffix in targets:
            parent_name, name = suffix.split(".")
            parent = getattr(block, parent_name, None)
            linear = getattr(parent, name, None) if parent is not None else None
            if isinstance(linear, nn.Linear):
                setattr(parent, name, LoRALinear(linear, rank, alpha, dropout))
    if new_rows_from is not None:
        tied = model.config.tie_embeddings
        model.tok_emb = NewRows(model.tok_emb, new_rows_from)
        model.lm_head = NewRows(model.lm_head, new_rows_from, model.tok_emb.rows if tied else None)
    return model


def trainable(model):
    """{name: tensor} of what a LoRA run trains and saves (a tied head's rows once)."""
    out, seen = {}, set()
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            out[name] = p
            seen.add(id(p))
    return out


def merge(model):
    """The model with every adapter folded into its weights, in place: plain Linears and Embeddings again
    (a tied head tied again), as the base's architecture."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merged())
    if isinstance(model.tok_emb, NewRows):
        model.tok_emb = model.tok_emb.merged()
        model.lm_head = model.lm_head.merged() if not model.config.tie_embeddings else model.lm_head.module
        if model.config.tie_embeddings:
            model.lm_head.weight = model.tok_emb.weight
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def file_sha256(path, chunk=1 << 24):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def base_record(base_dir, checkpoint_name):
    """What a LoRA checkpoint says of its base: its out_dir (absolute) and its checkpoint's sha256."""
    path = os.path.join(base_dir, checkpoint_name)
    return {"base": os.path.abspath(base_dir), "base_sha256": file_sha256(path)}
