"""
Sampling and the decode loop, as functions of a model (GPT.generate and GPT.stream call these):

  next_logits(model, seq, length, cache)   the logits after seq[:, :length]: a prefill, then a token a step
  generate(model, idx, max_new_tokens, Sampling(temperature=0.8, top_k=200), eos_token_id)
  stream(...)                              the same, yielding each new column of tokens as it exists

Sampling says how a token is drawn (temperature, top-k, top-p); sample_next draws one per row, with one
generator per row if asked. speculative.py plugs its drafts into stream() as a step that may return
several tokens.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: temperature 0 is greedy; top_k keeps the k most likely tokens, top_p
    the smallest set whose probability reaches p (None: no filter)."""

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or None for no top-k filter")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1], or None for no nucleus filter")

    def probs(self, logits):
        """The distribution a token is drawn from when temperature > 0."""
        return F.softmax(filter_logits(logits.float() / self.temperature, self.top_k, self.top_p), dim=-1)


def filter_logits(logits, top_k=None, top_p=None):
    """Sets to -inf every logit outside the top_k largest (ties with the k-th kept) and outside the
    nucleus: the smallest set of most likely tokens whose probability reaches top_p."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits.float(), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the most likely token always has mass_before 0
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits, sampling, generator=None):
    """(B, vocab) logits -> (B, 1) token ids. generator: None, one torch.Generator for the batch, or a
    list with one per row (row i then draws exactly what a batch of one with that generator would)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = sampling.probs(logits)
    if isinstance(generator, list):
        return torch.cat([torch.multinomial(p[None], 1, generator=g) for p, g in zip(probs, generator)])
    return torch.multinomial(probs, 1, generator=generator)


def check_max_new_tokens(max_new_tokens):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")


def next_logits(model, seq, length, cache=None):
    """The logits (B, vocab) of the token after seq[:, :length]: the tokens the cache has not seen yet
    go through it (the whole prompt first, then one per step), or, without a cache or once the sequence
    has outgrown block_size, the last block_size tokens run afresh. Past block_size every cached key
    is stale (each depended on tokens that have left the window), so both ways compute the same.
    A model that runs any length (config.context_limit None: windows and linear layers, relative
    positions) never recomputes: the cache takes the new tokens, block_size at a time, and without a
    cache the whole sequence runs, which computes the same."""
    block_size = model.config.block_size
    if model.config.context_limit is None:
        if cache is None:
            return model.forward_cached(seq[:, :length])[:, -1]
        for begin in range(cache.length, length, block_size):
            logits = model.forward_cached(seq[:, begin : min(begin + block_size, length)], cache)
        return logits[:, -1]
    if cache is None or length > block_size:
        return model.forward_cached(seq[:, max(0, length - block_size) : length])[:, -1]
    return model.forward_cached(seq[:, cache.length : length], cache)[:, -1]


@torch.no_grad()
def generate(model, idx, max_new_tokens, sampling=Sampling(), eos_token_id=None, use_cache=True, generator=None):
    """Continues each row of idx (B, T; rows of equal length) by up to max_new_tokens tokens and
    returns (B, T + new). Call model.eval() first, or dropout stays on. With the cache, the prompt runs
    once and then one token per step; without it, each step recomputes the last block_size tokens
    (next_logits). Tokens are the same either way.

    A row that emits eos_token_id stops growing: later positions repeat eos_token_id. Generation ends
    early when every row has stopped, so `new` can be less than max_new_tokens.

    generator: None, a torch.Generator, or a list of one per row (row i then draws exactly the tokens
    a batch of one with that generator would). Speculative decoding: speculative.generate."""
    return torch.cat([idx, *stream(model, idx, max_new_tokens, sampling, eos_token_id, use_cache, generator)], dim=1)


@torch.no_grad()
def stream(model, idx, max_new_tokens, sampling=Sampling(), eos_token_id=None, use_cache=True, generator=None,
           step=None):
    """generate() one step at a time: yields each new (B, 1) column of tokens as soon as it exists.

    step: None, or step(seq, length, end, cache) -> (B, n) tokens to append after seq[:, :length], or
    None for an ordinary step; it may return several tokens at once (speculative.py's drafts do) and
    leaves the cache holding the sequence up to, at most, the new tokens' last."""
    check_max_new_tokens(max_new_tokens)
    generator = list(generator) if isinstance(generator, (list, tuple)) else generator
    B, T = idx.shape
    seq = torch.empty(B, T + max_new_tokens, dtype=idx.dtype, device=idx.device)
    seq[:, :T] = idx
    cache = model.new_cache() if use_cache else None
    finished = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)
    length, end = T, T + max_new_tokens
    while length < end:
        tokens = None if step is None else step(seq, length, end, cache)
        if tokens is None:
            tokens = sample_next(next_logits(model, seq, length, cache), sampling, generator)
        for token in tokens.split(1, dim=1):
            if eos_token_id is not None:
                token = token.masked_fill(finished, eos_token_id)
                finished |= token == eos_token_id
            seq[:, length] = token[:, 0]
            length += 1
            yield token
            if eos_token_id is not None and bool(finished.all()):
                return
