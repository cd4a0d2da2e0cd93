"""
Softmax attention: over every earlier key (L), or over the last attn_window positions (S).

Each with its cache (FullKV, WindowKV) and its compiled decode step's (StaticKV, StaticWindowKV).
"""

import torch

from attention.base import Attention, StaticRows
from attention.kernels import KERNELS, visible


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class FullKV:
    """A full-attention layer's keys and values, preallocated for max_len positions on the first write.

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


class StaticKV(StaticRows):
    """A full layer's keys and values for a compiled decode step, each row at its own position.

    (B, H, max_len, D) from the start, row b written at its own position; key_pos (B, max_len) is each
    slot's position. grow() makes room for longer rows (a server's batch grows its caches with its
    longest row)."""

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
    softmax, exports_as, bidirectional = True, "full", True
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

    def decode_one(self, q, k, v, gates, pos, cache, positions):
        """Every slot of the static cache, those after a row's position (or empty) masked off."""
        q, k = positions.rotate_at(q, k, pos)
        cache.write(pos, k, v)
        seen = ((cache.key_pos >= 0) & (cache.key_pos <= pos[:, None]))[:, None, None]  # (B, 1, 1, K): the bias's -inf
        bias = positions.bias_at(pos, cache.key_pos)
        return self.attend(q, cache.k, cache.v, seen if bias is None else bias.masked_fill(~seen, float("-inf")), 0.0)


class WindowKV:
    """A sliding-window layer's keys and values: a rolling buffer, bounded by the window.

    A rolling buffer of what the next query can see (the window - 1 positions before it), plus the last
    write's positions, into which speculative decoding may roll back. Its size is bounded by the window,
    however long the text grows."""

    rewinds = True  # into the last write; further back is refused
    bounded = True

    def __init__(self, window):
        self.window, self.k, self.v, self.first = window, None, None, 0  # first: position of self.k[:, :, 0]

    def update(self, start, k, v):
        """Adds k, v at positions start.. and returns all the keys and values these queries can see.

        They run from max(0, start - window + 1) on: all that these queries can see."""
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
    """A sliding-window layer's keys and values for a compiled decode step: a ring per row.

    A ring of `window` slots per row, position p in slot p % window; key_pos is each slot's position
    (-1: empty)."""

    fields = ("k", "v", "key_pos")

    def __init__(self, k, v, key_pos):
        self.k, self.v, self.key_pos = k, v, key_pos

    def write(self, pos, k, v):
        rows, slot = torch.arange(k.size(0), device=k.device), pos % self.k.size(2)
        self.k[rows, :, slot] = k[:, :, 0]
        self.v[rows, :, slot] = v[:, :, 0]
        self.key_pos[rows, slot] = pos


class SlidingWindowAttention(FullAttention):
    """Softmax attention over the last attn_window positions (the query's own included).

    Its cache keeps only those."""

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
