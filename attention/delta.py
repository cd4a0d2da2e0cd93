"""
The gated delta rule (N) and linear attention with a data-dependent decay (M): one layer, two cores.

The gated delta rule (N: Gated DeltaNet, Qwen3-Next's linear layers) and linear attention with a
data-dependent decay (M: Mamba-2's scalar gate), one layer with two cores, with the delta rule's chunk
math (gated_delta_chunk) beside it.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention.base import Attention, StaticRows
from attention.linear import LinearState, chunk_decays, decay_chunk


def gated_delta_chunk(q, k, v, g, beta, state):
    """The gated delta rule over one chunk, in the UT form: (outputs, the state after the chunk).

    q, k (B, H, T, Dk), v (B, H, T, Dv), g (B, H, T) the log forget gate (<= 0), beta (B, H, T) the write
    strength in (0, 1), state S (B, H, Dk, Dv) before the chunk (None: zeros). Per token,

        S_t = a_t S_{t-1} + k_t u_t^T,   u_t = beta_t (v_t - k_t^T a_t S_{t-1}),   y_t = q_t^T S_t     (a_t = e^{g_t})

    the state corrected toward v_t for the key k_t (the delta rule) after forgetting by a_t. In a chunk,
    with c_t the cumulative log gate from the chunk's start, the corrections U solve the unit lower
    triangular system (I + A) U = beta V - (beta e^c K) S, A_tj = beta_t e^{c_t - c_j} (k_t . k_j) for j < t
    (the UT/WY form), then y_t = e^{c_t} q_t^T S + sum_{j<=t} e^{c_t - c_j} (q_t . k_j) u_j and the state is
    e^{c_T} S + sum_j e^{c_T - c_j} k_j u_j^T. Returns (y, the state after the chunk). Queries and keys
    arrive as the layer wants them (L2-normalised, q scaled): nothing is normalised here."""
    T = q.size(2)
    if state is None:
        state = q.new_zeros(q.size(0), q.size(1), k.size(-1), v.size(-1))
    c, decay = chunk_decays(g)
    A = (beta[..., None] * (k @ k.transpose(-2, -1)) * decay).tril(-1)
    rhs = beta[..., None] * v - (beta[..., None] * c.exp()[..., None] * k) @ state
    u = torch.linalg.solve_triangular(torch.eye(T, dtype=q.dtype, device=q.device) + A, rhs, upper=False, unitriangular=True)
    y = c.exp()[..., None] * (q @ state) + ((q @ k.transpose(-2, -1)) * decay) @ u
    to_end = (c[..., -1:] - c).exp()  # e^{c_T - c_j}
    state = c[..., -1, None, None].exp() * state + (k * to_end[..., None]).transpose(-2, -1) @ u
    return y, state


class StaticDeltaState(StaticRows):
    """A gated delta rule layer's state and convolution inputs for a compiled decode step, updated in place."""

    fields = ("S", "conv")

    def __init__(self, S, conv):
        self.S, self.conv = S, conv


def l2_normalize(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)  # fla's and transformers' form (eps inside)


class GatedDeltaNet(Attention):
    """The gated delta rule layer as Qwen3-Next has it (Yang et al. 2024, Gated DeltaNet).

    Per head a state S (Dk x Dv) forgotten by a_t = e^{g_t} and corrected toward each value for its key with
    strength beta_t (gated_delta_chunk), read by the query. From the block input: q, k (n_kv_head heads) and
    v (n_head heads; queries and keys are repeated for them, Qwen3-Next's grouped value heads) through a
    causal depthwise convolution of conv_kernel (4) taps and SiLU; q and k L2-normalised, q scaled by
    Dk^-1/2; beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), both per head and token (Mamba-2's
    discretised decay); the output RMS-normalised per head and gated by SiLU(z), then projected. Training and
    prefill go in chunks of 64 (the UT form), a decoded token through the recurrence; the cache is the state
    and the convolution's last inputs, the same at any length. It takes no positions (the convolution and the
    recurrence order the tokens, as in Qwen3-Next, whose full layers alone have RoPE). Computed in fp32."""

    letter, description = "N", "gated delta rule (Gated DeltaNet, Qwen3-Next's linear layers)"
    Cache, StaticCache = LinearState, StaticDeltaState  # its state: (S, the convolution's last inputs)
    chunk = 64
    conv_kernel = 4

    def __init__(self, config):
        super().__init__(config)
        hd, n_v, n_k = self.head_dim, self.n_head, self.n_kv_head
        self.channels = (2 * n_k + n_v) * hd  # q, k, v before the convolution
        self.qkv = nn.Linear(config.n_embd, self.channels, bias=config.bias)
        self.z = nn.Linear(config.n_embd, n_v * hd, bias=config.bias)  # the output gate
        self.ba = nn.Linear(config.n_embd, 2 * n_v, bias=config.bias)  # beta's and the decay's logits, per head
        self.conv = nn.Conv1d(self.channels, self.channels, self.conv_kernel, groups=self.channels, bias=False)
        # Mamba-2's and Qwen3-Next's initialisation: a step dt log-uniform in [0.001, 0.1] (dt_bias its inverse
        # softplus) and A in [1, 16], so e^g = e^{-A dt} keeps a memory of 1 to 1,000 tokens at the start
        # (dt_bias = 1 would forget nearly everything each token: measured, recall stayed at chance)
        dt = torch.exp(torch.empty(n_v).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.empty(n_v).uniform_(1, 16)))
        self.out_norm = nn.RMSNorm(hd, eps=1e-6)

    @classmethod
    def check(cls, config):
        pass  # any position scheme: its layers take none (the softmax layers of a hybrid use theirs)

    @classmethod
    def mask(cls, config, positions, start, T, device):
        return None

    @classmethod
    def keys_per_query(cls, config, seq_len):
        return min(seq_len, cls.chunk) + config.n_embd // config.n_head

    def new_cache(self, max_len):
        return self.Cache()

    seq_dim = 1

    def heads(self, x):
        """The convolution's input (B, T, channels): q, k and v are made in mix, after it."""
        return self.qkv(x), None, None

    def gates(self, x):
        """(z, beta, g) from the block input: the output gate, the write strength, the log forget gate."""
        b, a = self.ba(x).float().chunk(2, dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        return self.z(x), torch.sigmoid(b), g

    def convolve(self, mixed, previous):
        """The causal depthwise convolution with SiLU: (the output, the last conv_kernel - 1 inputs).

        Over (B, T, channels) after the previous conv_kernel - 1 inputs (None: zeros), with SiLU;
        returns (the output, the last conv_kernel - 1 inputs)."""
        x = mixed.float().transpose(1, 2)  # (B, channels, T)
        if previous is None:
            previous = x.new_zeros(x.size(0), x.size(1), self.conv_kernel - 1)
        x = torch.cat([previous, x], dim=2)
        out = F.silu(F.conv1d(x, self.conv.weight.float(), groups=self.channels))
        return out.transpose(1, 2), x[:, :, -(self.conv_kernel - 1) :]

    def split(self, mixed):
        B, T, _ = mixed.shape
        hd, n_k, n_v = self.head_dim, self.n_kv_head, self.n_head
        q, k, v = mixed.split([n_k * hd, n_k * hd, n_v * hd], dim=-1)
        q, k = (l2_normalize(t.view(B, T, n_k, hd)).transpose(1, 2).repeat_interleave(n_v // n_k, dim=1) for t in (q, k))
        return q * hd**-0.5, k, v.view(B, T, n_v, hd).transpose(1, 2)

    def core(self, q, k, v, g, beta, state):
        return gated_delta_chunk(q, k, v, g, beta, state)

    def finish(self, y, z):
        """RMSNorm per head, gated by SiLU(z): (B, H, T, D)."""
        B, T, _ = z.shape
        return self.out_norm(y) * F.silu(z.float().view(B, T, self.n_head, self.head_dim).transpose(1, 2))

    def mix(self, q, k, v, gates, start, mask, cache, positions):
        z, beta, g = gates
        dtype = z.dtype
        with torch.autocast(q.device.type, enabled=False):
            state, conv = (None, None) if cache is None or cache.state is None else cache.state
            x, conv = self.convolve(q, conv)
            q, k, v = self.split(x)
            beta, g = None if beta is None else beta.transpose(1, 2), g.transpose(1, 2)  # (B, H, T)
            ys = []
            for a in range(0, q.size(2), self.chunk):
                part = slice(a, a + self.chunk)
                y, state = self.core(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], None if beta is None else beta[:, :, part], state)
                ys.append(y)
            y = self.finish(torch.cat(ys, dim=2), z)
        if cache is not None:
            cache.update(start + q.size(2), (state, conv))
        return y.to(dtype)

    def static_cache(self, cache, length, max_len):
        return self.StaticCache(*(t.clone() for t in cache.state))

    def decode_one(self, q, k, v, gates, pos, cache, positions):
        z, beta, g = gates
        dtype = z.dtype
        with torch.autocast(q.device.type, enabled=False):
            x, conv = self.convolve(q, cache.conv)
            q, k, v = self.split(x)
            y, S = self.core(q, k, v, g.transpose(1, 2), None if beta is None else beta.transpose(1, 2), cache.S)
            cache.S.copy_(S)
            cache.conv.copy_(conv)
            y = self.finish(y, z)
        return y.to(dtype)


class GatedLinearAttention(GatedDeltaNet):
    """Linear attention with a data-dependent decay: Mamba-2's scalar forget gate.

    Mamba-2's scalar form of the forget gate (Dao and Gu 2024; GLA's, Yang et al. 2023, with one gate per head
    instead of one per key channel). Per head, S_t = a_t S_{t-1} + k_t^T v_t and y_t = q_t S_t, with a_t =
    e^{g_t}, g = -exp(A_log) softplus(a + dt_bias) computed from the block input: the gated delta rule's layer
    (its convolution, L2-normalised q and k, output norm and SiLU gate, grouped value heads, no positions)
    without the delta rule's correction, so it adds where N overwrites. Chunks of 64 (decay_chunk), the
    recurrence while decoding, the state and the convolution's last inputs as its cache."""

    letter, description = "M", "linear attention with a data-dependent decay (Mamba-2's, GLA's scalar gate)"
    StaticCache = StaticDeltaState  # (its decode_one is N's, through its own core)

    def __init__(self, config):
        super().__init__(config)
        self.ba = nn.Linear(config.n_embd, self.n_head, bias=config.bias)  # the decay's logits alone: no beta

    def gates(self, x):
        g = -self.A_log.float().exp() * F.softplus(self.ba(x).float() + self.dt_bias.float())
        return self.z(x), None, g

    def core(self, q, k, v, g, beta, state):
        return decay_chunk(q, k, v, g, state)
