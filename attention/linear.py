"""
Linear attention: causal linear attention (R), and retention, which forgets at a fixed rate (D).

With their chunk math (linear_attention_chunk; chunk_decays and decay_chunk, which the gated layers of
delta.py share) and their caches: running sums, the same size at any length.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention.base import Attention, StaticRows


class LinearState:
    """A linear-attention layer's cache: its running sums (S, z) over every position so far.

    In fp32, the same size at any length. A sum cannot give back what it added: rolling back is
    refused."""

    rewinds = False
    bounded = True

    def __init__(self):
        self.state, self.end = None, 0

    def update(self, end, state):
        """The sums now cover positions 0..end-1."""
        self.state, self.end = state, end

    def rewind(self, n):
        if n != self.end:
            raise ValueError(f"a linear-attention layer's state sums positions 0..{self.end - 1} and cannot "
                             f"roll back to {n}")

    def nbytes(self, length):
        return 0 if self.state is None else sum(t.nbytes for t in self.state)


class StaticLinearState(StaticRows):
    """A linear-attention layer's running sums for a compiled decode step, updated in place."""

    fields = ("S", "z")

    def __init__(self, S, z):
        self.S, self.z = S, z


class LinearAttention(Attention):
    """Causal linear attention (Katharopoulos et al. 2020): a running sum over earlier keys.

    softmax(q.k) replaced by phi(q).phi(k) with phi = elu + 1 > 0, so the sum over earlier keys is a
    running one. Per head:

        y_i = phi(q_i) S_i / (phi(q_i) . z_i),   S_i = sum_{j<=i} phi(k_j) v_j^T  (d x d),   z_i = sum_{j<=i} phi(k_j)

    Training and prefill go chunk by chunk (the quadratic form inside a chunk, the state across chunks);
    a decoded token updates the state, so it costs the same at position 10 and 10,000 and the cache is the
    state alone. With RoPE, the numerator's phi(q) and phi(k) are rotated and the denominator's are not
    (Su et al. 2021, sec. 3.3): scores then depend on offsets and the denominator stays positive. Keys and
    values shared by a query group (GQA) are repeated per query head. Computed in fp32."""

    letter, description = "R", "causal linear attention"
    Cache, StaticCache = LinearState, StaticLinearState
    chunk = 64  # queries per chunk: the quadratic part costs chunk * d per token, the state d * d

    @classmethod
    def check(cls, config):
        if config.pos_emb in ("alibi", "t5"):
            raise ValueError(f"GPTConfig.attn_pattern={config.attn_pattern!r} has linear-attention layers ({cls.letter}), which "
                             f"never form the score matrix that pos_emb={config.pos_emb!r} adds its bias to; use rope, "
                             "learned, sinusoidal or none")
        if config.rope_scaling != "none":
            raise ValueError(f"GPTConfig.attn_pattern={config.attn_pattern!r} has linear-attention layers ({cls.letter}), whose "
                             f"RoPE is not scaled; rope_scaling={config.rope_scaling!r} is for softmax attention only")

    @classmethod
    def mask(cls, config, positions, start, T, device):
        return None  # no score matrix to mask: causality is the running sum's

    @classmethod
    def keys_per_query(cls, config, seq_len):
        """Its chunk's keys plus the head size (the state's d x d product)."""
        return min(seq_len, cls.chunk) + config.n_embd // config.n_head

    def features(self, q, k, v):
        """phi(q) and phi(k) in fp32 (elu + 1 > 0), and keys and values repeated for every query head."""
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.elu(q.float()) + 1, F.elu(k.float()) + 1, v

    def mix(self, q, k, v, gates, start, mask, cache, positions):
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = self.features(q, k, v)
            rq, rk = positions.rotate(q, k, start)  # unchanged unless pos_emb='rope'
            state = None if cache is None else cache.state
            ys = []
            for a in range(0, q.size(2), self.chunk):
                part = slice(a, a + self.chunk)
                y, state = linear_attention_chunk(q[:, :, part], k[:, :, part], rq[:, :, part], rk[:, :, part],
                                                  v[:, :, part].float(), state)
                ys.append(y)
        if cache is not None:
            cache.update(start + q.size(2), state)
        return torch.cat(ys, dim=2).to(v.dtype)

    def static_cache(self, cache, length, max_len):
        return self.StaticCache(cache.state[0].clone(), cache.state[1].clone())

    def decode_one(self, q, k, v, gates, pos, cache, positions):
        """The recurrence of linear_attention_chunk's decoded token, its sums updated in place."""
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = self.features(q, k, v)
            rq, rk = positions.rotate_at(q, k, pos)
            y, (S, z) = linear_attention_chunk(q, k, rq, rk, v.float(), (cache.S, cache.z))
            cache.S.copy_(S)
            cache.z.copy_(z)
        return y.to(v.dtype)


def linear_attention_chunk(q, k, rq, rk, v, state, eps=1e-6):
    """Causal linear attention over one chunk (B, H, T, D) after `state` (S, z), or None at the start.

    phi'd queries and keys q, k, their rotated copies rq, rk (the same tensors without RoPE), values v.
    Returns the outputs and the state after the chunk."""
    if q.size(2) == 1 and state is not None:  # a decoded token: the recurrence itself
        S, z = state[0] + rk.transpose(-2, -1) @ v, state[1] + k[:, :, 0]
        return (rq @ S) / ((q * z[:, :, None]).sum(-1, keepdim=True) + eps), (S, z)
    numerator = (rq @ rk.transpose(-2, -1)).tril() @ v  # each query with the chunk's keys up to its own
    denominator = (q * k.cumsum(dim=2)).sum(-1)
    S, z = rk.transpose(-2, -1) @ v, k.sum(dim=2)
    if state is not None:  # and with every key before the chunk, through the running sums
        numerator = numerator + rq @ state[0]
        denominator = denominator + (q * state[1][:, :, None]).sum(-1)
        S, z = S + state[0], z + state[1]
    return numerator / (denominator[..., None] + eps), (S, z)


class StaticDecayState(StaticRows):
    """A decaying linear layer's state for a compiled decode step, updated in place."""

    fields = ("S",)

    def __init__(self, S):
        self.S = S


class RetentionAttention(LinearAttention):
    """Linear attention that forgets at a fixed rate per head: RetNet's retention (Sun et al. 2023).

    Per head h, with gamma_h = 1 - 2^(-5 - h) (RetNet's: the state's memory spans about 32, 64, ... tokens),

        S_i = gamma_h S_{i-1} + k_i^T v_i   (d x d),   y_i = q_i S_i,   i.e.   y_i = sum_{j<=i} gamma_h^(i-j) (q_i . k_j) v_j

    with k scaled by d^-1/2 and no denominator; each head's output then goes through an RMSNorm (RetNet's
    GroupNorm per head: a head whose memory is long sums more values). Training and prefill go chunk by
    chunk (decay_chunk: the decay matrix inside a chunk, the state across chunks); a decoded token
    updates the state, so the cache is the state alone, the same at any length. RoPE rotates q and k (the
    xPos of RetNet without its length extrapolation factor); no bias-based positions (ALiBi, T5). Keys
    and values shared by a query group (GQA) are repeated per query head. Computed in fp32."""

    letter, description = "D", "linear attention with a fixed decay per head (RetNet's retention)"
    StaticCache = StaticDecayState

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("log_gamma", torch.log1p(-(2.0 ** (-5.0 - torch.arange(self.n_head, dtype=torch.float64)))).float(),
                             persistent=False)
        self.out_norm = nn.RMSNorm(self.head_dim, eps=1e-6)

    def features(self, q, k, v):
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return q.float(), k.float() * self.head_dim**-0.5, v.float()

    def decays(self, q):
        """Each head's log gamma for every token of q (B, H, T, D): decay_chunk's g."""
        return self.log_gamma[None, :, None].expand(q.size(0), -1, q.size(2))

    def mix(self, q, k, v, gates, start, mask, cache, positions):
        dtype = v.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = self.features(q, k, v)
            q, k = positions.rotate(q, k, start)
            state = None if cache is None or cache.state is None else cache.state[0]
            ys = []
            for a in range(0, q.size(2), self.chunk):
                part = slice(a, a + self.chunk)
                y, state = decay_chunk(q[:, :, part], k[:, :, part], v[:, :, part], self.decays(q[:, :, part]), state)
                ys.append(y)
            y = self.out_norm(torch.cat(ys, dim=2))
        if cache is not None:
            cache.update(start + q.size(2), (state,))
        return y.to(dtype)

    def static_cache(self, cache, length, max_len):
        return self.StaticCache(cache.state[0].clone())

    def decode_one(self, q, k, v, gates, pos, cache, positions):
        dtype = v.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = self.features(q, k, v)
            q, k = positions.rotate_at(q, k, pos)
            y, S = decay_chunk(q, k, v, self.decays(q), cache.S)
            cache.S.copy_(S)
            y = self.out_norm(y)
        return y.to(dtype)


def chunk_decays(g):
    """The cumulative log gates of a chunk and its causal decay matrix: (c, decay).

    c their cumulative sum from the chunk's start, decay (B, H, T, T) e^{c_t - c_j} where j <= t and 0
    above (the causal mask)."""
    T = g.size(-1)
    c = g.cumsum(-1)
    causal_mask = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
    return c, (c[..., :, None] - c[..., None, :]).masked_fill(~causal_mask, float("-inf")).exp()


def decay_chunk(q, k, v, g, state):
    """Linear attention that forgets, over one chunk (B, H, T, D) after `state` (None at the start).

    g (B, H, T) each token's log decay (<= 0: retention's is a constant per head, a gated layer's comes
    from its input). With c_t the cumulative g from the chunk's start, per token S_t = e^{g_t} S_{t-1}
    + k_t^T v_t and y_t = q_t S_t, so y_t = sum_{j<=t in the chunk} e^{c_t - c_j} (q_t . k_j) v_j +
    e^{c_t} q_t S, S' = e^{c_T} S + sum_j e^{c_T - c_j} k_j^T v_j. Returns the outputs and the state
    after the chunk."""
    c, decay = chunk_decays(g)
    y = ((q @ k.transpose(-2, -1)) * decay) @ v
    S = (k * (c[..., -1:] - c).exp()[..., None]).transpose(-2, -1) @ v
    if state is not None:
        y = y + (q * c.exp()[..., None]) @ state
        S = S + c[..., -1, None, None].exp() * state
    return y, S
