"""
Position schemes: how a GPT knows where a token is. Each is one small module chosen by GPTConfig.pos_emb
(the registry POSITIONS); the model calls all three hooks, and the base class makes each a no-op, so no
scheme needs a branch anywhere else:
  embed(x, start):              token embeddings of positions start.. -> with absolute positions added
  rotate(q, k, start):          queries and keys -> rotated (RoPE)
  attn_bias(start, T, k_start, k_len, causal=True):  an additive (n_head, T, k_len) bias for queries at
                                 start.. and keys at k_start.., with -inf on keys after a query (the causal
                                 mask; causal=False: an encoder's two-way bias, nothing hidden), or None
  score_mod(T):                 the same bias as FlexAttention's score_mod(score, b, h, q_idx, kv_idx), for
                                 T queries and keys from position 0 (the mask hides later keys), or None
and, for a compiled decode step where each row has its own position (a tensor pos of shape (B,)):
  embed_at(x, pos), rotate_at(q, k, pos), bias_at(pos, key_pos): the same for one token per row, the bias
                                 (B, n_head, 1, K) for keys at key_pos (B, K) (the caller hides later and
                                 empty (-1) keys, whatever bias they get)
Absolute: learned (GPT-2), sinusoidal (Vaswani et al.). Relative: rope (Su et al., with linear or YaRN
scaling for contexts past the trained one), alibi (Press et al.), t5 (Raffel et al.), none (NoPE).
"""

import math

import torch
import torch.nn as nn


class NoPositions(nn.Module):
    """No positional information at all (NoPE): the causal mask alone tells tokens apart."""

    def __init__(self, config):
        super().__init__()

    def embed(self, x, start):
        return x

    def rotate(self, q, k, start):
        return q, k

    def attn_bias(self, start, T, k_start, k_len, causal=True):
        return None

    def score_mod(self, T):
        return None

    def embed_at(self, x, pos):
        return x

    def rotate_at(self, q, k, pos):
        return q, k

    def bias_at(self, pos, key_pos):
        return None


class LearnedPositions(NoPositions):
    """GPT-2: a trained vector per absolute position."""

    def __init__(self, config):
        super().__init__(config)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def embed(self, x, start):
        return x + self.wpe.weight[start : start + x.size(1)]

    def embed_at(self, x, pos):
        return x + self.wpe.weight[pos][:, None]


class SinusoidalPositions(NoPositions):
    """Vaswani et al. (2017): fixed sines and cosines of geometrically spaced frequencies, times one
    learned scalar initialised to n_embd^-0.5 (Hua et al. 2022's scaled sinusoidal): unscaled, the table's
    entries (RMS 0.71) would drown token embeddings initialised at std 0.02."""

    def __init__(self, config):
        super().__init__(config)
        pos = torch.arange(config.block_size, dtype=torch.float32)[:, None]
        inv_freq = torch.exp(-math.log(10000.0) * torch.arange(0, config.n_embd, 2) / config.n_embd)
        table = torch.zeros(config.block_size, config.n_embd)
        table[:, 0::2] = torch.sin(pos * inv_freq)
        table[:, 1::2] = torch.cos(pos * inv_freq)
        self.register_buffer("table", table, persistent=False)
        self.scale = nn.Parameter(torch.full((1,), config.n_embd**-0.5))

    def embed(self, x, start):
        return x + self.scale * self.table[start : start + x.size(1)].to(x.dtype)

    def embed_at(self, x, pos):
        return x + self.scale * self.table[pos][:, None].to(x.dtype)


class RotaryPositions(NoPositions):
    """Su et al. (2021), in Llama's layout: the head is split in two halves rotated against each other,
    so Hugging Face Llama weights load without permuting rows. Scores depend only on the offset. A table
    holds block_size positions; past it (models whose layers are all windowed or linear run any length)
    the angles are computed as the table's are."""

    def __init__(self, config):
        super().__init__(config)
        self.inv_freq, self.scale = rope_frequencies(config)  # fp32, not buffers: a bf16 model keeps them exact
        cos, sin = self.cos_sin(torch.arange(config.block_size, dtype=torch.float32))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def cos_sin(self, positions):
        freqs = torch.outer(positions, self.inv_freq.to(positions.device))
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.scale != 1:
            return angles.cos() * self.scale, angles.sin() * self.scale
        return angles.cos(), angles.sin()

    def rotate(self, q, k, start):
        T = q.size(2)
        if start + T <= self.cos.size(0):
            cos, sin = self.cos[start : start + T].to(q.dtype), self.sin[start : start + T].to(q.dtype)
        else:
            cos, sin = (t.to(q.dtype) for t in self.cos_sin(torch.arange(start, start + T, dtype=torch.float32, device=q.device)))
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_at(self, q, k, pos):
        inside = (pos < self.cos.size(0))[:, None]  # the table's values where it has them, as rotate() takes
        cos, sin = self.cos_sin(pos.float())
        table = pos.clamp(max=self.cos.size(0) - 1)
        cos, sin = torch.where(inside, self.cos[table], cos), torch.where(inside, self.sin[table], sin)
        cos, sin = cos[:, None, None].to(q.dtype), sin[:, None, None].to(q.dtype)  # (B, 1, 1, D): per row
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rope_frequencies(config):
    """RoPE's inverse frequencies (head_dim/2,) and the factor on its cos and sin, scaled as transformers
    scales them. linear (Chen et al. 2023, position interpolation) divides every frequency by rope_factor;
    yarn (Peng et al. 2023) interpolates only the frequencies that turn less than once over the trained
    length, keeps those that turn more than 32 times, ramps between, and scales scores by 0.1 ln(factor) + 1."""
    head_dim, theta, factor = config.n_embd // config.n_head, config.rope_theta, config.rope_factor
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if config.rope_scaling == "linear":
        return inv_freq / factor, 1.0
    if config.rope_scaling != "yarn":
        return inv_freq, 1.0
    trained = config.trained_block_size or config.block_size

    def dim_turning(turns):  # the (fractional) dimension whose wavelength fits `turns` times into `trained`
        return head_dim * math.log(trained / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_turning(32)), 0), min(math.ceil(dim_turning(1)), head_dim - 1)
    high = high + 0.001 if high == low else high
    keep = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    inv_freq = 1.0 / (factor * powers) * (1 - keep) + 1.0 / powers * keep
    return inv_freq, 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ALiBiPositions(NoPositions):
    """Press et al. (2022): no embeddings; each head penalises a score linearly in the distance."""

    def __init__(self, config):
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def attn_bias(self, start, T, k_start, k_len, causal=True):
        q_pos = torch.arange(start, start + T, device=self.slopes.device)[:, None]
        distance = q_pos - torch.arange(k_start, k_start + k_len, device=self.slopes.device)[None, :]
        bias = -self.slopes.float()[:, None, None] * distance.abs()  # in fp32 even for bf16 weights: slopes are powers of 2
        return bias.masked_fill(distance < 0, float("-inf")) if causal else bias

    def bias_at(self, pos, key_pos):
        distance = pos[:, None] - key_pos  # (B, K)
        return (-self.slopes.float()[None, :, None] * distance[:, None, :])[:, :, None]

    def score_mod(self, T):
        slopes = self.slopes.float()

        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        return alibi


def alibi_slopes(n_head):
    """The paper's slopes: a geometric sequence from 2^(-8/n); for a head count that is not a power of
    two, the power of two below it plus every other slope of the next power of two."""

    def geometric(n):
        first = 2.0 ** (-8.0 / n)
        return [first ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        slopes = geometric(n_head)
    else:
        below = 2 ** math.floor(math.log2(n_head))
        slopes = geometric(below) + geometric(2 * below)[0::2][: n_head - below]
    return torch.tensor(slopes, dtype=torch.float32)


class T5Positions(NoPositions):
    """Raffel et al. (2020): a learned scalar per head and bucket of the offset, added to the scores, one
    table shared by every layer (T5's). Causal buckets: an offset below t5_buckets/2 has its own, longer
    ones share logarithmically wider buckets up to t5_max_distance, and the last bucket holds the rest."""

    def __init__(self, config):
        super().__init__(config)
        self.n_buckets, self.max_distance = config.t5_buckets, config.t5_max_distance
        self.bias = nn.Embedding(config.t5_buckets, config.n_head)

    def attn_bias(self, start, T, k_start, k_len, causal=True):
        device = self.bias.weight.device
        distance = (torch.arange(start, start + T, device=device)[:, None]
                    - torch.arange(k_start, k_start + k_len, device=device)[None, :])  # fmt: skip
        if not causal:  # T5's encoder: half the buckets for keys before the query, half for keys after it
            half = self.n_buckets // 2
            buckets = t5_bucket(distance.abs(), half, self.max_distance) + half * (distance < 0)
            return self.bias(buckets).permute(2, 0, 1).float()
        bias = self.bias(t5_bucket(distance.clamp_min(0), self.n_buckets, self.max_distance)).permute(2, 0, 1)
        return bias.float().masked_fill(distance < 0, float("-inf"))

    def bias_at(self, pos, key_pos):
        distance = pos[:, None] - key_pos  # (B, K)
        bias = self.bias(t5_bucket(distance.clamp_min(0), self.n_buckets, self.max_distance)).permute(0, 2, 1)
        return bias.float()[:, :, None]

    def score_mod(self, T):
        table = self.bias.weight.float()  # (buckets, n_head), read inside the kernel: its gradient flows from there
        # the bucket of every distance a block can hold (later keys, hidden by the mask, read bucket 0)
        buckets = t5_bucket(torch.arange(T, device=table.device), self.n_buckets, self.max_distance)

        def t5(score, b, h, q_idx, kv_idx):
            return score + table[buckets[(q_idx - kv_idx).clamp(min=0)], h]

        return t5


def t5_bucket(distance, n_buckets, max_distance):
    """T5's causal relative_position_bucket: a distance (query position - key position, >= 0) -> its bucket."""
    exact = n_buckets // 2
    scaled = torch.log(distance.float() / exact) / math.log(max_distance / exact) * (n_buckets - exact)
    return torch.where(distance < exact, distance, (exact + scaled.to(torch.long)).clamp_max(n_buckets - 1))


POSITIONS = {
    "learned": LearnedPositions,
    "rope": RotaryPositions,
    "sinusoidal": SinusoidalPositions,
    "alibi": ALiBiPositions,
    "t5": T5Positions,
    "none": NoPositions,
}
