"""
What every attention kind shares: the Attention module and StaticRows.

The Attention module (one q/k/v projection, optional QK-norm, the output projection; forward,
forward_rows, forward_static and forward_mixed written once for every kind over its mix and
decode_one), and StaticRows, what every StaticCache shares.
"""

import torch
import torch.nn as nn


def make_norm(config, dim):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class Attention(nn.Module):
    letter = None
    description = ""
    config_keys = ()
    softmax = False
    bidirectional = False
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
        return self.out(self.mix(q, k, v, self.gates(x), start, mask, cache, positions), x)

    def forward_rows(self, x, positions, starts, masks, caches):
        """One decode token per row, each row at its own position, with its own mask and cache.

        x (B, 1, C): row i is one token of its own sequence, at position starts[i], with masks[i] and
        caches[i]. The projections run once for the batch; mixing runs row by row."""
        q, k, v = self.heads(x)
        gates = self.gates(x)
        rows = [self.mix(q[i : i + 1], k[i : i + 1], v[i : i + 1], row_of(gates, i), start, mask, cache, positions)
                for i, (start, mask, cache) in enumerate(zip(starts, masks, caches))]  # fmt: skip
        return self.out(torch.cat(rows), x)

    def forward_static(self, x, positions, pos, cache):
        """x (B, 1, C): row b one token at position pos[b], through a StaticCache (GPT.decode_static)."""
        q, k, v = self.heads(x)
        return self.out(self.decode_one(q, k, v, self.gates(x), pos, cache, positions), x)

    def forward_mixed(self, x, n, positions, pos, static, start, mask, cache):
        """Decoded rows and one prompt's chunk in one pass (GPT.decode_and_prefill).

        x (n + T, 1, C), one token per row: rows :n decoded tokens of their own sequences at positions pos,
        through the StaticCache `static` (forward_static's way), rows n: the next T tokens of one sequence
        from position start, through its cache (forward's way). The projections run once for all n + T
        tokens (GPT.decode_and_prefill); decode_one and mix each take their part."""
        q, k, v = self.heads(x)
        gates = self.gates(x)
        rows = self.decode_one(*each((q, k, v), lambda t: t[:n]), each(gates, lambda t: t[:n]), pos, static, positions)
        seq = self.mix(*each((q, k, v), lambda t: t[n:].transpose(0, self.seq_dim)),
                       each(gates, lambda t: t[n:].transpose(0, 1)), start, mask, cache, positions)
        return self.out(torch.cat([rows, seq.transpose(0, 2)]), x)

    def heads(self, x):
        """x (B, T, C) -> queries (B, n_head, T, D), keys and values (B, n_kv_head, T, D)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(
            [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim], dim=-1
        )
        q = self.q_norm(q.view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        return q, k, v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)

    def out(self, y, x):
        """The heads' outputs y (B, n_head, T, D) for the block input x (B, T, C) -> the layer's output (B, T, C).

        A kind whose mix or decode_one returns another shape fails here, naming itself, not deep inside a kernel.
        """
        B, T, _ = x.shape
        if y.shape != (B, self.n_head, T, self.head_dim):
            raise ValueError(f"attention kind {self.letter} ({type(self).__name__}): mix/decode_one returned {tuple(y.shape)}; "
                             f"the protocol wants (batch, n_head, tokens, head_dim) = {(B, self.n_head, T, self.head_dim)}")
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)))


def each(x, f):
    """f applied to x, a tensor, or to each tensor of a tuple (None left as it is): heads' and gates' outputs."""
    if isinstance(x, tuple):
        return tuple(each(t, f) for t in x)
    return None if x is None else f(x)


def row_of(gates, i):
    if gates is None:
        return None
    return tuple(g[i : i + 1] for g in gates) if isinstance(gates, tuple) else gates[i : i + 1]


class StaticRows:
    """What every StaticCache shares: its tensors (`fields`, the batch first) as rows of a batch.

    A server's batch (generate.BatchRows) takes views of the rows, fills, moves and allocates them."""

    fields = ()

    def rows(self, n, length=None):
        """The first n rows, as views (a full layer's first `length` positions).

        A step over them writes into this cache."""
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
