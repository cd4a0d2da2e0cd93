"""
Attention kinds: what a layer's queries see and what its cache keeps, behind one protocol.

Each kind is one class, registered under its letter of GPTConfig.attn_pattern in KINDS and built as
KINDS[letter](config); the rest of the code asks a kind only through this protocol (defaults in
Attention), never by its letter or class:

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
  softmax                   True when it forms softmax weights (probes.py records them through attend)
  bidirectional             True when mix, given a (B, 1, 1, keys) boolean key mask, lets every query see every
                            key it allows (an encoder's layers: GPTConfig.family='encoder'); never inherited
  exports_as                what transformers calls this attention, when it is exactly that: "full" (Llama,
                            GPT-2), "window" (Mistral), or None; never inherited (register() sets None on a
                            class that does not declare it), so a subclass that changes the math exports as nothing
  Cache                     its cache class, which says whether it can roll back (rewinds: speculative
                            decoding) and whether its size is bounded (bounded: a model whose every layer is
                            bounded runs past block_size, with relative positions); new_cache(max_len) makes one
  StaticCache               its cache for a compiled decode step (generate.StaticDecode), or None: tensors
                            preallocated for a batch whose rows each have their own position; never
                            inherited (register() sets None), as a subclass that changes mix needs its own decode_one
  static_cache(cache, length, max_len)   a StaticCache holding what the (dynamic) cache holds after a prefill
  decode_one(q, k, v, gates, pos, cache, positions)   one token per row, row b at position pos[b] (a (B,) tensor),
                            through a StaticCache: a pure function of tensors, so it compiles with fullgraph
  seq_dim                   the time axis of heads()'s outputs: 2 for (B, H, T, D), the default; what a kind
                            computes before its heads (GatedDeltaNet's convolution input, (B, T, channels)): 1
  gates(x)                  per-token extras from the block input (a forget gate, a delta rule's beta): None,
                            a tensor or a tuple of tensors with the batch first; they travel with q, k and v
  mix(q, k, v, gates, start, mask, cache, positions)   heads (B, H, T, D) of positions start.. -> outputs

Which forward path runs a kind, which cache it goes through, and who calls it (all written once, in
base.py's Attention, over the kind's mix and decode_one):

  path            tokens                                    cache                   caller
  forward         a batch at one position                   the kind's Cache, None  GPT.forward, forward_cached
  forward_rows    one token per row, each at its position   one Cache per row       GPT.decode_rows (DynamicRows)
  forward_static  one token per row, each at its position   StaticCache (rows)      GPT.decode_static (StaticDecode,
                                                                                    generate.BatchRows)
  forward_mixed   decode rows + one prompt's chunk          StaticCache + Cache     GPT.decode_and_prefill (engine.py)

The files: kernels.py (SDPA, the explicit masked softmax kept as its reference, FlexAttention for windows
and position biases on GPUs: layer_mask), base.py (Attention, make_norm, StaticRows), and one file per
family with its chunk math beside its layers: softmax.py (L, S), linear.py (R, D), delta.py (N, M); and
cross.py, an encoder-decoder's cross-attention (no kind: no cache, no causal mask). A new
family is one file plus one line in the register loop below; a kind of your own registers from your code.
"""

from dataclasses import replace

from attention.base import Attention, make_norm
from attention.cross import CrossAttention, key_mask
from attention.delta import GatedDeltaNet, GatedLinearAttention
from attention.kernels import KERNELS, attention_scores, layer_mask
from attention.linear import LinearAttention, RetentionAttention
from attention.softmax import FullAttention, SlidingWindowAttention

__all__ = [  # what the rest of the project takes from here; chunk math and kernel internals stay in their files
    "Attention", "make_norm", "KERNELS", "attention_scores", "layer_mask", "KINDS", "register", "named",
    "pattern_help", "check_pattern", "letters_exported_as", "kinds_of", "with_pattern", "KVCache",
    "FullAttention", "SlidingWindowAttention", "LinearAttention", "RetentionAttention", "GatedDeltaNet",
    "GatedLinearAttention", "CrossAttention", "key_mask",
]  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# The registry, and what the model asks of a pattern


KINDS = {}
CACHE_PROTOCOL = ("rewinds", "bounded", "rewind", "nbytes")  # what speculative decoding, generate and KVCache ask


def register(kind):
    """Adds an attention kind (an Attention subclass, its own letter) to KINDS; returns it (a decorator).

    A letter already taken is refused; exports_as is the class's own (None unless it declares one)."""
    letter = kind.letter
    if "exports_as" not in vars(kind):  # a subclass may change the math: it claims a transformers twin itself
        kind.exports_as = None
    if "StaticCache" not in vars(kind):  # and it writes its own compiled decode step
        kind.StaticCache = None
    if "bidirectional" not in vars(kind):  # and its own two-way form
        kind.bidirectional = False
    if "mask_mod" not in vars(kind) and "mask" in vars(kind):  # a mask of its own: no FlexAttention form until it writes one
        kind.mask_mod = Attention.mask_mod
    if not (isinstance(letter, str) and len(letter) == 1 and letter.isalpha()):
        raise ValueError(f"{kind.__name__}.letter={letter!r}: a kind's letter is one letter")
    missing = [name for name in CACHE_PROTOCOL if not hasattr(kind.Cache, name)] if kind.Cache else ["Cache"]
    if missing:  # checked here, so a cache without them fails when registered, not mid-generation
        raise ValueError(f"{kind.__name__}.Cache={getattr(kind.Cache, '__name__', None)} lacks {', '.join(missing)}: a kind's "
                         f"cache class declares {', '.join(CACHE_PROTOCOL)}")
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


def check_pattern(config):
    """Checks a config's attn_pattern, and the keys its kinds read, against the registry.

    ValueError (naming the key) for an attn_pattern of unknown letters, a kind's key set with no layer
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
    """The cache of every layer (layers[i]: layer i's kind's; GPT.new_cache) and the length they share.

    Each layer writes and reads its own; the model advances the length once all have written; rewind(n)
    keeps the first n positions (speculative decoding drops rejected drafts so), where every layer's kind
    of cache can."""

    def __init__(self, layers):
        self.layers = layers
        self._length = 0
        self.cross = None  # an encoder-decoder's: each layer's cross-attention (keys, values, mask), made once

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
        """Bytes the layers hold for the positions so far.

        A full-attention layer's preallocated but unwritten positions are not counted.
        """
        return sum(layer.nbytes(self._length) for layer in self.layers)
