"""
A GPT language model: the network, read top to bottom: config, MLPs, block, loss, model.

The norms' make_norm is attention's (attention/base.py), which QK-norm uses too.

Features (each chosen once, in GPTConfig):
- positions: learned | rope (linear or YaRN scaling) | sinusoidal | alibi | t5 | none (positions.py)
- norm: layernorm | rmsnorm, pre-norm (or the 2017 post-norm) blocks, optional QK-norm
- mlp: gelu (GPT-2's tanh GELU) | swiglu | relu2 | none (attention-only blocks)
- attention per layer (attn_pattern, a letter each): the kinds of the attention/ package's registry (full softmax,
  sliding window, causal linear attention), each with its own cache; grouped-query attention
  (n_kv_head < n_head); SDPA, or the explicit masked softmax kept as its reference (attn_impl)
- tied or untied LM head, GPT-2 initialisation, z-loss, label smoothing
- forward_cached(): the one way through the cache (prompt, then a token per step); decode_rows(): one
  step of many sequences, each at its own position (engine.py)

Elsewhere: sampling and the decode loop (generate.py, behind GPT.generate and GPT.stream), Hugging Face
conversion (hf.py, behind from_pretrained/save_pretrained), inference weight formats (quantize.py),
speculative decoding (speculative.py), optimizers (optim.py), device and precision choices (device.py).
"""


import math
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention
import generate
import hf
from attention import make_norm
from generate import Sampling
from positions import POSITIONS, LearnedPositions

# ----------------------------------------------------------------------------------------------------
# Config (the allowed values of its string fields are the registries below: MODEL_CHOICES)


@dataclass
class ModelKeys:
    """Every architecture key with its type and default; GPTConfig checks and completes them.

    The configs of train.py and bench.py extend this class, so every key here is one of theirs."""

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
    attn_pattern: str = "L"  # a letter per layer, tiled (attention.KINDS; --help lists them: model_helps)
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
        attention.check_pattern(self)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"GPTConfig.label_smoothing={self.label_smoothing} must be in [0, 1) (0 = off)")
        if self.mlp_hidden is None:
            self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64) if self.mlp == "swiglu" else 4 * self.n_embd
        if self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden={self.mlp_hidden} must be a positive integer")

    @property
    def layer_kinds(self):
        """attn_pattern tiled over the layers: one letter per layer ('SSSL', 6 layers -> 'SSSLSS')."""
        return (self.attn_pattern * self.n_layer)[: self.n_layer]

    @property
    def context_limit(self):
        """The longest sequence the model runs: block_size, or None for any length.

        The longest sequence the model runs: block_size; or None (any length, decoding one step per token
        with a cache of bounded size) when every layer's cache is bounded (windows, linear layers) and the
        positions are relative."""
        relative = self.pos_emb in ("rope", "alibi", "t5", "none")
        bounded = all(kind.Cache.bounded for kind in attention.kinds_of(self).values())
        return None if relative and bounded else self.block_size


MODEL_KEYS = [f.name for f in fields(ModelKeys)]


def model_config(keys):
    """The GPTConfig of an object that holds every model key (a script's config).

    ValueError when the values cannot make a model."""
    return GPTConfig(**{k: getattr(keys, k) for k in MODEL_KEYS})


def model_helps():
    """--help texts made from the registries when --help runs (a kind registered after import included)."""
    return {"attn_pattern": attention.pattern_help()}


# ----------------------------------------------------------------------------------------------------
# MLPs


def gelu_tanh(x):
    # GPT-2 was trained with the tanh approximation; the exact erf GELU would cost parity with its weights
    if torch.compiler.is_compiling():
        return gelu_tanh_as_sigmoid(x)
    return F.gelu(x, approximate="tanh")


def gelu_tanh_as_sigmoid(x):
    """GPT-2's tanh GELU written with a sigmoid, which compiles into one fast kernel.

    The same function, since (1 + tanh(z)) / 2 = sigmoid(2z). Under torch.compile this fuses into one
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
    "attn_impl": tuple(attention.KERNELS),
    "rope_scaling": ("none", "linear", "yarn"),
}


# ----------------------------------------------------------------------------------------------------
# Block


class Block(nn.Module):
    def __init__(self, config, kind):
        super().__init__()
        self.post_norm = config.norm_placement == "post"
        self.norm1 = make_norm(config, config.n_embd)
        self.attn = attention.KINDS[kind](config)
        attention_only = MLPS[config.mlp] is None  # then no MLP and no norm for it
        self.norm2 = None if attention_only else make_norm(config, config.n_embd)
        self.mlp = None if attention_only else MLPS[config.mlp](config)

    def forward(self, x, positions, start, mask, cache):
        return self.residual(x, lambda h: self.attn(h, positions, start, mask, cache))

    def forward_rows(self, x, positions, starts, masks, caches):
        """GPT.decode_rows: one token per row, each row at its own position with its own mask and cache.

        Row i of x (B, 1, C) is a token at its own position starts[i], with masks[i] and caches[i]."""
        return self.residual(x, lambda h: self.attn.forward_rows(h, positions, starts, masks, caches))

    def forward_static(self, x, positions, pos, cache):
        """GPT.decode_static: row b of x (B, 1, C) a token at position pos[b], through a StaticCache."""
        return self.residual(x, lambda h: self.attn.forward_static(h, positions, pos, cache))

    def forward_mixed(self, x, n, positions, pos, static, start, mask, cache):
        """GPT.decode_and_prefill: x (n + T, 1, C), n decoded tokens and a prompt's next T (Attention.forward_mixed)."""
        return self.residual(x, lambda h: self.attn.forward_mixed(h, n, positions, pos, static, start, mask, cache))

    def residual(self, x, attend):
        if self.post_norm:  # Vaswani et al. (2017): each residual sum normalised; needs warmup to train
            x = self.norm1(x + attend(x))
            return x if self.mlp is None else self.norm2(x + self.mlp(x))
        x = x + attend(self.norm1(x))
        return x if self.mlp is None else x + self.mlp(self.norm2(x))


# ----------------------------------------------------------------------------------------------------
# Model


def lm_loss(logits, targets, z_loss=0.0, label_smoothing=0.0, normalizer=None):
    """The language-model loss: (loss, plain cross-entropy) over the targets that are not -1.

    Returns (loss, cross_entropy): the mean cross-entropy over targets != -1, against targets smoothed by
    label_smoothing (1 - e on the target, e spread evenly over the vocabulary: Szegedy et al. 2016, the
    2017 transformer's 0.1), plus z_loss * mean(logsumexp(logits)^2) (PaLM's auxiliary loss, which keeps
    log Z near 0). cross_entropy is always the plain one: what evaluation and bits per byte report.
    normalizer: the sums over targets divided by it instead of by their count (supervised fine-tuning: the
    mean count of trained targets per micro-batch over the whole step, so each trained token weighs the
    same whichever micro-batch holds it, and a micro-batch with none gives 0 and no gradient, not NaN)."""
    logits = logits.view(-1, logits.size(-1)).float()
    targets = targets.reshape(-1)
    if not label_smoothing and not z_loss:
        if normalizer is not None:
            ce = F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum") / normalizer
            return ce, ce
        ce = F.cross_entropy(logits, targets, ignore_index=-1)
        return ce, ce
    # one log Z per position for all three terms (two F.cross_entropy calls would log-softmax the whole
    # vocabulary twice); masks, not logits[keep]: no host sync, no copy of the logits
    keep = (targets != -1).to(logits.dtype)
    n = keep.sum() if normalizer is None else normalizer
    log_z = torch.logsumexp(logits, dim=-1)
    nll = log_z - logits.gather(1, targets.clamp_min(0)[:, None])[:, 0]  # -log p(target)
    ce = (nll * keep).sum() / n
    loss = ce
    if label_smoothing:  # PyTorch's: (1 - e) * nll + e * mean over the vocabulary of -log p
        loss = (((1 - label_smoothing) * nll + label_smoothing * (log_z - logits.mean(dim=-1))) * keep).sum() / n
        ce = ce.detach()  # reported, not trained on
    if z_loss == 0:
        return loss, ce
    return loss + z_loss * (log_z.square() * keep).sum() / n, ce


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
        """Runs the model at another context, in place: block_size tokens and RoPE's scaling.

        The position tables are rebuilt, the weights stay, and the length the model was trained at stays
        in config.trained_block_size (YaRN extends from it). A ValueError for what cannot be: learned
        positions past their table, scaling without RoPE."""
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

    def add_tokens(self, base_vocab, ids):
        """Makes room for new tokens (the chat template's), in place, their rows at the mean of the old.

        The token table and an untied head grow to hold ids if they are smaller, and rows ids (new, or
        padding rows no input ever trained) start at the mean of the first base_vocab rows, the tokenizer's
        own (Hewitt 2021; transformers' resize_token_embeddings does the same): a new token's logit starts
        near an average token's, not at a random row's, and its embedding inside what the blocks have
        learned to read."""
        size = max(self.config.vocab_size, max(ids) + 1)
        rows = torch.tensor(ids)
        for module in (self.tok_emb, *([] if self.config.tie_embeddings else [self.lm_head])):
            old = module.weight.detach()
            weight = torch.cat([old, old.new_zeros(size - old.size(0), old.size(1))])
            weight[rows] = old[:base_vocab].mean(dim=0)
            module.weight = nn.Parameter(weight)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.tok_emb.num_embeddings, self.lm_head.out_features = size, size
        self.config = replace(self.config, vocab_size=size)
        return self

    def get_num_params(self, non_embedding=False):
        """Unique parameters (a tied head counts once).

        non_embedding drops the position table and, when the head is untied, the token table
        (lookups, not matmuls)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if isinstance(self.positions, LearnedPositions):
                n -= self.positions.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.tok_emb.weight.numel()
        return n

    def forward(self, idx, targets=None, kv_cache=None, with_ce=False, normalizer=None):
        """idx (B, T) -> (logits (B, T, vocab), loss or None): the training and evaluation forward.

        With kv_cache, idx continues the cached sequence at position kv_cache.length. with_ce: the loss is
        lm_loss's (loss, cross_entropy), which train.py takes from here so the loss runs inside the compiled
        forward (nanoGPT's way), not after it. normalizer: lm_loss's (fine-tuning on conversations)."""
        x = self.hidden_states(idx, kv_cache)
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        losses = lm_loss(logits, targets, self.config.z_loss, self.config.label_smoothing, normalizer)
        return logits, losses if with_ce else losses[0]

    def hidden_states(self, idx, kv_cache=None):
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        limit = self.config.context_limit
        if limit is not None and start + T > limit:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={limit}")
        x = self.drop(self.positions.embed(self.tok_emb(idx), start))
        masks = self.masks(start, T, idx.device)
        for i, (block, kind) in enumerate(zip(self.blocks, self.config.layer_kinds)):
            x = block(x, self.positions, start, masks[kind], None if kv_cache is None else kv_cache.layers[i])
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm_f(x)

    def masks(self, start, T, device):
        """Each kind's attention mask for T queries from position start, made once for its layers.

        Each kind's attention mask (attention/) for T queries from position start, made once and
        shared by the kind's layers."""
        dropout = self.training and self.config.dropout > 0
        return {letter: attention.layer_mask(kind, self.config, self.positions, start, T, device, dropout)
                for letter, kind in attention.kinds_of(self.config).items()}

    def new_cache(self, max_len=None):
        """An empty cache for generation: each layer's own kind.

        A full layer's keys for max_len positions (default block_size), a window's rolling buffer, a
        linear layer's state."""
        return attention.KVCache([block.attn.new_cache(max_len or self.config.block_size) for block in self.blocks])

    def decode_rows(self, tokens, caches):
        """One decode step of B independent sequences, each at its own length: a server's batch.

        One decode step of B independent sequences: tokens (B, 1), caches[i] the cache of row i, each at
        its own length -> logits (B, vocab). The projections, MLPs and head run once for the batch (the
        weights are read once: what batching buys where decoding is bound by reading them); attention runs
        row by row over each row's own cache. A server's batch of requests goes through here."""
        starts = [cache.length for cache in caches]
        limit = self.config.context_limit
        if limit is not None and max(starts) >= limit:
            raise ValueError(f"sequence of {max(starts) + 1} tokens is longer than block_size={limit}")
        x = self.tok_emb(tokens)
        x = self.drop(torch.cat([self.positions.embed(x[i : i + 1], s) for i, s in enumerate(starts)]))
        masks = [self.masks(s, 1, tokens.device) for s in starts]
        for i, (block, kind) in enumerate(zip(self.blocks, self.config.layer_kinds)):
            x = block.forward_rows(x, self.positions, starts, [m[kind] for m in masks], [c.layers[i] for c in caches])
        for cache in caches:
            cache.advance(1)
        return self.lm_head(self.norm_f(x))[:, -1]

    def decode_static(self, tokens, pos, caches):
        """One decode step as a pure function of tensors, through static caches: it compiles with fullgraph.

        tokens (B, 1), row b at position pos[b] (a (B,) tensor), through each layer's StaticCache
        (caches[i]: layer i's, updated in place) -> logits (B, vocab). generate.StaticDecode runs it."""
        x = self.drop(self.positions.embed_at(self.tok_emb(tokens), pos))
        for block, cache in zip(self.blocks, caches):
            x = block.forward_static(x, self.positions, pos, cache)
        return self.lm_head(self.norm_f(x))[:, -1]

    def decode_and_prefill(self, tokens, pos, caches, idx, cache, last=1):
        """decode_static's step for n rows and one prompt's chunk, in one pass over the weights.

        decode_static's step for its n rows and, in the same pass, idx (1, T) continuing what cache (a
        KVCache, as forward_cached takes it) holds -> (the rows' logits (n, vocab), the logits of idx's last
        `last` positions (1, last, vocab)). The n + T tokens go through the norms, projections, MLPs and
        head as rows of one batch, so the weights are read once for both: a server that decodes at the
        memory limit prefills a joining prompt almost for free (Sarathi-Serve's piggybacked chunks).
        Attention splits them: the rows through their static caches, idx through its cache."""
        n, T, start = tokens.size(0), idx.size(1), cache.length
        limit = self.config.context_limit
        if limit is not None and start + T > limit:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={limit}")
        x = torch.cat([self.positions.embed_at(self.tok_emb(tokens), pos),
                       self.positions.embed(self.tok_emb(idx), start).transpose(0, 1)])  # (n + T, 1, C)
        x = self.drop(x)
        masks = self.masks(start, T, idx.device)
        for block, kind, static, layer in zip(self.blocks, self.config.layer_kinds, caches, cache.layers):
            x = block.forward_mixed(x, n, self.positions, pos, static, start, masks[kind], layer)
        cache.advance(T)
        logits = self.lm_head(self.norm_f(torch.cat([x[:n], x[n + T - last :]])))[:, 0]
        return logits[:n], logits[n:][None]

    def forward_cached(self, idx, cache=None, last=1):
        """The one way through the cache: idx (B, T) continuing what it holds -> its last logits.

        idx (B, T) continuing what cache holds (without a cache: a whole sequence) -> the logits of its
        last `last` positions (B, last, vocab), the head run on those only; the cache grows by T. The one
        way through the cache: a prefill, a decode step, the check of a draft's proposals, a draft's own."""
        return self.lm_head(self.hidden_states(idx, cache)[:, -last:])

    # Sampling and the decode loop live in generate.py; these keep the names nanoGPT users type.
    def generate(self, idx, max_new_tokens, sampling=Sampling(), **keys):
        """generate.generate(self, ...): continues each row of idx by up to max_new_tokens tokens.

        keys: eos_token_id, use_cache, generator, step (keyword-only, as generate.generate names them).
        """
        return generate.generate(self, idx, max_new_tokens, sampling, **keys)

    def stream(self, idx, max_new_tokens, sampling=Sampling(), **keys):
        """generate.stream(self, ...): yields each new (B, 1) column of tokens as soon as it exists."""
        return generate.stream(self, idx, max_new_tokens, sampling, **keys)

    def flops_per_token(self, seq_len):
        """Training (forward + backward) FLOPs per token, as in the PaLM paper's appendix.

        6 per matmul weight, plus 12 * n_embd * (keys a query meets: each kind's keys_per_query) per
        layer for the attention scores and their weighted sums."""
        c = self.config
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + sum(12 * c.n_embd * attention.KINDS[kind].keys_per_query(c, seq_len)
                                       for kind in c.layer_kinds)

    # Hugging Face interop lives in hf.py; these two keep the names nanoGPT and transformers users type.
    # A training run's folder loads through checkpoint.load_any (checkpoint.py stands on model.py; the
    # reverse import would make a circle).
    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """A Hugging Face model: a GPT2LMHeadModel, Llama, Mistral, Qwen3 or Arcee directory, or a GPT-2 name.


        The names are gpt2 / gpt2-medium / gpt2-large / gpt2-xl from the Hub (network, or the Hugging Face
        cache). A training run's folder gets one line naming checkpoint.load_any, which gives the tokenizer too.
        """
        return hf.load_pretrained(lambda keys: cls(GPTConfig(**keys, dropout=dropout)), name_or_dir)

    def save_pretrained(self, directory):
        """Writes config.json and model.safetensors that transformers' AutoModelForCausalLM loads."""
        hf.save_pretrained(self, directory)
