"""
Attention kinds: what a layer's queries see and what its cache keeps. Each kind is one class, registered
under its letter of GPTConfig.attn_pattern in KINDS and built as KINDS[letter](config); the rest of the
code asks a kind only through this protocol (defaults in Attention), never by its letter or class:

  letter, description       its letter, and a few words for --help and the error on an unknown letter
  config_keys               GPTConfig keys only this kind reads (S: attn_window): set with no such layer, refused
  check(config)             ValueError for what this kind cannot run (a position scheme, a RoPE scaling)
  mask(config, positions, start, T, device)   what the kind's layers need for T queries from position start,
                            made once per forward and shared by them: None (every key up to the query's own,
                            the queries being the last T keys), a boolean (T, keys) tensor, or an additive
                            (n_head, T, keys) bias holding -inf where a key is hidden (ALiBi, T5)
  mask_mod(config)          the same mask as FlexAttention's mask_mod(b, h, q_idx, kv_idx) for queries and
                            keys from position 0, or None (no FlexAttention form): layer_mask uses it on GPUs
  keys_per_query(config, seq_len)   how many keys a query meets: FLOPs and MFU (GPT.flops_per_token)
  softmax                   True when it forms softmax weights (interpret.py records them through attend)
  exports_as                what transformers calls this attention, when it is exactly that: "full" (Llama,
                            GPT-2), "window" (Mistral), or None; never inherited (register() sets None on a
                            class that does not declare it), so a subclass that changes the math exports as nothing
  Cache                     its cache class, which says whether it can roll back (rewinds: speculative
                            decoding) and whether its size is bounded (bounded: a model whose every layer is
                            bounded runs past block_size, with relative positions); new_cache(max_len) makes one
  StaticCache               its cache for a compiled decode step (generate.StaticDecode), or None: tensors
                            preallocated for a batch whose rows each have their own position; never
                            inherited (register() sets None), as a subclass that changes mix needs its own step
  static_cache(cache, length, max_len)   a StaticCache holding what the (dynamic) cache holds after a prefill
  step(q, k, v, gates, pos, cache, positions)   one token per row, row b at position pos[b] (a (B,) tensor),
                            through a StaticCache: a pure function of tensors, so it compiles with fullgraph
  seq_dim                   the time axis of heads()'s outputs: 2 for (B, H, T, D), the default; what a kind
                            computes before its heads (GatedDeltaNet's convolution input, (B, T, channels)): 1
  gates(x)                  per-token extras from the block input (a forget gate, a delta rule's beta): None,
                            a tensor or a tuple of tensors with the batch first; they travel with q, k and v
  mix(q, k, v, gates, start, mask, cache, positions)   heads (B, H, T, D) of positions start.. -> outputs

Attention.forward runs the batch at one position; forward_rows runs decode rows each at its own position
(GPT.decode_rows), and forward_mixed decode rows and a prompt's chunk together (GPT.decode_and_prefill),
written once for every kind. Caches update their own state. The softmax kernels
(attn_impl: KERNELS) are here too: SDPA, and the explicit masked softmax kept as its reference, and
FlexAttention for windows and position biases on GPUs (layer_mask).
"""

import functools
import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------
# Softmax kernels


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
    if isinstance(mask, FlexMask):  # (interpret.recording and the explicit kernel take the dense form)
        mask = mask.dense()
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def attention_explicit(q, k, v, mask, dropout_p=0.0):
    """The textbook path, kept as the reference that SDPA is tested against."""
    scores = attention_scores(q, k, mask)
    weights = F.dropout(F.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout_p)
    return weights @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)


def attention_sdpa(q, k, v, mask, dropout_p=0.0):
    if isinstance(mask, FlexMask):
        return attention_flex(q, k, v, mask)
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


KERNELS = {"sdpa": attention_sdpa, "explicit": attention_explicit}  # GPTConfig.attn_impl


# FlexAttention (Dong et al. 2024). SDPA's flash kernel takes no mask: a window's band or ALiBi's and T5's
# bias sends it to the mem-efficient or math kernel over the whole T x T square (T5 also makes its bias's
# gradient there). FlexAttention skips the tiles no query sees and computes the bias inside the kernel.
# It is fast only compiled, and each shape compiles apart, so it runs where training does: a forward with
# gradients at T = block_size from position 0, no attention dropout, heads of 16 or more (its CUDA kernel's
# least) and Triton installed. Evaluation, prefills and decoding keep SDPA with the dense mask, so a
# sample or a server never waits for a compile.
FLEX_DEVICES = ("cuda",)  # torch 2.13 has no FlexAttention backward on CPU (tests add "cpu" for the forward)
BLOCK_MASKS = {}  # (letter, the kind's config keys' values, T, device) -> its BlockMask, made once


class FlexMask:
    """A layer mask in FlexAttention's form: a block mask and the position scheme's score_mod (or None);
    dense() makes the tensor mask, for the kernels that take one."""

    def __init__(self, block_mask, score_mod, dense):
        self.block_mask, self.score_mod, self.dense = block_mask, score_mod, dense


@functools.cache
def flex_kernel():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attention_flex(q, k, v, mask):
    if torch.compiler.is_compiling():  # inside a compiled model: its graph fuses the kernel
        from torch.nn.attention.flex_attention import flex_attention as kernel
    else:
        kernel = flex_kernel()
    return kernel(q, k, v, score_mod=mask.score_mod, block_mask=mask.block_mask, enable_gqa=q.size(1) != k.size(1))


def layer_mask(kind, config, positions, start, T, device, dropout):
    """kind.mask, or its FlexAttention form where that pays: on FLEX_DEVICES, the SDPA kernel, a forward
    with gradients of T = block_size queries from position 0, no attention dropout, heads of 16 or more,
    and a mask SDPA's flash kernel cannot take (a window narrower than T, or a bias)."""
    mask_mod = kind.mask_mod(config) if kind.softmax else None
    if (mask_mod is None or torch.device(device).type not in FLEX_DEVICES or config.attn_impl != "sdpa"
            or start != 0 or T != config.block_size or dropout or not torch.is_grad_enabled()
            or config.n_embd // config.n_head < 16):
        return kind.mask(config, positions, start, T, device)
    score_mod = positions.score_mod(T)
    if score_mod is None and kind.keys_per_query(config, T) >= T:  # causal alone: SDPA's flash kernel
        return kind.mask(config, positions, start, T, device)
    return flex_mask(kind, config, positions, T, device, mask_mod, score_mod)


@functools.cache
def flex_available(device_type):
    """FlexAttention compiles to Triton on GPUs; CPU tests run its forward without it."""
    if device_type == "cpu":
        return True
    from torch.utils._triton import has_triton

    return has_triton()


def has_score_mod(positions):
    """Whether the scheme's score_mod is written for its own attn_bias (a subclass that changes attn_bias
    and inherits score_mod would have flex add the wrong bias, so it keeps the dense mask)."""
    mro = type(positions).__mro__
    defines = lambda name: next(i for i, cls in enumerate(mro) if name in vars(cls))  # noqa: E731
    return defines("score_mod") <= defines("attn_bias")


def outside_compiled_graphs(fn):
    """torch.compiler.disable(fn), made at fn's first call (like torch's own _disable_dynamo, though dynamo
    traces this wrapper: on a first call inside a compile the graph breaks here, at the same place): the
    decorator imports torch._dynamo, 2 s that every command line paid at start-up though only a compiled run
    (or FlexAttention's compiled kernel) needs it."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        disabled = getattr(fn, "outside_graphs", None)
        if disabled is None:
            disabled = fn.outside_graphs = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return call


@outside_compiled_graphs  # once per forward, each block mask once per shape
def flex_mask(kind, config, positions, T, device, mask_mod, score_mod):
    if not flex_available(torch.device(device).type) or not has_score_mod(positions):
        return kind.mask(config, positions, 0, T, device)
    key = (kind.letter, *(getattr(config, name) for name in kind.config_keys), T, str(device))
    if key not in BLOCK_MASKS:
        from torch.nn.attention.flex_attention import create_block_mask

        BLOCK_MASKS[key] = create_block_mask(mask_mod, None, None, T, T, device=device)
    return FlexMask(BLOCK_MASKS[key], score_mod, lambda: kind.mask(config, positions, 0, T, device))


# ----------------------------------------------------------------------------------------------------
# The protocol, and what every kind shares: one q/k/v projection, optional QK-norm, the output projection


def make_norm(config, dim):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class Attention(nn.Module):
    letter = None
    description = ""
    config_keys = ()
    softmax = False
    exports_as = None
    Cache = None
    StaticCache = None
    seq_dim = 2  # the time axis of what heads() returns: (B, H, T, D)

    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        # one matmul for queries, keys and values (Llama's q/k/v projections are concatenated on load)
        self.qkv = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else nn.Identity()
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    @classmethod
    def check(cls, config):
        pass

    @classmethod
    def mask(cls, config, positions, start, T, device):
        """Every key up to the query's own, with the position scheme's bias (ALiBi, T5) if it has one."""
        return positions.attn_bias(start, T, 0, start + T)

    @classmethod
    def keys_per_query(cls, config, seq_len):
        return seq_len

    @classmethod
    def mask_mod(cls, config):
        return None

    def new_cache(self, max_len):
        return self.Cache()

    def gates(self, x):
        return None

    def mix(self, q, k, v, gates, start, mask, cache, positions):
        raise NotImplementedError

    def forward(self, x, positions, start, mask, cache):
        """x (B, T, C) at positions start.., through cache (or None) -> the layer's output (B, T, C)."""
        q, k, v = self.heads(x)
        return self.out(self.mix(q, k, v, self.gates(x), start, mask, cache, positions))

    def forward_rows(self, x, positions, starts, masks, caches):
        """x (B, 1, C): row i is one token of its own sequence, at position starts[i], with masks[i] and
        caches[i]. The projections run once for the batch; mixing runs row by row."""
        q, k, v = self.heads(x)
        gates = self.gates(x)
        rows = [self.mix(q[i : i + 1], k[i : i + 1], v[i : i + 1], row_of(gates, i), start, mask, cache, positions)
                for i, (start, mask, cache) in enumerate(zip(starts, masks, caches))]  # fmt: skip
        return self.out(torch.cat(rows))

    def forward_static(self, x, positions, pos, cache):
        """x (B, 1, C): row b one token at position pos[b], through a StaticCache (GPT.decode_static)."""
        q, k, v = self.heads(x)
        return self.out(self.step(q, k, v, self.gates(x), pos, cache, positions))

    def forward_mixed(self, x, n, positions, pos, static, start, mask, cache):
        """x (n + T, 1, C), one token per row: rows :n decoded tokens of their own sequences at positions pos,
        through the StaticCache `static` (forward_static's way), rows n: the next T tokens of one sequence
        from position start, through its cache (forward's way). The projections run once for all n + T
        tokens (GPT.decode_and_prefill); step and mix each take their part."""
        q, k, v = self.heads(x)
        gates = self.gates(x)
        rows = self.step(*each((q, k, v), lambda t: t[:n]), each(gates, lambda t: t[:n]), pos, static, positions)
        seq = self.mix(*each((q, k, v), lambda t: t[n:].transpose(0, self.seq_dim)),
                       each(gates, lambda t: t[n:].transpose(0, 1)), start, mask, cache, positions)
        return self.out(torch.cat([rows, seq.transpose(0, 2)]))

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


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def each(x, f):
    """f applied to x, a tensor, or to each tensor of a tuple (None left as it is): heads' and gates' outputs."""
    if isinstance(x, tuple):
        return tuple(each(t, f) for t in x)
    return None if x is None else f(x)


def row_of(gates, i):
    if gates is None:
        return None
    return tuple(g[i : i + 1] for g in gates) if isinstance(gates, tuple) else gates[i : i + 1]


# ----------------------------------------------------------------------------------------------------
# Softmax attention: over every earlier key (L), or over the last attn_window positions (S)


class FullKV:
    """A full-attention layer's keys and values, preallocated for max_len positions on the first write
    (which also fixes their dtype: the dtype the model computes in, autocast included)."""

    rewinds = True  # positions from n on are overwritten by the next writes
    bounded = False

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
        pass

    def nbytes(self, length):
        return 0 if self.k is None else 2 * self.k[:, :, :length].numel() * self.k.element_size()


class StaticRows:
    """What every StaticCache shares: its tensors (`fields`, the batch first) as rows a server's batch can
    take a view of, fill, move and allocate (engine.BatchRows)."""

    fields = ()

    def rows(self, n, length=None):
        """The first n rows, as views (a full layer's first `length` positions): a step over them writes
        into this cache."""
        return type(self)(*(getattr(self, name)[:n] for name in self.fields))

    def put(self, row, other):
        """Row `row` := the one row of other (a cache of the same capacity)."""
        for name in self.fields:
            getattr(self, name)[row] = getattr(other, name)[0]

    def move(self, src, dst):
        for name in self.fields:
            tensor = getattr(self, name)
            tensor[dst] = tensor[src]

    @classmethod
    def batch(cls, template, rows):
        """An empty cache of `rows` rows shaped as template's one."""
        return cls(*(getattr(template, name).new_zeros(rows, *getattr(template, name).shape[1:]) for name in cls.fields))

    def grow(self, max_len):
        """Room for max_len positions per row: a cache whose size is not the length's is itself."""
        return self


class StaticKV(StaticRows):
    """A full layer's keys and values for a compiled decode step: (B, H, max_len, D) from the start, row b
    written at its own position; key_pos (B, max_len) is each slot's position. grow() makes room for
    longer rows (a server's batch grows its caches with its longest row)."""

    fields = ("k", "v")

    def __init__(self, k, v):
        B, _, max_len, _ = k.shape
        self.k, self.v = k, v
        self.key_pos = torch.arange(max_len, device=k.device).expand(B, max_len)

    def write(self, pos, k, v):
        rows = torch.arange(k.size(0), device=k.device)
        self.k[rows, :, pos] = k[:, :, 0]
        self.v[rows, :, pos] = v[:, :, 0]

    def rows(self, n, length=None):
        return type(self)(self.k[:n, :, :length], self.v[:n, :, :length])

    def grow(self, max_len):
        B, H, length, D = self.k.shape
        k, v = self.k.new_zeros(B, H, max_len, D), self.v.new_zeros(B, H, max_len, D)
        k[:, :, :length], v[:, :, :length] = self.k, self.v
        return type(self)(k, v)


class FullAttention(Attention):
    """Softmax attention over every earlier key."""

    letter, description = "L", "full attention"
    softmax, exports_as = True, "full"
    Cache, StaticCache = FullKV, StaticKV
    window = None

    def __init__(self, config):
        super().__init__(config)
        self.attend = KERNELS[config.attn_impl]

    def new_cache(self, max_len):
        return self.Cache(max_len)

    @classmethod
    def mask_mod(cls, config):
        return causal

    def mix(self, q, k, v, gates, start, mask, cache, positions):
        q, k = positions.rotate(q, k, start)
        if cache is not None:
            k, v = cache.update(start, k, v)
        return self.attend(q, k, v, mask, self.dropout if self.training else 0.0)

    def static_cache(self, cache, length, max_len):
        return self.StaticCache(cache.k[:, :, :length], cache.v[:, :, :length]).grow(max_len)

    def step(self, q, k, v, gates, pos, cache, positions):
        """Every slot of the static cache, those after a row's position (or empty) masked off."""
        q, k = positions.rotate_at(q, k, pos)
        cache.write(pos, k, v)
        seen = ((cache.key_pos >= 0) & (cache.key_pos <= pos[:, None]))[:, None, None]  # (B, 1, 1, K): the bias's -inf
        bias = positions.bias_at(pos, cache.key_pos)
        return self.attend(q, cache.k, cache.v, seen if bias is None else bias.masked_fill(~seen, float("-inf")), 0.0)


class WindowKV:
    """A sliding-window layer's keys and values: a rolling buffer of what the next query can see (the
    window - 1 positions before it), plus the last write's positions, into which speculative decoding may
    roll back. Its size is bounded by the window, however long the text grows."""

    rewinds = True  # into the last write; further back is refused
    bounded = True

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


class StaticWindowKV(StaticRows):
    """A sliding-window layer's keys and values for a compiled decode step: a ring of `window` slots per
    row, position p in slot p % window; key_pos is each slot's position (-1: empty)."""

    fields = ("k", "v", "key_pos")

    def __init__(self, k, v, key_pos):
        self.k, self.v, self.key_pos = k, v, key_pos

    def write(self, pos, k, v):
        rows, slot = torch.arange(k.size(0), device=k.device), pos % self.k.size(2)
        self.k[rows, :, slot] = k[:, :, 0]
        self.v[rows, :, slot] = v[:, :, 0]
        self.key_pos[rows, slot] = pos


class SlidingWindowAttention(FullAttention):
    """Softmax attention over the last attn_window positions (the query's own included); its cache keeps
    only those."""

    letter, description = "S", "sliding window"
    config_keys = ("attn_window",)
    exports_as = "window"
    Cache, StaticCache = WindowKV, StaticWindowKV

    def __init__(self, config):
        super().__init__(config)
        self.window = config.attn_window

    @classmethod
    def check(cls, config):
        if config.attn_window is None:
            raise ValueError(f"GPTConfig.attn_pattern={config.attn_pattern!r} has sliding-window layers ({cls.letter}): "
                             "set attn_window, the tokens each query sees (itself included)")
        if config.attn_window < 1:
            raise ValueError(f"GPTConfig.attn_window={config.attn_window} must be a positive integer")

    @classmethod
    def mask(cls, config, positions, start, T, device):
        """Keys from start - window + 1 on (what the cache keeps), hiding those out of a query's window."""
        window = config.attn_window
        k_start = max(0, start - window + 1)
        mask = positions.attn_bias(start, T, k_start, start + T - k_start)
        if start + T - k_start > window:  # some key is out of some query's window
            seen = visible(start, T, k_start, start + T - k_start, window, device)
            mask = seen if mask is None else mask.masked_fill(~seen, float("-inf"))
        return mask

    @classmethod
    def keys_per_query(cls, config, seq_len):
        return min(seq_len, config.attn_window)

    @classmethod
    def mask_mod(cls, config):
        window = config.attn_window

        def sliding(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return sliding

    def new_cache(self, max_len):
        return self.Cache(self.window)

    def static_cache(self, cache, length, max_len):
        """The window - 1 positions before `length` (what the next query sees besides itself), in their slots."""
        B, H, _, D = cache.k.shape
        k, v = cache.k.new_zeros(B, H, self.window, D), cache.v.new_zeros(B, H, self.window, D)
        key_pos = torch.full((B, self.window), -1, dtype=torch.long, device=cache.k.device)
        for p in range(max(cache.first, length - self.window + 1), length):
            k[:, :, p % self.window], v[:, :, p % self.window] = cache.k[:, :, p - cache.first], cache.v[:, :, p - cache.first]
            key_pos[:, p % self.window] = p
        return self.StaticCache(k, v, key_pos)


# ----------------------------------------------------------------------------------------------------
# Causal linear attention (R)


class LinearState:
    """A linear-attention layer's cache: its running sums (S, z) over every position so far, in fp32, the
    same size at any length. A sum cannot give back what it added: rolling back is refused."""

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
    """Causal linear attention (Katharopoulos et al. 2020): softmax(q.k) replaced by phi(q).phi(k) with
    phi = elu + 1 > 0, so the sum over earlier keys is a running one. Per head:

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

    def step(self, q, k, v, gates, pos, cache, positions):
        """The recurrence of linear_attention_chunk's decoded token, its sums updated in place."""
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = self.features(q, k, v)
            rq, rk = positions.rotate_at(q, k, pos)
            y, (S, z) = linear_attention_chunk(q, k, rq, rk, v.float(), (cache.S, cache.z))
            cache.S.copy_(S)
            cache.z.copy_(z)
        return y.to(v.dtype)


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


class StaticDecayState(StaticRows):
    """A decaying linear layer's state for a compiled decode step, updated in place."""

    fields = ("S",)

    def __init__(self, S):
        self.S = S


class RetentionAttention(LinearAttention):
    """Linear attention that forgets at a fixed rate per head: RetNet's retention (Sun et al. 2023). Per
    head h, with gamma_h = 1 - 2^(-5 - h) (RetNet's: the state's memory spans about 32, 64, ... tokens),

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

    def step(self, q, k, v, gates, pos, cache, positions):
        dtype = v.dtype
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = self.features(q, k, v)
            q, k = positions.rotate_at(q, k, pos)
            y, S = decay_chunk(q, k, v, self.decays(q), cache.S)
            cache.S.copy_(S)
            y = self.out_norm(y)
        return y.to(dtype)


def chunk_decays(g):
    """(c, decay) of a chunk's log gates g (B, H, T): c their cumulative sum from the chunk's start, decay
    (B, H, T, T) e^{c_t - c_j} where j <= t and 0 above (the causal mask)."""
    T = g.size(-1)
    c = g.cumsum(-1)
    causal_mask = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
    return c, (c[..., :, None] - c[..., None, :]).masked_fill(~causal_mask, float("-inf")).exp()


def decay_chunk(q, k, v, g, state):
    """Linear attention that forgets, over one chunk (B, H, T, D) after `state` S (B, H, D, D), or None at
    the start; g (B, H, T) each token's log decay (<= 0: retention's is a constant per head, a gated
    layer's comes from its input). With c_t the cumulative g from the chunk's start, per token
    S_t = e^{g_t} S_{t-1} + k_t^T v_t and y_t = q_t S_t, so
    y_t = sum_{j<=t in the chunk} e^{c_t - c_j} (q_t . k_j) v_j + e^{c_t} q_t S,
    S' = e^{c_T} S + sum_j e^{c_T - c_j} k_j^T v_j. Returns the outputs and the state after the chunk."""
    c, decay = chunk_decays(g)
    y = ((q @ k.transpose(-2, -1)) * decay) @ v
    S = (k * (c[..., -1:] - c).exp()[..., None]).transpose(-2, -1) @ v
    if state is not None:
        y = y + (q * c.exp()[..., None]) @ state
        S = S + c[..., -1, None, None].exp() * state
    return y, S


def gated_delta_chunk(q, k, v, g, beta, state):
    """The gated delta rule (Yang et al. 2024, Gated DeltaNet; Qwen3-Next's linear layers) over one chunk:
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
    """The gated delta rule layer as Qwen3-Next has it (Yang et al. 2024, Gated DeltaNet): per head a
    state S (Dk x Dv) forgotten by a_t = e^{g_t} and corrected toward each value for its key with strength
    beta_t (gated_delta_chunk), read by the query. From the block input: q, k (n_kv_head heads) and v
    (n_head heads; queries and keys are repeated for them, Qwen3-Next's grouped value heads) through a
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
        """The causal depthwise convolution over (B, T, channels) after the previous conv_kernel - 1 inputs
        (None: zeros), with SiLU; returns (the output, the last conv_kernel - 1 inputs)."""
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

    def step(self, q, k, v, gates, pos, cache, positions):
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
    """Linear attention with a data-dependent decay: Mamba-2's scalar form of the forget gate (Dao and Gu
    2024; GLA's, Yang et al. 2023, with one gate per head instead of one per key channel). Per head,
    S_t = a_t S_{t-1} + k_t^T v_t and y_t = q_t S_t, with a_t = e^{g_t}, g = -exp(A_log) softplus(a + dt_bias)
    computed from the block input: the gated delta rule's layer (its convolution, L2-normalised q and k,
    output norm and SiLU gate, grouped value heads, no positions) without the delta rule's correction, so
    it adds where N overwrites. Chunks of 64 (decay_chunk), the recurrence while decoding, the state and the
    convolution's last inputs as its cache."""

    letter, description = "M", "linear attention with a data-dependent decay (Mamba-2's, GLA's scalar gate)"
    StaticCache = StaticDeltaState  # (its step is N's, through its own core)

    def __init__(self, config):
        super().__init__(config)
        self.ba = nn.Linear(config.n_embd, self.n_head, bias=config.bias)  # the decay's logits alone: no beta

    def gates(self, x):
        g = -self.A_log.float().exp() * F.softplus(self.ba(x).float() + self.dt_bias.float())
        return self.z(x), None, g

    def core(self, q, k, v, g, beta, state):
        return decay_chunk(q, k, v, g, state)


# ----------------------------------------------------------------------------------------------------
# The registry, and what the model asks of a pattern


KINDS = {}


def register(kind):
    """Adds an attention kind (an Attention subclass with its own letter) to KINDS; returns it, so it can
    decorate the class. A letter already taken is refused; exports_as is the class's own (None unless it
    declares one)."""
    letter = kind.letter
    if "exports_as" not in vars(kind):  # a subclass may change the math: it claims a transformers twin itself
        kind.exports_as = None
    if "StaticCache" not in vars(kind):  # and it writes its own compiled decode step
        kind.StaticCache = None
    if "mask_mod" not in vars(kind) and "mask" in vars(kind):  # a mask of its own: no FlexAttention form until it writes one
        kind.mask_mod = Attention.mask_mod
    if not (isinstance(letter, str) and len(letter) == 1 and letter.isalpha()):
        raise ValueError(f"{kind.__name__}.letter={letter!r}: a kind's letter is one letter")
    if KINDS.get(letter, kind) is not kind:
        raise ValueError(f"attention kind {letter!r} is taken by {KINDS[letter].__name__}")
    KINDS[letter] = kind
    return kind


for _kind in (FullAttention, SlidingWindowAttention, LinearAttention, RetentionAttention, GatedDeltaNet, GatedLinearAttention):
    register(_kind)


def named(letters):
    """'L (full attention), S (sliding window)': letters with their kinds' descriptions."""
    return ", ".join(f"{letter} ({KINDS[letter].description})" for letter in letters)


def pattern_help():
    """--help's text for attn_pattern."""
    kinds = ", ".join(f"{letter} {kind.description}" for letter, kind in KINDS.items())
    return f"a letter per layer, tiled: {kinds}"


def check(config):
    """ValueError (naming the key) for an attn_pattern of unknown letters, a kind's key set with no layer
    of that kind, or what a kind in the pattern refuses."""
    pattern = config.attn_pattern
    unknown = sorted(set(pattern) - set(KINDS))
    if not pattern or unknown:
        raise ValueError(f"GPTConfig.attn_pattern={pattern!r}: each letter must be one of {named(KINDS)}"
                         f"{'; got ' + repr(unknown[0]) if unknown else ''}")
    for key in dict.fromkeys(key for kind in KINDS.values() for key in kind.config_keys):
        users = "/".join(letter for letter, kind in KINDS.items() if key in kind.config_keys)
        if getattr(config, key) is not None and not any(key in KINDS[letter].config_keys for letter in pattern):
            raise ValueError(f"GPTConfig.{key}={getattr(config, key)} is set but attn_pattern={pattern!r} has no "
                             f"{users} layer to use it: add {users} to the pattern or leave {key} unset")
    for letter in dict.fromkeys(pattern):
        KINDS[letter].check(config)


def letters_exported_as(name):
    """The letters whose kind is exactly transformers' attention `name` ("full", "window")."""
    return [letter for letter, kind in KINDS.items() if kind.exports_as == name]


def kinds_of(config):
    """The kinds of the config's layers, each once, in pattern order: {letter: class}."""
    return {letter: KINDS[letter] for letter in dict.fromkeys(config.layer_kinds)}


def with_pattern(config, pattern):
    """config with another attn_pattern; keys that only kinds outside it read are unset (bench.py)."""
    kept = {key for letter in pattern if letter in KINDS for key in KINDS[letter].config_keys}
    unset = {key: None for kind in KINDS.values() for key in kind.config_keys if key not in kept}
    return replace(config, attn_pattern=pattern, **unset)


class KVCache:
    """The cache of every layer (layers[i]: the cache layer i's kind made; GPT.new_cache) and the length
    they share. Each layer writes and reads its own; the model advances the length once all have written;
    rewind(n) keeps the first n positions (speculative decoding drops rejected drafts so), where every
    layer's kind of cache can."""

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
