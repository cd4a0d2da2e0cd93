"""
A GPT language model: the network, its KV cache and its sampling loop.

Features (each chosen once, in GPTConfig):
- positions: learned | rope (linear or YaRN scaling) | sinusoidal | alibi | t5 | none
- norm: layernorm | rmsnorm, pre-norm (or the 2017 post-norm) blocks, optional QK-norm
- mlp: gelu (GPT-2's tanh GELU) | swiglu | relu2
- attention per layer (attn_pattern): full softmax, softmax over a sliding window, or causal linear
  attention; grouped-query attention (n_kv_head < n_head) through F.scaled_dot_product_attention, with
  an explicit masked-softmax path kept as the reference
- tied or untied LM head, GPT-2 initialisation, z-loss, label smoothing
- forward_cached(): the one way through the cache (prompt, then a token per step), in which each layer
  keeps its own kind of state: all its keys, the last window of them, or a linear layer's running sums;
  generate() and stream() around it: temperature, top-k, top-p, stop token, one generator per row

Reads top to bottom: config, norms, attention (softmax, then linear), MLPs, block, caches, sampling, model. The position
schemes are a registry of their own (positions.py). Elsewhere: Hugging Face conversion (hf.py, behind
from_pretrained/save_pretrained), inference weight formats (quantize.py), speculative decoding
(speculative.py), optimizers (optim.py), device and precision choices (device.py).
"""


import math
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from positions import POSITIONS, LearnedPositions

# ----------------------------------------------------------------------------------------------------
# Config (the allowed values of its string fields are the registries below: MODEL_CHOICES)


@dataclass
class ModelKeys:
    """Every architecture key with its type and default: GPTConfig checks and completes them; the
    configs of train.py and bench.py extend this class, so every key here is one of theirs."""

    block_size: int = 1024  # longest context the model sees
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None  # key/value heads; None = n_head, fewer = grouped-query attention
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorms
    pos_emb: str = "learned"  # learned | rope | sinusoidal | alibi | t5 | none
    rope_theta: float = 10000.0
    rope_scaling: str = "none"  # none | linear (position interpolation) | yarn: RoPE past the length it was trained at
    rope_factor: float = 1.0  # rope_scaling's factor: how many times the trained context the positions stretch to
    trained_block_size: Optional[int] = None  # the context the model was first trained at; None = block_size
    t5_buckets: int = 32  # pos_emb=t5: offset buckets per head (half exact, half logarithmic)
    t5_max_distance: int = 128  # pos_emb=t5: offsets from here on share the last bucket
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # gelu | swiglu | relu2 | none (attention-only blocks)
    mlp_hidden: Optional[int] = None  # None = 4*n_embd (gelu, relu2), 8/3*n_embd rounded up to 64 (swiglu)
    qk_norm: bool = False  # normalise each head's queries and keys before the dot product
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2) added to the loss; 0 = off
    label_smoothing: float = 0.0  # training loss only (val loss and bits per byte stay plain cross-entropy); 0 = off
    attn_impl: str = "sdpa"  # sdpa | explicit (the reference masked softmax)
    attn_pattern: str = "L"  # a letter per layer, tiled: L full attention, S sliding window, R causal linear attention
    attn_window: Optional[int] = None  # S layers: a query sees itself and the attn_window - 1 tokens before it
    norm_placement: str = "pre"  # pre: x + f(norm(x)) | post: norm(x + f(x)), the 2017 block (no final norm)


@dataclass
class GPTConfig(ModelKeys):
    """The model's keys, checked (ValueError naming the key) and completed (n_kv_head, mlp_hidden)."""

    def __post_init__(self):
        for name, allowed in MODEL_CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"GPTConfig.{name}={value!r} is not one of {', '.join(map(repr, allowed))}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be a positive integer")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        head_dim = self.n_embd // self.n_head
        if self.pos_emb == "rope" and head_dim % 2:
            raise ValueError(f"GPTConfig.pos_emb='rope' needs an even head size; n_embd/n_head = {head_dim}")
        if self.pos_emb == "sinusoidal" and self.n_embd % 2:
            raise ValueError(f"GPTConfig.pos_emb='sinusoidal' needs an even n_embd, got {self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if self.z_loss < 0:
            raise ValueError(f"GPTConfig.z_loss={self.z_loss} must be >= 0 (0 turns it off)")
        if self.norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("GPTConfig.norm_eps and GPTConfig.rope_theta must be > 0")
        if self.rope_scaling != "none" and self.pos_emb != "rope":
            raise ValueError(f"GPTConfig.rope_scaling={self.rope_scaling!r} scales RoPE: it needs pos_emb='rope'")
        if self.rope_factor < 1 or (self.rope_factor != 1 and self.rope_scaling == "none"):
            raise ValueError(f"GPTConfig.rope_factor={self.rope_factor} must be >= 1, and 1 with rope_scaling='none'")
        if self.trained_block_size is not None and self.trained_block_size < 1:
            raise ValueError(f"GPTConfig.trained_block_size={self.trained_block_size} must be a positive integer")
        if self.t5_buckets < 2 or self.t5_max_distance <= self.t5_buckets // 2:
            raise ValueError(f"GPTConfig.t5_buckets={self.t5_buckets} must be >= 2 and t5_max_distance="
                             f"{self.t5_max_distance} above half of it (the exact buckets)")
        self.check_attention()
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"GPTConfig.label_smoothing={self.label_smoothing} must be in [0, 1) (0 = off)")
        if self.mlp_hidden is None:
            self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64) if self.mlp == "swiglu" else 4 * self.n_embd
        if self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden={self.mlp_hidden} must be a positive integer")


    def check_attention(self):
        pattern = self.attn_pattern
        unknown = sorted(set(pattern) - set(ATTENTION_KINDS))
        if not pattern or unknown:
            raise ValueError(f"GPTConfig.attn_pattern={pattern!r}: each letter must be one of L (full attention), "
                             f"S (sliding window), R (causal linear attention){'; got ' + repr(unknown[0]) if unknown else ''}")
        if "S" in pattern and self.attn_window is None:
            raise ValueError(f"GPTConfig.attn_pattern={pattern!r} has sliding-window layers (S): set attn_window, "
                             "the tokens each query sees (itself included)")
        if self.attn_window is not None and self.attn_window < 1:
            raise ValueError(f"GPTConfig.attn_window={self.attn_window} must be a positive integer")
        if self.attn_window is not None and "S" not in pattern:
            raise ValueError(f"GPTConfig.attn_window={self.attn_window} is set but attn_pattern={pattern!r} has no "
                             "S layer to use it: add S to the pattern or leave attn_window unset")
        if "R" in pattern and self.pos_emb in ("alibi", "t5"):
            raise ValueError(f"GPTConfig.attn_pattern={pattern!r} has linear-attention layers (R), which never form "
                             f"the score matrix that pos_emb={self.pos_emb!r} adds its bias to; use rope, learned, "
                             "sinusoidal or none")
        if "R" in pattern and self.rope_scaling != "none":
            raise ValueError(f"GPTConfig.attn_pattern={pattern!r} has linear-attention layers (R), whose RoPE is "
                             f"not scaled; rope_scaling={self.rope_scaling!r} is for softmax attention only")

    @property
    def layer_kinds(self):
        """attn_pattern tiled over the layers: one letter per layer ('SSSL', 6 layers -> 'SSSLSS')."""
        return (self.attn_pattern * self.n_layer)[: self.n_layer]

    @property
    def context_limit(self):
        """The longest sequence the model runs: block_size; or None (any length, decoding one step per token
        with a cache of bounded size) when every layer is windowed or linear and the positions are relative."""
        relative = self.pos_emb in ("rope", "alibi", "t5", "none")
        return None if relative and "L" not in self.layer_kinds else self.block_size


MODEL_KEYS = [f.name for f in fields(ModelKeys)]


def model_config(keys):
    """The GPTConfig of an object that holds every model key (a script's config); ValueError when the
    values cannot make a model."""
    return GPTConfig(**{k: getattr(keys, k) for k in MODEL_KEYS})


# ----------------------------------------------------------------------------------------------------
# Norms


def make_norm(config, dim):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


# ----------------------------------------------------------------------------------------------------
# Attention. Which keys a query sees is one mask per kind of layer, made once per forward (GPT.masks):
# None = every key up to the query's own (the queries being the last T keys), a boolean (T, keys) tensor,
# or an additive (n_head, T, keys) bias (ALiBi, T5) holding -inf where a key is hidden.


def visible(q_start, T, k_start, k_len, window, device):
    """Boolean (T, k_len): query q_start+i sees key k_start+j when the key is not later and, with a
    window, fewer than `window` positions earlier (so the query sees itself and window - 1 keys before)."""
    offset = (torch.arange(q_start, q_start + T, device=device)[:, None]
              - torch.arange(k_start, k_start + k_len, device=device)[None, :])  # fmt: skip
    return (offset >= 0) & (offset < window) if window else offset >= 0


def attention_scores(q, k, mask):
    """Pre-softmax scores (B, n_head, T, keys): scaled q.k (keys shared across a query group), -inf where
    the mask hides a key, plus any position bias."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if mask is None:
        mask = visible(k.size(2) - q.size(2), q.size(2), 0, k.size(2), None, q.device)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def attention_explicit(q, k, v, mask, dropout_p=0.0):
    """The textbook path, kept as the reference that SDPA is tested against."""
    scores = attention_scores(q, k, mask)
    weights = F.dropout(F.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout_p)
    return weights @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)


def attention_sdpa(q, k, v, mask, dropout_p=0.0):
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.size(2) > 1:
        # torch 2.13's CPU flash-attention kernel is 2-4x slower in bf16 than in fp32 (backward above
        # all; measured in docs/research_log.md), so on CPU training and prefill attention run in fp32.
        # One decoded query stays in bf16: casting the whole cache to fp32 every step would cost more.
        with torch.autocast("cpu", enabled=False):  # autocast would cast them straight back to bf16
            return attention_sdpa(q.float(), k.float(), v.float(), mask, dropout_p).to(q.dtype)
    T, kv_len = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if mask is not None:  # a window's boolean mask, or a bias that already holds -inf where keys are hidden
        mask = mask if mask.dtype == torch.bool else mask.to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
    if T == kv_len:  # no cache, or a prefill into an empty one
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    if T == 1:  # one new token sees every cached key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
    mask = visible(kv_len - T, T, 0, kv_len, None, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


ATTENTION = {"sdpa": attention_sdpa, "explicit": attention_explicit}


class CausalSelfAttention(nn.Module):
    """Softmax attention over every earlier key (L), or over the last `window` positions only (S, whose
    cache then keeps only those)."""

    def __init__(self, config, window=None):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.window = window
        # one matmul for queries, keys and values (Llama's q/k/v projections are concatenated on load)
        self.qkv = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.attend = ATTENTION[config.attn_impl]
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, positions, start, mask, cache):
        q, k, v = self.heads(x)
        if isinstance(start, list):  # rows of different sequences, each at its own position (GPT.decode_rows)
            rows = zip(q.split(1), k.split(1), v.split(1), start, mask, cache)
            return self.out(torch.cat([self.mix(*row, positions) for row in rows]))
        return self.out(self.mix(q, k, v, start, mask, cache, positions))

    def mix(self, q, k, v, start, mask, cache, positions):
        """Heads (B, H, T, D) of positions start.. -> each query's weighted sum of the values it sees."""
        q, k = positions.rotate(q, k, start)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self.attend(q, k, v, mask, self.dropout if self.training else 0.0)

    def heads(self, x):
        """x (B, T, C) -> queries (B, n_head, T, D), keys and values (B, n_kv_head, T, D)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        return q, k, v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)

    def out(self, y):
        B, _, T, _ = y.shape
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)))

    def new_cache(self, max_len):
        return WindowKV(self.window) if self.window else LayerKV(max_len)


class LinearAttention(CausalSelfAttention):
    """Causal linear attention (Katharopoulos et al. 2020), the R layers: softmax(q.k) replaced by
    phi(q).phi(k) with phi = elu + 1 > 0, so the sum over earlier keys is a running one. Per head:

        y_i = phi(q_i) S_i / (phi(q_i) . z_i),   S_i = sum_{j<=i} phi(k_j) v_j^T  (d x d),   z_i = sum_{j<=i} phi(k_j)

    Training and prefill go chunk by chunk (the quadratic form inside a chunk, the state across chunks);
    a decoded token updates the state, so it costs the same at position 10 and 10,000 and the cache is the
    state alone. With RoPE, the numerator's phi(q) and phi(k) are rotated and the denominator's are not
    (Su et al. 2021, sec. 3.3): scores then depend on offsets and the denominator stays positive. Keys and
    values shared by a query group (GQA) are repeated per query head. Computed in fp32."""

    chunk = 64  # queries per chunk: the quadratic part costs chunk * d per token, the state d * d

    def mix(self, q, k, v, start, mask, cache, positions):
        groups = self.n_head // self.n_kv_head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with torch.autocast(q.device.type, enabled=False):
            q, k = F.elu(q.float()) + 1, F.elu(k.float()) + 1
            rq, rk = positions.rotate(q, k, start)  # unchanged unless pos_emb='rope'
            state = None if cache is None else cache.state
            ys = []
            for a in range(0, q.size(2), self.chunk):
                part = slice(a, a + self.chunk)
                y, state = linear_attention_chunk(q[:, :, part], k[:, :, part], rq[:, :, part], rk[:, :, part],
                                                  v[:, :, part].float(), state)
                ys.append(y)
        if cache is not None:
            cache.state, cache.end = state, start + q.size(2)
        return torch.cat(ys, dim=2).to(v.dtype)

    def new_cache(self, max_len):
        return LinearState()


def linear_attention_chunk(q, k, rq, rk, v, state, eps=1e-6):
    """Causal linear attention over one chunk (B, H, T, D) after `state` (S, z), or None at the start:
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


ATTENTION_KINDS = {
    "L": CausalSelfAttention,
    "S": lambda config: CausalSelfAttention(config, window=config.attn_window),
    "R": LinearAttention,
}


# ----------------------------------------------------------------------------------------------------
# MLPs


def gelu_tanh(x):
    # GPT-2 was trained with the tanh approximation; the exact erf GELU would cost parity with its weights
    if torch.compiler.is_compiling():
        return gelu_tanh_as_sigmoid(x)
    return F.gelu(x, approximate="tanh")


def gelu_tanh_as_sigmoid(x):
    """The same function, since (1 + tanh(z)) / 2 = sigmoid(2z). Under torch.compile this fuses into one
    kernel that runs the CPU forward 3x and the backward 1.7x faster than inductor's tanh GELU; in eager
    mode its five ops are slower than aten's one (docs/research_log.md)."""
    return x * torch.sigmoid(math.sqrt(8 / math.pi) * (x + 0.044715 * x * x * x))


def relu_squared(x):
    return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, config, activation):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.activation = activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(self.activation(self.fc(x))))


class SwiGLU(nn.Module):
    """Shazeer (2020): silu(x W_gate) * (x W_up), then down. Gate and up share one matmul."""

    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.mlp_hidden, bias=config.bias)
        self.proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.dropout(self.proj(F.silu(gate) * up))


MLPS = {
    "gelu": lambda config: MLP(config, gelu_tanh),
    "relu2": lambda config: MLP(config, relu_squared),
    "swiglu": SwiGLU,
    "none": None,  # attention-only blocks, the toy models of Elhage et al. (2021) and Olsson et al. (2022)
}

MODEL_CHOICES = {
    "pos_emb": tuple(POSITIONS),
    "norm_placement": ("pre", "post"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": tuple(MLPS),
    "attn_impl": tuple(ATTENTION),
    "rope_scaling": ("none", "linear", "yarn"),
}


# ----------------------------------------------------------------------------------------------------
# Block


class Block(nn.Module):
    def __init__(self, config, kind):
        super().__init__()
        self.post_norm = config.norm_placement == "post"
        self.norm1 = make_norm(config, config.n_embd)
        self.attn = ATTENTION_KINDS[kind](config)
        attention_only = MLPS[config.mlp] is None  # then no MLP and no norm for it
        self.norm2 = None if attention_only else make_norm(config, config.n_embd)
        self.mlp = None if attention_only else MLPS[config.mlp](config)

    def forward(self, x, positions, start, mask, cache):
        if self.post_norm:  # Vaswani et al. (2017): each residual sum normalised; needs warmup to train
            x = self.norm1(x + self.attn(x, positions, start, mask, cache))
            return x if self.mlp is None else self.norm2(x + self.mlp(x))
        x = x + self.attn(self.norm1(x), positions, start, mask, cache)
        return x if self.mlp is None else x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------------------------------
# KV cache and sampling


class LayerKV:
    """A full-attention layer's keys and values, preallocated for max_len positions on the first write
    (which also fixes their dtype: the dtype the model computes in, autocast included)."""

    def __init__(self, max_len):
        self.max_len, self.k, self.v = max_len, None, None

    def update(self, start, k, v):
        """Writes k, v (B, H, T, D) at positions start.. and returns every key and value up to them."""
        if self.k is None:
            B, H, _, D = k.shape
            self.k = k.new_empty(B, H, self.max_len, D)  # only written positions are read
            self.v = v.new_empty(B, H, self.max_len, D)
        end = start + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; writing up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def rewind(self, n):
        pass  # positions from n on are overwritten by the next writes

    def nbytes(self, length):
        return 0 if self.k is None else 2 * self.k[:, :, :length].numel() * self.k.element_size()


class WindowKV:
    """A sliding-window layer's keys and values: a rolling buffer of what the next query can see (the
    window - 1 positions before it), plus the last write's positions, into which speculative decoding may
    roll back. Its size is bounded by the window, however long the text grows."""

    def __init__(self, window):
        self.window, self.k, self.v, self.first = window, None, None, 0  # first: position of self.k[:, :, 0]

    def update(self, start, k, v):
        """Adds k, v at positions start.. and returns the keys and values from max(0, start - window + 1)
        on: all that these queries can see."""
        first = max(0, start - self.window + 1)
        if self.k is not None:
            keep = slice(first - self.first, start - self.first)  # positions from start on were rolled back
            k, v = torch.cat([self.k[:, :, keep], k], dim=2), torch.cat([self.v[:, :, keep], v], dim=2)
        self.k, self.v, self.first = k, v, first
        return k, v

    def rewind(self, n):
        if max(0, n - self.window + 1) < self.first:
            raise ValueError(f"a sliding-window cache keeps positions {self.first} on; it cannot roll back to {n}")

    def nbytes(self, length):
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


class LinearState:
    """A linear-attention layer's cache: its running sums (S, z) over every position so far, in fp32, the
    same size at any length. A sum cannot give back what it added: rolling back is refused."""

    def __init__(self):
        self.state, self.end = None, 0

    def rewind(self, n):
        if n != self.end:
            raise ValueError(f"a linear-attention (R) layer's state sums positions 0..{self.end - 1} and cannot "
                             f"roll back to {n}")

    def nbytes(self, length):
        return 0 if self.state is None else sum(t.nbytes for t in self.state)


class KVCache:
    """The cache of every layer (layers[i]: LayerKV, WindowKV or LinearState, as layer i's attention
    made it; GPT.new_cache) and the length they share. Each layer writes and reads its own; the model
    advances the length once all have written; rewind(n) keeps the first n positions (speculative
    decoding drops rejected drafts so), where every layer's kind of cache can."""

    def __init__(self, layers):
        self.layers = layers
        self._length = 0

    @property
    def length(self):
        """Positions filled: the next token's position."""
        return self._length

    def advance(self, n):
        self._length += n

    def rewind(self, n):
        """Keeps the first n positions; later writes overwrite the rest."""
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot rewind a KV cache of {self._length} positions to {n}")
        for layer in self.layers:
            layer.rewind(n)
        self._length = n

    def nbytes(self):
        """Bytes the layers hold for the positions so far (a full-attention layer's preallocated but
        unwritten positions not counted)."""
        return sum(layer.nbytes(self._length) for layer in self.layers)


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


# ----------------------------------------------------------------------------------------------------
# Model


def lm_loss(logits, targets, z_loss=0.0, label_smoothing=0.0):
    """Returns (loss, cross_entropy): the mean cross-entropy over targets != -1, against targets smoothed
    by label_smoothing (1 - e on the target, e spread evenly over the vocabulary: Szegedy et al. 2016, the
    2017 transformer's 0.1), plus z_loss * mean(logsumexp(logits)^2) (PaLM's auxiliary loss, which keeps
    log Z near 0). cross_entropy is always the plain one: what evaluation and bits per byte report."""
    logits = logits.view(-1, logits.size(-1)).float()
    targets = targets.reshape(-1)
    ce = F.cross_entropy(logits, targets, ignore_index=-1)
    loss = ce
    if label_smoothing:
        loss = F.cross_entropy(logits, targets, ignore_index=-1, label_smoothing=label_smoothing)
        ce = ce.detach()  # reported, not trained on
    if z_loss == 0:
        return loss, ce
    keep = targets != -1
    log_z = torch.logsumexp(logits[keep], dim=-1)
    return loss + z_loss * log_z.square().mean(), ce


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = POSITIONS[config.pos_emb](config)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, kind) for kind in config.layer_kinds)
        # post-norm blocks end normalised already; the 2017 transformer has no final norm
        self.norm_f = make_norm(config, config.n_embd) if config.norm_placement == "pre" else nn.Identity()
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the residual branches' output projections so the residual stream's variance does
        # not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def set_context(self, block_size=None, rope_scaling=None, rope_factor=None):
        """Runs the model at another context, in place: block_size tokens and, for RoPE, its scaling (None:
        as it is). The position tables are rebuilt, the weights stay, and the length the model was trained
        at stays in config.trained_block_size (YaRN extends from it). A ValueError for what cannot be:
        learned positions past their table, scaling without RoPE."""
        c = self.config
        block_size = block_size or c.block_size
        if c.pos_emb == "learned" and block_size > c.block_size:
            raise ValueError(f"pos_emb='learned' has a trained vector for each of {c.block_size} positions and none "
                             f"past them, so it cannot run a context of {block_size}; rope, alibi, t5, none and "
                             "sinusoidal positions can")
        rope = {k: v for k, v in (("rope_scaling", rope_scaling), ("rope_factor", rope_factor)) if v is not None}
        self.config = replace(c, block_size=block_size, trained_block_size=c.trained_block_size or c.block_size, **rope)
        tensors = [*self.positions.parameters(), *self.positions.buffers()]  # in for_inference's dtype, if any
        like = tensors[0] if tensors else self.tok_emb.weight
        positions = POSITIONS[c.pos_emb](self.config).to(device=like.device, dtype=like.dtype)
        state = self.positions.state_dict()
        if c.pos_emb == "learned":
            state["wpe.weight"] = state["wpe.weight"][:block_size]
        positions.load_state_dict(state)
        self.positions = positions
        return self

    def get_num_params(self, non_embedding=False):
        """Unique parameters (a tied head counts once). non_embedding drops the position table and, when
        the head is untied, the token table (lookups, not matmuls)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if isinstance(self.positions, LearnedPositions):
                n -= self.positions.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.tok_emb.weight.numel()
        return n

    def forward(self, idx, targets=None, kv_cache=None):
        """idx (B, T) -> (logits (B, T, vocab), loss or None). With kv_cache, idx continues the cached
        sequence at position kv_cache.length."""
        x = self.hidden_states(idx, kv_cache)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        return logits, lm_loss(logits, targets, self.config.z_loss, self.config.label_smoothing)[0]

    def hidden_states(self, idx, kv_cache=None):
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        limit = self.config.context_limit
        if limit is not None and start + T > limit:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={limit}")
        x = self.drop(self.positions.embed(self.tok_emb(idx), start))
        masks = self.masks(start, T, idx.device)
        for i, (block, kind) in enumerate(zip(self.blocks, self.config.layer_kinds)):
            x = block(x, self.positions, start, masks.get(kind), None if kv_cache is None else kv_cache.layers[i])
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm_f(x)

    def masks(self, start, T, device):
        """The attention mask (see Attention above) of each kind of softmax layer for T queries from
        position start: a full layer's keys are positions 0..start+T-1, a window's from start - window + 1
        (what its cache keeps). Linear layers need none."""
        masks = {}
        for kind in sorted(set(self.config.layer_kinds) - {"R"}):
            window = self.config.attn_window if kind == "S" else None
            k_start = max(0, start - window + 1) if window else 0
            mask = self.positions.attn_bias(start, T, k_start, start + T - k_start)
            if window and start + T - k_start > window:  # some key is out of some query's window
                seen = visible(start, T, k_start, start + T - k_start, window, device)
                mask = seen if mask is None else mask.masked_fill(~seen, float("-inf"))
            masks[kind] = mask
        return masks

    def new_cache(self, max_len=None):
        """An empty cache for generation: each layer's own kind (a full layer's keys for max_len positions,
        default block_size; a window's rolling buffer; a linear layer's state)."""
        return KVCache([block.attn.new_cache(max_len or self.config.block_size) for block in self.blocks])

    def decode_rows(self, tokens, caches):
        """One decode step of B independent sequences: tokens (B, 1), caches[i] the cache of row i, each
        at its own length -> logits (B, vocab). The projections, MLPs and head run once for the batch (the
        weights are read once: what batching buys where decoding is bound by reading them); attention
        runs row by row over each row's own cache. A server's batch of requests goes through here."""
        starts = [cache.length for cache in caches]
        limit = self.config.context_limit
        if limit is not None and max(starts) >= limit:
            raise ValueError(f"sequence of {max(starts) + 1} tokens is longer than block_size={limit}")
        x = self.tok_emb(tokens)
        x = self.drop(torch.cat([self.positions.embed(x[i : i + 1], s) for i, s in enumerate(starts)]))
        masks = [self.masks(s, 1, tokens.device) for s in starts]
        for i, (block, kind) in enumerate(zip(self.blocks, self.config.layer_kinds)):
            x = block(x, self.positions, starts, [m.get(kind) for m in masks], [c.layers[i] for c in caches])
        for cache in caches:
            cache.advance(1)
        return self.lm_head(self.norm_f(x))[:, -1]

    def forward_cached(self, idx, cache=None, last=1):
        """idx (B, T) continuing what cache holds (without a cache: a whole sequence) -> the logits of its
        last `last` positions (B, last, vocab), the head run on those only; the cache grows by T. The one
        way through the cache: a prefill, a decode step, the check of a draft's proposals, a draft's own."""
        return self.lm_head(self.hidden_states(idx, cache)[:, -last:])

    def next_logits(self, seq, length, cache=None):
        """The logits (B, vocab) of the token after seq[:, :length]: the tokens the cache has not seen yet
        go through it (the whole prompt first, then one per step), or, without a cache or once the sequence
        has outgrown block_size, the last block_size tokens run afresh. Past block_size every cached key
        is stale (each depended on tokens that have left the window), so both ways compute the same.
        A model that runs any length (config.context_limit None: windows and linear layers, relative
        positions) never recomputes: the cache takes the new tokens, block_size at a time, and without a
        cache the whole sequence runs, which computes the same."""
        block_size = self.config.block_size
        if self.config.context_limit is None:
            if cache is None:
                return self.forward_cached(seq[:, :length])[:, -1]
            for begin in range(cache.length, length, block_size):
                logits = self.forward_cached(seq[:, begin : min(begin + block_size, length)], cache)
            return logits[:, -1]
        if cache is None or length > block_size:
            return self.forward_cached(seq[:, max(0, length - block_size) : length])[:, -1]
        return self.forward_cached(seq[:, cache.length : length], cache)[:, -1]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, sampling=Sampling(), eos_token_id=None, use_cache=True, generator=None):
        """Continues each row of idx (B, T; rows of equal length) by up to max_new_tokens tokens and
        returns (B, T + new). Call model.eval() first, or dropout stays on. With the cache, the prompt runs
        once and then one token per step; without it, each step recomputes the last block_size tokens
        (next_logits). Tokens are the same either way.

        A row that emits eos_token_id stops growing: later positions repeat eos_token_id. Generation ends
        early when every row has stopped, so `new` can be less than max_new_tokens.

        generator: None, a torch.Generator, or a list of one per row (row i then draws exactly the tokens
        a batch of one with that generator would). Speculative decoding: speculative.generate."""
        return torch.cat([idx, *self.stream(idx, max_new_tokens, sampling, eos_token_id, use_cache, generator)], dim=1)

    @torch.no_grad()
    def stream(self, idx, max_new_tokens, sampling=Sampling(), eos_token_id=None, use_cache=True, generator=None,
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
        cache = self.new_cache() if use_cache else None
        finished = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)
        length, end = T, T + max_new_tokens
        while length < end:
            tokens = None if step is None else step(seq, length, end, cache)
            if tokens is None:
                tokens = sample_next(self.next_logits(seq, length, cache), sampling, generator)
            for token in tokens.split(1, dim=1):
                if eos_token_id is not None:
                    token = token.masked_fill(finished, eos_token_id)
                    finished |= token == eos_token_id
                seq[:, length] = token[:, 0]
                length += 1
                yield token
                if eos_token_id is not None and bool(finished.all()):
                    return

    def flops_per_token(self, seq_len):
        """Training (forward + backward) FLOPs per token, as in the PaLM paper's appendix: 6 per matmul
        weight, plus 12 * n_embd * (keys a query meets) per layer for the attention scores and their
        weighted sums: seq_len in a full layer, at most attn_window in a windowed one, and in a linear one
        its chunk plus the head size (the state's d x d product)."""
        c = self.config
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        keys = {"L": seq_len, "S": min(seq_len, c.attn_window or seq_len),
                "R": min(seq_len, LinearAttention.chunk) + c.n_embd // c.n_head}
        return 6 * matmul_params + sum(12 * c.n_embd * keys[kind] for kind in c.layer_kinds)

    # Hugging Face interop lives in hf.py; these two keep the names nanoGPT and transformers users type.
    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """A training run's folder (its ckpt.pt), or a Hugging Face GPT2LMHeadModel or LlamaForCausalLM: a
        local directory, or gpt2 / gpt2-medium / gpt2-large / gpt2-xl from the Hub (needs network, or the
        Hugging Face cache). checkpoint.load_any gives the model's tokenizer too."""
        import os

        import checkpoint
        import hf

        if not os.path.exists(os.path.join(name_or_dir, checkpoint.CHECKPOINT)):
            return hf.load_pretrained(cls, name_or_dir, dropout)
        model = checkpoint.load_model(name_or_dir)[0]
        if dropout:
            tuned = cls(replace(model.config, dropout=dropout))
            tuned.load_state_dict(model.state_dict())
            model = tuned
        return model

    def save_pretrained(self, directory):
        """config.json and model.safetensors that transformers' AutoModelForCausalLM loads."""
        import hf

        hf.save_pretrained(self, directory)
