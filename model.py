"""
A GPT language model: the network, its KV cache and its sampling loop.

Features (each chosen once, in GPTConfig):
- positions: learned | rope (linear or YaRN scaling) | sinusoidal | alibi | t5 | none
- norm: layernorm | rmsnorm, pre-norm blocks, optional QK-norm
- mlp: gelu (GPT-2's tanh GELU) | swiglu | relu2
- grouped-query attention (n_kv_head < n_head), through F.scaled_dot_product_attention,
  with an explicit masked-softmax path kept as the reference
- tied or untied LM head, GPT-2 initialisation, z-loss
- forward_cached(): the one way through a preallocated KV cache (prompt, then a token per step);
  generate() and stream() around it: temperature, top-k, top-p, stop token, one generator per row

Reads top to bottom: config, norms, attention, MLPs, block, KV cache, sampling, model. The position
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
    mlp: str = "gelu"  # gelu | swiglu | relu2
    mlp_hidden: Optional[int] = None  # None = 4*n_embd (gelu, relu2), 8/3*n_embd rounded up to 64 (swiglu)
    qk_norm: bool = False  # normalise each head's queries and keys before the dot product
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2) added to the loss; 0 = off
    attn_impl: str = "sdpa"  # sdpa | explicit (the reference masked softmax)


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
        if self.mlp_hidden is None:
            self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64) if self.mlp == "swiglu" else 4 * self.n_embd
        if self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden={self.mlp_hidden} must be a positive integer")


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
# Attention


def causal_mask(start, T, kv_len, device):
    """Boolean (T, kv_len): query start+i may attend keys 0..start+i."""
    q_pos = torch.arange(start, start + T, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


def attention_scores(q, k, bias, start):
    """Pre-softmax scores (B, n_head, T, kv_len): scaled q.k (keys shared across a query group), plus
    any ALiBi bias, -inf where the causal mask hides a key."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    return scores.masked_fill(~causal_mask(start, q.size(2), k.size(2), q.device), float("-inf"))


def attention_explicit(q, k, v, bias, start, dropout_p=0.0):
    """The textbook path, kept as the reference that SDPA is tested against."""
    scores = attention_scores(q, k, bias, start)
    weights = F.dropout(F.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout_p)
    return weights @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)


def attention_sdpa(q, k, v, bias, start, dropout_p=0.0):
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.size(2) > 1:
        # torch 2.13's CPU flash-attention kernel is 2-4x slower in bf16 than in fp32 (backward above
        # all; measured in docs/research_log.md), so on CPU training and prefill attention run in fp32.
        # One decoded query stays in bf16: casting the whole cache to fp32 every step would cost more.
        with torch.autocast("cpu", enabled=False):  # autocast would cast them straight back to bf16
            return attention_sdpa(q.float(), k.float(), v.float(), bias, start, dropout_p).to(q.dtype)
    T, kv_len = q.size(2), k.size(2)
    gqa = q.size(1) != k.size(1)
    if bias is not None:  # ALiBi: the bias already holds -inf above the diagonal
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p, enable_gqa=gqa)
    if T == kv_len:  # no cache, or a prefill into an empty one
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=gqa)
    if T == 1:  # one new token sees every cached key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=gqa)
    mask = causal_mask(start, T, kv_len, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa)


ATTENTION = {"sdpa": attention_sdpa, "explicit": attention_explicit}


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        # one matmul for queries, keys and values (Llama's q/k/v projections are concatenated on load)
        self.qkv = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.attend = ATTENTION[config.attn_impl]
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, positions, start, bias, kv_cache):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = positions.rotate(q, k, start)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        y = self.attend(q, k, v, bias, start, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return self.resid_dropout(self.proj(y))


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
}

MODEL_CHOICES = {
    "pos_emb": tuple(POSITIONS),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": tuple(MLPS),
    "attn_impl": tuple(ATTENTION),
    "rope_scaling": ("none", "linear", "yarn"),
}


# ----------------------------------------------------------------------------------------------------
# Block


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.norm1 = make_norm(config, config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.norm2 = make_norm(config, config.n_embd)
        self.mlp = MLPS[config.mlp](config)

    def forward(self, x, positions, start, bias, kv_cache):
        x = x + self.attn(self.norm1(x), positions, start, bias, kv_cache)
        return x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------------------------------
# KV cache and sampling


class LayerKV:
    """One layer's keys and values, preallocated for max_len positions on the first write (which also
    fixes their dtype: the dtype the model computes in, autocast included)."""

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


class KVCache:
    """The cache of every layer (layers[i], a LayerKV each) and the length they share. Each attention layer
    writes and reads its own through update(); the model advances the length once all have written;
    rewind(n) keeps the first n positions (speculative decoding drops rejected drafts so). Another kind of
    layer cache (a rolling window, a recurrent state) stands in for a LayerKV by offering its update()."""

    def __init__(self, n_layer, max_len):
        self.layers = [LayerKV(max_len) for _ in range(n_layer)]
        self._length = 0

    @property
    def length(self):
        """Positions filled: the next token's position."""
        return self._length

    def update(self, layer, k, v):
        return self.layers[layer].update(self._length, k, v)

    def advance(self, n):
        self._length += n

    def rewind(self, n):
        """Keeps the first n positions; later writes overwrite the rest."""
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot rewind a KV cache of {self._length} positions to {n}")
        self._length = n


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


def lm_loss(logits, targets, z_loss=0.0):
    """Returns (loss, cross_entropy): mean cross-entropy over targets != -1, plus
    z_loss * mean(logsumexp(logits)^2) (PaLM's auxiliary loss, which keeps log Z near 0)."""
    logits = logits.view(-1, logits.size(-1)).float()
    targets = targets.reshape(-1)
    ce = F.cross_entropy(logits, targets, ignore_index=-1)
    if z_loss == 0:
        return ce, ce
    keep = targets != -1
    log_z = torch.logsumexp(logits[keep], dim=-1)
    return ce + z_loss * log_z.square().mean(), ce


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.positions = POSITIONS[config.pos_emb](config)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = make_norm(config, config.n_embd)
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
        return logits, lm_loss(logits, targets, self.config.z_loss)[0]

    def hidden_states(self, idx, kv_cache=None):
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        x = self.drop(self.positions.embed(self.tok_emb(idx), start))
        bias = self.positions.attn_bias(start, T, start + T)
        for block in self.blocks:
            x = block(x, self.positions, start, bias, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm_f(x)

    def forward_cached(self, idx, cache=None, last=1):
        """idx (B, T) continuing what cache holds (without a cache: a whole sequence) -> the logits of its
        last `last` positions (B, last, vocab), the head run on those only; the cache grows by T. The one
        way through the cache: a prefill, a decode step, the check of a draft's proposals, a draft's own."""
        return self.lm_head(self.hidden_states(idx, cache)[:, -last:])

    def next_logits(self, seq, length, cache=None):
        """The logits (B, vocab) of the token after seq[:, :length]: the tokens the cache has not seen yet
        go through it (the whole prompt first, then one per step), or, without a cache or once the sequence
        has outgrown block_size, the last block_size tokens run afresh. Past block_size every cached key
        is stale (each depended on tokens that have left the window), so both ways compute the same."""
        block_size = self.config.block_size
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
        cache = KVCache(self.config.n_layer, self.config.block_size) if use_cache else None
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
        weight, plus 12 * n_layer * n_embd * T for the attention scores and their weighted sums."""
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + 12 * self.config.n_layer * self.config.n_embd * seq_len

    # Hugging Face interop lives in hf.py; these two keep the names nanoGPT and transformers users type.
    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """A Hugging Face GPT2LMHeadModel or LlamaForCausalLM: a local directory, or gpt2 / gpt2-medium /
        gpt2-large / gpt2-xl from the Hub (needs network, or the Hugging Face cache)."""
        import hf

        return hf.load_pretrained(cls, name_or_dir, dropout)

    def save_pretrained(self, directory):
        """config.json and model.safetensors that transformers' AutoModelForCausalLM loads."""
        import hf

        hf.save_pretrained(self, directory)
