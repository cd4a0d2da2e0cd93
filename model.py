"""
A GPT language model: the network, read top to bottom: config, MLPs, block, loss, model.

Features (each chosen once, in GPTConfig):
- positions: learned | rope (linear or YaRN scaling) | sinusoidal | alibi | t5 | none (positions.py)
- norm: layernorm | rmsnorm (make_norm: attention/base.py's), pre-norm (or the 2017 post-norm) blocks, QK-norm
- mlp: gelu (GPT-2's tanh GELU) | gelu_exact | relu | relu2 | swiglu | geglu | none (attention-only blocks)
- attention per layer (attn_pattern, a letter each): the kinds of the attention/ package's registry (full softmax,
  sliding window, causal linear attention), each with its own cache; grouped-query attention
  (n_kv_head < n_head); SDPA, or the explicit masked softmax kept as its reference (attn_impl)
- tied or untied LM head, GPT-2 initialisation, z-loss, label smoothing
- the chapter's three families from the one block (family): decoder; encoder (BERT's heads, a ViT's patches
  and class token); encoder-decoder (T5: an encoder stack, decoder blocks that cross-attend to its states)
- forward_cached(): the one way through the cache (prompt, then a token per step); decode_rows(): one
  step of many sequences, each at its own position (engine.py)

Elsewhere: sampling and the decode loop (generate.py), Hugging Face conversion (hf.py, hf_encoders.py), weight
formats (quantize.py), speculative decoding, optimizers (optim.py), device and precision choices (device.py).
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
    mlp: str = "gelu"  # gelu (tanh) | gelu_exact (erf) | relu | relu2 | swiglu | geglu | none (attention-only blocks)
    mlp_hidden: Optional[int] = None  # None = 4*n_embd, or 8/3*n_embd rounded up to 64 for the gated (swiglu, geglu)
    qk_norm: bool = False  # normalise each head's queries and keys before the dot product
    tie_embeddings: bool = True  # LM head shares the token embedding matrix
    z_loss: float = 0.0  # coefficient of mean(logsumexp(logits)^2) added to the loss; 0 = off
    label_smoothing: float = 0.0  # training loss only (val loss and bits per byte stay plain cross-entropy); 0 = off
    attn_impl: str = "sdpa"  # sdpa | explicit (the reference masked softmax)
    attn_pattern: str = "L"  # a letter per layer, tiled (attention.KINDS; --help lists them: model_helps)
    attn_window: Optional[int] = None  # S layers: a query sees itself and the attn_window - 1 tokens before it
    norm_placement: str = "pre"  # pre: x + f(norm(x)) | post: norm(x + f(x)), the 2017 block (no final norm)
    # the chapter's three families from the one block (docs/guide.md: Other families)
    family: str = "decoder"  # decoder (GPT: causal) | encoder (BERT, ViT: every position sees every other) | encoder-decoder (T5)
    head: str = "lm"  # lm: next-token logits | mlm: BERT's masked-token head (encoders) | classify: class logits from the first position
    n_classes: int = 0  # head=classify: how many classes
    pooler: bool = False  # head=classify: BERT's pooler (dense + tanh on the first position) before the classifier
    type_vocab_size: int = 0  # BERT's token types (segments) added to the embeddings; 0 = none
    emb_norm: bool = False  # a norm over the embeddings before the first block (BERT)
    n_encoder_layer: int = 0  # family=encoder-decoder: the encoder's blocks (n_layer counts the decoder's)
    image_size: int = 0  # > 0: a vision transformer over square images of this many pixels a side (idx: pixels)
    patch_size: int = 16  # image_size > 0: each patch_size x patch_size patch is one token
    channels: int = 3  # image_size > 0: colour channels


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
        if self.mlp_hidden is None:  # a gated MLP's three matrices: 8/3 keeps the parameters of 4
            self.mlp_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64) if MLPS[self.mlp][0] is GLU else 4 * self.n_embd
        if self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden={self.mlp_hidden} must be a positive integer")
        self.check_family()

    def check_family(self):
        """What an encoder, an encoder-decoder and a vision transformer need of the other keys (one line each)."""
        family, head = self.family, self.head
        if (family == "encoder") == (head == "lm"):
            raise ValueError(f"GPTConfig.head={head!r} with family={family!r}: an encoder's head is 'mlm' or 'classify', others' 'lm'")
        if (head == "classify") != (self.n_classes >= 2) or self.n_classes < 0 or (self.pooler and head != "classify"):
            raise ValueError(f"GPTConfig.n_classes={self.n_classes}, pooler={self.pooler}: head='classify' needs "
                             "n_classes >= 2 (and only it takes a pooler); other heads n_classes=0")
        if (family == "encoder-decoder") != (self.n_encoder_layer > 0):
            raise ValueError(f"GPTConfig.n_encoder_layer={self.n_encoder_layer}: an encoder-decoder needs >= 1, others 0")
        causal = [k for k in dict.fromkeys(self.attn_pattern) if not attention.KINDS[k].bidirectional]
        if family == "encoder" and causal:
            raise ValueError(f"GPTConfig.family='encoder' attends both ways; {attention.named(causal)} layers exist "
                             "only causally here: use attn_pattern='L'")
        if self.type_vocab_size < 0 or ((self.type_vocab_size or self.emb_norm) and family != "encoder"):
            raise ValueError(f"GPTConfig.type_vocab_size={self.type_vocab_size}, emb_norm={self.emb_norm}: an encoder's (BERT)")
        tokens = (self.image_size // max(self.patch_size, 1)) ** 2 + 1  # a ViT's patches and its class token
        if self.image_size and (head != "classify" or self.type_vocab_size or self.patch_size < 1 or self.channels < 1
                                or self.image_size % self.patch_size):
            raise ValueError(f"GPTConfig.image_size={self.image_size}: a vision transformer is family='encoder', head="
                             f"'classify', no token types, channels >= 1, image_size a multiple of patch_size={self.patch_size}")
        if self.image_size and self.block_size != tokens:
            raise ValueError(f"GPTConfig.block_size={self.block_size}: {self.image_size}-pixel images in {self.patch_size}"
                             f"-pixel patches are {tokens - 1} patches and a class token: set block_size={tokens}")

    @property
    def layer_kinds(self):
        """attn_pattern tiled over the layers: one letter per layer ('SSSL', 6 layers -> 'SSSLSS')."""
        return (self.attn_pattern * self.n_layer)[: self.n_layer]

    @property
    def context_limit(self):
        """The longest sequence the model runs: block_size, or None (any length, one step per token) when
        every layer's cache is bounded (windows, linear layers) and the positions are relative."""
        relative = self.pos_emb in ("rope", "alibi", "t5", "none")
        bounded = all(kind.Cache.bounded for kind in attention.kinds_of(self).values())
        return None if relative and bounded else self.block_size


MODEL_KEYS = [f.name for f in fields(ModelKeys)]


def model_config(keys):
    """The GPTConfig of an object that holds every model key (a script's config); ValueError if none can be."""
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
    """GPT-2's tanh GELU written with a sigmoid ((1 + tanh(z)) / 2 = sigmoid(2z)), which compiles into one
    kernel: 3x the CPU forward, 1.7x the backward of inductor's tanh GELU; slower eager (research log)."""
    return x * torch.sigmoid(math.sqrt(8 / math.pi) * (x + 0.044715 * x * x * x))


class MLP(nn.Module):
    def __init__(self, config, activation):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.activation = activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(self.activation(self.fc(x))))


class GLU(nn.Module):
    """Shazeer (2020): act(x W_gate) * (x W_up), then down: SwiGLU (silu), GEGLU (GELU). Gate and up share one matmul."""

    def __init__(self, config, activation):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 2 * config.mlp_hidden, bias=config.bias)
        self.proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)
        self.activation = activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.dropout(self.proj(self.activation(gate) * up))


MLPS = {  # name: (module, activation); BERT's masked-token head uses the same activation
    "gelu": (MLP, gelu_tanh),
    "gelu_exact": (MLP, F.gelu),  # the erf GELU: BERT's and ViT's
    "relu": (MLP, F.relu),  # the 2017 transformer's and T5 v1.0's
    "relu2": (MLP, lambda x: F.relu(x).square()),  # ReLU² (So et al. 2021, Primer)
    "swiglu": (GLU, F.silu),
    "geglu": (GLU, gelu_tanh),  # T5 v1.1 (its gated-gelu gates with the tanh GELU)
    "none": (None, F.gelu),  # attention-only blocks, the toy models of Elhage et al. (2021) and Olsson et al. (2022)
}

MODEL_CHOICES = {
    "pos_emb": tuple(POSITIONS),
    "norm_placement": ("pre", "post"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": tuple(MLPS),
    "attn_impl": tuple(attention.KERNELS),
    "rope_scaling": ("none", "linear", "yarn"),
    "family": ("decoder", "encoder", "encoder-decoder"),
    "head": ("lm", "mlm", "classify"),
}


# ----------------------------------------------------------------------------------------------------
# Block


class Block(nn.Module):
    def __init__(self, config, kind, cross=False):
        super().__init__()
        self.post_norm = config.norm_placement == "post"
        self.norm1 = make_norm(config, config.n_embd)
        self.attn = attention.KINDS[kind](config)
        module, activation = MLPS[config.mlp]  # no MLP: no norm for it either
        self.norm2 = None if module is None else make_norm(config, config.n_embd)
        self.mlp = None if module is None else module(config, activation)
        if cross:  # an encoder-decoder's decoder block: a third sublayer between the two
            self.norm_x, self.cross = make_norm(config, config.n_embd), attention.CrossAttention(config)

    def forward(self, x, positions, start, mask, cache, memory=None):
        """memory: the cross-attention's (keys, values, key mask) from the encoder (GPT.cross_inputs), or None."""
        cross = None if memory is None else (lambda h: self.cross(h, *memory))
        return self.residual(x, lambda h: self.attn(h, positions, start, mask, cache), cross)

    def forward_rows(self, x, positions, starts, masks, caches, memories=None):
        """GPT.decode_rows: one token per row, each row at its own position with its own mask and cache.

        Row i of x (B, 1, C) is a token at its own position starts[i], with masks[i] and caches[i] (and an
        encoder-decoder's memories[i], its source's cross-attention inputs)."""
        cross = None if memories is None else (lambda h: torch.cat([self.cross(h[i : i + 1], *m) for i, m in enumerate(memories)]))
        return self.residual(x, lambda h: self.attn.forward_rows(h, positions, starts, masks, caches), cross)

    def forward_static(self, x, positions, pos, cache):
        """GPT.decode_static: row b of x (B, 1, C) a token at position pos[b], through a StaticCache."""
        return self.residual(x, lambda h: self.attn.forward_static(h, positions, pos, cache))

    def forward_mixed(self, x, n, positions, pos, static, start, mask, cache):
        """GPT.decode_and_prefill: x (n + T, 1, C), n decoded tokens and a prompt's next T (Attention.forward_mixed)."""
        return self.residual(x, lambda h: self.attn.forward_mixed(h, n, positions, pos, static, start, mask, cache))

    def residual(self, x, attend, cross=None):
        if self.post_norm:  # Vaswani et al. (2017): each residual sum normalised; needs warmup to train
            x = self.norm1(x + attend(x))
            x = x if cross is None else self.norm_x(x + cross(x))
            return x if self.mlp is None else self.norm2(x + self.mlp(x))
        x = x + attend(self.norm1(x))
        x = x if cross is None else x + cross(self.norm_x(x))
        return x if self.mlp is None else x + self.mlp(self.norm2(x))


def bidirectional(blocks, positions, x, pad_mask):
    """An encoder's stack over x (B, T, C): each position sees all but the padding (pad_mask (B, T) False),
    with the position scheme's two-way bias, if it has one."""
    mask = attention.key_mask(pad_mask, x.size(1), x.device)
    bias = positions.attn_bias(0, x.size(1), 0, x.size(1), causal=False)
    mask = mask if bias is None else bias.masked_fill(~mask, float("-inf"))
    for block in blocks:
        x = block(x, positions, 0, mask, None)
    return x


class Encoder(nn.Module):
    """An encoder-decoder's encoder (T5's): n_encoder_layer unmasked blocks with their own position table and norm."""

    def __init__(self, config):
        super().__init__()
        self.positions = POSITIONS[config.pos_emb](config)
        self.blocks = nn.ModuleList(Block(config, "L") for _ in range(config.n_encoder_layer))
        self.norm_f = make_norm(config, config.n_embd) if config.norm_placement == "pre" else nn.Identity()


# ----------------------------------------------------------------------------------------------------
# Model


def lm_loss(logits, targets, z_loss=0.0, label_smoothing=0.0, normalizer=None):
    """The loss: (loss, plain cross-entropy) over the targets that are not -1 (tokens, or a classifier's labels).

    The mean cross-entropy against targets smoothed by label_smoothing (1 - e on the target, e spread over
    the vocabulary: Szegedy et al. 2016), plus z_loss * mean(logsumexp(logits)^2) (PaLM's, keeps log Z near
    0); cross_entropy is the plain one evaluation and bits per byte report. normalizer: the sums divided by
    it, not by their count (fine-tuning: the step's mean count of trained targets per micro-batch, so each
    trained token weighs the same wherever it is, and a micro-batch with none gives 0, not NaN)."""
    logits = logits.view(-1, logits.size(-1)).float()
    targets = targets.reshape(-1)
    if not label_smoothing and not z_loss:
        ce = (F.cross_entropy(logits, targets, ignore_index=-1) if normalizer is None
              else F.cross_entropy(logits, targets, ignore_index=-1, reduction="sum") / normalizer)
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
        self.config = c = config
        self.tok_emb = None if c.image_size else nn.Embedding(c.vocab_size, c.n_embd)
        if c.image_size:  # a ViT's tokens: patches by a strided convolution (a linear map of each), a class token first
            self.patches = nn.Conv2d(c.channels, c.n_embd, c.patch_size, stride=c.patch_size)
            self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, c.n_embd))
        self.type_emb = nn.Embedding(c.type_vocab_size, c.n_embd) if c.type_vocab_size else None
        self.emb_norm = make_norm(c, c.n_embd) if c.emb_norm else None
        self.positions = POSITIONS[c.pos_emb](c)
        self.drop = nn.Dropout(c.dropout)
        self.encoder = Encoder(c) if c.family == "encoder-decoder" else None
        self.blocks = nn.ModuleList(Block(c, kind, cross=self.encoder is not None) for kind in c.layer_kinds)
        # post-norm blocks end normalised already; the 2017 transformer has no final norm
        self.norm_f = make_norm(c, c.n_embd) if c.norm_placement == "pre" else nn.Identity()
        if c.head == "classify":  # from the first position's final state (BERT's [CLS], a ViT's class token)
            self.pooler = nn.Linear(c.n_embd, c.n_embd) if c.pooler else None
            self.classifier, self.lm_head = nn.Linear(c.n_embd, c.n_classes), None
        else:  # BERT's masked-token head: dense, the MLP's activation, norm, then the (tied) decoder with a bias
            if c.head == "mlm":
                self.mlm_dense, self.mlm_norm = nn.Linear(c.n_embd, c.n_embd, bias=c.bias), make_norm(c, c.n_embd)
            self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=c.head == "mlm")
            if c.tie_embeddings:
                self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: the residual branches' output projections scaled, so the stream's variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def set_context(self, block_size=None, rope_scaling=None, rope_factor=None):
        """Runs the model at another context, in place: block_size tokens and RoPE's scaling.

        The position tables are rebuilt, the weights stay, the trained length stays in trained_block_size
        (YaRN extends from it); ValueError for learned positions past their table, scaling without RoPE."""
        c = self.config
        block_size = block_size or c.block_size
        if c.pos_emb == "learned" and block_size > c.block_size:
            raise ValueError(f"pos_emb='learned' has a trained vector for each of {c.block_size} positions and none "
                             f"past them, so it cannot run a context of {block_size}; rope, alibi, t5, none and "
                             "sinusoidal positions can")
        rope = {k: v for k, v in (("rope_scaling", rope_scaling), ("rope_factor", rope_factor)) if v is not None}
        self.config = replace(c, block_size=block_size, trained_block_size=c.trained_block_size or c.block_size, **rope)
        for owner in [self] + ([self.encoder] if self.encoder is not None else []):  # (an encoder-decoder: two tables)
            tensors = [*owner.positions.parameters(), *owner.positions.buffers()]  # in for_inference's dtype, if any
            like = tensors[0] if tensors else self.tok_emb.weight
            positions = POSITIONS[c.pos_emb](self.config).to(device=like.device, dtype=like.dtype)
            state = owner.positions.state_dict()
            if c.pos_emb == "learned":
                state["wpe.weight"] = state["wpe.weight"][:block_size]
            positions.load_state_dict(state)
            owner.positions = positions
        return self

    def add_tokens(self, base_vocab, ids):
        """Makes room for new tokens (the chat template's), in place, their rows at the mean of the old.

        The token table and an untied head grow to hold ids; rows ids start at the mean of the first
        base_vocab rows (Hewitt 2021, as transformers' resize_token_embeddings): a new token's logit near
        an average token's, its embedding inside what the blocks have learned to read."""
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
        """Unique parameters (a tied head counts once); non_embedding drops the lookups (position table, and
        the token table when the head is untied)."""
        learned = self.positions.wpe.weight.numel() if isinstance(self.positions, LearnedPositions) else 0
        untied = 0 if self.config.tie_embeddings or self.tok_emb is None else self.tok_emb.weight.numel()
        return sum(p.numel() for p in self.parameters()) - (learned + untied if non_embedding else 0)

    def forward(self, idx, targets=None, kv_cache=None, with_ce=False, normalizer=None, *, source=None, pad_mask=None,
                token_types=None):
        """idx (B, T) -> (logits (B, T, vocab), loss or None): the training and evaluation forward.

        With kv_cache, idx continues the cached sequence at position kv_cache.length. with_ce: lm_loss's
        (loss, cross_entropy), inside the compiled forward. A ViT's idx: pixels (B, C, H, W); classify: (B,
        n_classes), targets (B,); source (B, S): an encoder-decoder's encoder input; pad_mask (B, T or S): True
        on the encoder input's real tokens; token_types (B, T): BERT's segments. normalizer: lm_loss's."""
        x = self.hidden_states(idx, kv_cache, source=source, pad_mask=pad_mask, token_types=token_types)
        logits = self.head_logits(x)
        if targets is None:
            return logits, None
        losses = lm_loss(logits, targets, self.config.z_loss, self.config.label_smoothing, normalizer)
        return logits, losses if with_ce else losses[0]

    def head_logits(self, x):
        """Final states -> next-token or masked-token logits (B, T, vocab), or class logits (B, n_classes)."""
        if self.config.head == "classify":
            x = x[:, 0] if self.pooler is None else torch.tanh(self.pooler(x[:, 0]))
            return self.classifier(self.drop(x))
        if self.config.head == "mlm":
            x = self.mlm_norm(MLPS[self.config.mlp][1](self.mlm_dense(x)))
        return self.lm_head(x)

    def hidden_states(self, idx, kv_cache=None, *, source=None, pad_mask=None, token_types=None):
        c = self.config
        self.check_inputs(idx, source, kv_cache, pad_mask, token_types)
        if c.family == "encoder":
            return self.norm_f(bidirectional(self.blocks, self.positions, self.embed(idx, token_types), pad_mask))
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        limit = c.context_limit
        if limit is not None and start + T > limit:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={limit}")
        x = self.drop(self.positions.embed(self.tok_emb(idx), start))
        masks = self.masks(start, T, idx.device)
        memory = kv_cache.cross if source is None and kv_cache is not None else self.cross_inputs(source, pad_mask)
        for i, (block, kind) in enumerate(zip(self.blocks, c.layer_kinds)):
            x = block(x, self.positions, start, masks[kind], None if kv_cache is None else kv_cache.layers[i],
                      None if memory is None else memory[i])
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm_f(x)

    def check_inputs(self, idx, source, kv_cache, pad_mask=None, token_types=None):
        """One line for an input this model's family does not take."""
        c, got = self.config, lambda: f"got a {str(idx.dtype).removeprefix('torch.')} tensor of shape {tuple(idx.shape)}"
        if c.image_size and (idx.shape[1:] != (c.channels, c.image_size, c.image_size) or not idx.is_floating_point()):
            raise ValueError(f"this vision transformer takes pixels (batch, {c.channels}, {c.image_size}, {c.image_size}) as floats; {got()}")
        if not c.image_size and (idx.dim() != 2 or idx.is_floating_point()):
            raise ValueError(f"this model takes token ids (batch, tokens); {got()}" + (" (images need image_size > 0)" * (idx.dim() == 4)))
        if c.family != "encoder-decoder" and source is not None:
            raise ValueError(f"source= is an encoder-decoder's encoder input; this model is family={c.family!r}")
        if c.family == "encoder-decoder" and source is None and getattr(kv_cache, "cross", None) is None:
            raise ValueError("an encoder-decoder model needs source=(batch, tokens), the encoder's input ids")
        if c.family == "encoder" and kv_cache is not None:
            raise ValueError("an encoder reads its whole input at once: it takes no KV cache")
        encoded = idx if c.family == "encoder" else source  # what a pad_mask (and token_types) must match
        if (pad_mask is not None and (encoded is None or pad_mask.shape != encoded.shape[:2])) or (
                token_types is not None and (not c.type_vocab_size or token_types.shape != idx.shape)):
            raise ValueError(f"pad_mask is (B, T) of an encoder's input or an encoder-decoder's source, token_types (B, T) with "
                             f"type_vocab_size > 0 ({c.type_vocab_size}); got {getattr(pad_mask, 'shape', None)}, {getattr(token_types, 'shape', None)}")

    def embed(self, idx, token_types=None):
        """An encoder's input states: tokens (with their types) or a class token and an image's patches."""
        if self.config.image_size:
            x = self.patches(idx).flatten(2).transpose(1, 2)  # (B, patches, C), row by row
            x = torch.cat([self.cls_token.expand(x.size(0), -1, -1).to(x.dtype), x], dim=1)
        else:
            x = self.tok_emb(idx)
        x = self.positions.embed(self.check_length(x), 0)
        if self.type_emb is not None:
            x = x + self.type_emb(torch.zeros_like(idx) if token_types is None else token_types)
        return self.drop(x if self.emb_norm is None else self.emb_norm(x))

    def check_length(self, x):
        if x.size(1) > self.config.block_size:  # (an encoder's input, or an encoder-decoder's source)
            raise ValueError(f"sequence of {x.size(1)} tokens is longer than block_size={self.config.block_size}")
        return x

    def encode(self, source, pad_mask=None):
        """An encoder-decoder's encoder: source ids (B, S) -> its final states (B, S, C)."""
        enc = self.encoder
        x = self.drop(enc.positions.embed(self.check_length(self.tok_emb(source)), 0))
        return enc.norm_f(bidirectional(enc.blocks, enc.positions, x, pad_mask))

    def cross_inputs(self, source, pad_mask=None):
        """Each decoder block's cross-attention (keys, values, key mask), from one run of the encoder; None without a source."""
        if source is None:
            return None
        memory = self.encode(source, pad_mask)
        mask = attention.key_mask(pad_mask, source.size(1), source.device)
        return [(*block.cross.keys(memory), mask) for block in self.blocks]

    def masks(self, start, T, device):
        """Each kind's attention mask (attention/) for T queries from position start, made once for its layers."""
        dropout = self.training and self.config.dropout > 0
        return {letter: attention.layer_mask(kind, self.config, self.positions, start, T, device, dropout)
                for letter, kind in attention.kinds_of(self.config).items()}

    def new_cache(self, max_len=None, source=None, pad_mask=None):
        """An empty cache for generation, each layer's kind's (a full layer's keys for max_len positions, a
        window's ring, a linear layer's state); an encoder-decoder's also the cross-attention keys of source."""
        cache = attention.KVCache([block.attn.new_cache(max_len or self.config.block_size) for block in self.blocks])
        if self.config.family != "decoder" and source is None:
            raise ValueError("an encoder reads its whole input at once and generates nothing" if self.config.family == "encoder"
                             else "an encoder-decoder's cache starts from its source: new_cache(source=ids)")
        cache.cross = self.cross_inputs(source, pad_mask)  # the encoder runs once; its keys serve every step
        return cache

    def decode_rows(self, tokens, caches):
        """One decode step of B independent sequences, each at its own length: a server's batch.

        tokens (B, 1), caches[i] row i's cache -> logits (B, vocab). Projections, MLPs and head run once for
        the batch (the weights read once: what batching buys); attention row by row over each row's cache."""
        starts = [cache.length for cache in caches]
        limit = self.config.context_limit
        if limit is not None and max(starts) >= limit:
            raise ValueError(f"sequence of {max(starts) + 1} tokens is longer than block_size={limit}")
        x = self.tok_emb(tokens)
        x = self.drop(torch.cat([self.positions.embed(x[i : i + 1], s) for i, s in enumerate(starts)]))
        masks = [self.masks(s, 1, tokens.device) for s in starts]
        cross = self.config.family == "encoder-decoder"  # each row's source, its cache's cross-attention inputs
        for i, (block, kind) in enumerate(zip(self.blocks, self.config.layer_kinds)):
            x = block.forward_rows(x, self.positions, starts, [m[kind] for m in masks], [c.layers[i] for c in caches],
                                   [c.cross[i] for c in caches] if cross else None)
        for cache in caches:
            cache.advance(1)
        return self.lm_head(self.norm_f(x))[:, -1]

    def decode_static(self, tokens, pos, caches):
        """One decode step as a pure function of tensors, through static caches: it compiles with fullgraph.

        tokens (B, 1), row b at position pos[b] (a (B,) tensor), through each layer's StaticCache
        (caches[i]: layer i's, updated in place) -> logits (B, vocab). generate.StaticDecode runs it."""
        self.decoder_only("decode_static")
        x = self.drop(self.positions.embed_at(self.tok_emb(tokens), pos))
        for block, cache in zip(self.blocks, caches):
            x = block.forward_static(x, self.positions, pos, cache)
        return self.lm_head(self.norm_f(x))[:, -1]

    def decode_and_prefill(self, tokens, pos, caches, idx, cache, last=1):
        """decode_static's step for n rows and one prompt's chunk, in one pass over the weights.

        idx (1, T) continues what cache (a KVCache) holds -> (the rows' logits (n, vocab), idx's last `last`
        (1, last, vocab)). The n + T tokens share the norms, projections, MLPs and head, the weights read once
        for both (Sarathi-Serve's piggybacked chunks); attention splits them by their caches."""
        self.decoder_only("decode_and_prefill")
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

    def decoder_only(self, path):  # (an encoder-decoder's cross-attention is not in the static paths)
        if self.config.family != "decoder":
            raise ValueError(f"GPT.{path} runs decoder-only models; family={self.config.family!r} decodes through forward_cached")

    def forward_cached(self, idx, cache=None, last=1, source=None, pad_mask=None):
        """The one way through the cache: idx (B, T) continuing what it holds -> its last `last` logits.

        Without a cache: a whole sequence; the cache grows by T. A prefill, a decode step, a draft's check
        and its own. source (pad_mask): an encoder-decoder's source ids, when the cache has none."""
        x = self.hidden_states(idx, cache) if source is None else self.hidden_states(idx, cache, source=source, pad_mask=pad_mask)
        return self.lm_head(x[:, -last:])

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
        """Training FLOPs per token (PaLM's appendix): 6 per matmul weight, plus 12 * n_embd * (the keys a
        query meets: keys_per_query) per layer for the attention scores and their weighted sums."""
        c = self.config
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        return 6 * matmul_params + sum(12 * c.n_embd * attention.KINDS[kind].keys_per_query(c, seq_len)
                                       for kind in c.layer_kinds)

    # Hugging Face interop lives in hf.py; these two keep the names nanoGPT and transformers users type.
    # A training run's folder loads through checkpoint.load_any (checkpoint.py stands on model.py; the
    # reverse import would make a circle).
    @classmethod
    def from_pretrained(cls, name_or_dir, dropout=0.0):
        """A Hugging Face model: a directory of a class hf.py reads (GPT-2, Llama, ..., BERT, ViT, T5), or a GPT-2 name.

        gpt2 ... gpt2-xl come from the Hub (or its cache). A run's folder gets one line naming checkpoint.load_any."""
        return hf.load_pretrained(lambda keys: cls(GPTConfig(**keys, dropout=dropout)), name_or_dir)

    def save_pretrained(self, directory):
        """Writes config.json and model.safetensors that transformers loads (its Auto classes)."""
        hf.save_pretrained(self, directory)
