"""
Cross-attention: an encoder-decoder's third sublayer (GPTConfig.family='encoder-decoder').

Not a kind of attn_pattern (it has no cache of its own and no causal mask): each decoder block has one
beside its self-attention, reading the encoder's final states, whose keys and values are computed once
per source (GPT.cross_inputs) and kept by a generation's KVCache (KVCache.cross).
"""

import torch
import torch.nn as nn

from attention.kernels import KERNELS


def key_mask(pad_mask, S, device):
    """The keys a query may see, (B or 1, 1, 1, S) bool: never None, which the kernels read as causal."""
    if pad_mask is None:
        return torch.ones(1, 1, 1, S, dtype=torch.bool, device=device)
    return pad_mask.bool()[:, None, None, :]


class CrossAttention(nn.Module):
    """An encoder-decoder's third sublayer: queries from the decoder, keys and values from the encoder's states.

    Bahdanau's attention with blocks in place of the recurrences: every decoder position sees every source
    position but the padding. keys() runs once per source; generation keeps them (GPT.new_cache)."""

    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.kv = nn.Linear(config.n_embd, 2 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attend, self.dropout = KERNELS[config.attn_impl], config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def keys(self, memory):
        """The encoder's final states (B, S, C) -> keys and values (B, n_head, S, head_dim) each."""
        B, S, _ = memory.shape
        return self.kv(memory).view(B, S, 2, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def forward(self, x, k, v, mask):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = self.attend(q, k, v, mask, self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))
