"""
The softmax kernels every softmax kind calls (GPTConfig.attn_impl: KERNELS).

SDPA, the explicit masked softmax kept as its reference, and FlexAttention for windows and position
biases on GPUs (layer_mask).
"""

import functools
import math

import torch
import torch.nn.functional as F


def visible(q_start, T, k_start, k_len, window, device):
    """Which keys each query sees: a causal, optionally windowed, boolean (T, k_len) mask.

    Query q_start+i sees key k_start+j when the key is not later and, with a window, fewer than `window`
    positions earlier (so the query sees itself and window - 1 keys before)."""
    offset = (torch.arange(q_start, q_start + T, device=device)[:, None]
              - torch.arange(k_start, k_start + k_len, device=device)[None, :])  # fmt: skip
    return (offset >= 0) & (offset < window) if window else offset >= 0


def attention_scores(q, k, mask):
    """Pre-softmax scores (B, n_head, T, keys), the mask and any position bias applied.

    Scaled q.k (keys shared across a query group), -inf where the mask hides a key, plus any position bias."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    if mask is None:
        mask = visible(k.size(2) - q.size(2), q.size(2), 0, k.size(2), None, q.device)
    if isinstance(mask, FlexMask):  # (probes.recording and the explicit kernel take the dense form)
        mask = mask.dense()
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def attention_explicit(q, k, v, mask, dropout_p=0.0):
    """The textbook path, kept as the reference that SDPA is tested against."""
    scores = attention_scores(q, k, mask)
    weights = F.dropout(F.softmax(scores.float(), dim=-1).to(q.dtype), p=dropout_p)
    return weights @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)


ONE_QUERY = {}  # "op": rowdot.cpp's one_query_attention, set by quantize.py when it builds that file


def attention_one_query(q, k, v, mask):
    """softmax(q.k / sqrt(d) + mask) v for one query a row, written as products and sums: in a compiled CPU
    decode step inductor fuses them into loops of its own, where SDPA's CPU kernel calls a tiny GEMM per head
    (53 us a layer at 12 heads, as long as three of the layer's four weight products: docs/benchmarks.md)."""
    B, H, _, D = q.shape
    Hkv, K, dtype = k.size(1), k.size(2), q.dtype
    q, k, v = q.float(), k.float(), v.float()  # scores and sums in float32, as SDPA keeps them (inductor fuses the casts)
    q = q.reshape(B, Hkv, H // Hkv, 1, D)  # the heads that share a key, together
    scores = ((q * k[:, :, None]).sum(-1) * (1.0 / math.sqrt(D))).view(B, H, 1, K)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.to(scores.dtype)
    weights = F.softmax(scores, dim=-1).view(B, Hkv, H // Hkv, K, 1)
    return (weights * v[:, :, None]).sum(-2).view(B, H, 1, D).to(dtype)


def attention_sdpa(q, k, v, mask, dropout_p=0.0):
    if isinstance(mask, FlexMask):
        return attention_flex(q, k, v, mask)
    if (q.size(2) == 1 and mask is not None and q.device.type == "cpu" and dropout_p == 0 and not torch.is_grad_enabled()
            and torch.compiler.is_compiling()):  # a compiled decode step's: rowdot.cpp's loop where quantize.py built it
        op = ONE_QUERY.get("op") if q.dtype == k.dtype == torch.float32 else None
        return attention_one_query(q, k, v, mask) if op is None else op(q, k, v, mask)
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
    """A layer mask in FlexAttention's form, with its dense twin for the kernels that take a tensor.

    A block mask and the position scheme's score_mod (or None); dense() makes the tensor mask, for the
    kernels that take one."""

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
    """A kind's mask for one forward: its FlexAttention form where that pays, else kind.mask's.

    FlexAttention pays on FLEX_DEVICES, with the SDPA kernel, a forward with gradients of T = block_size
    queries from position 0, no attention dropout, heads of 16 or more, and a mask SDPA's flash kernel
    cannot take (a window narrower than T, or a bias)."""
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
    """Whether the position scheme's score_mod is written for its own attn_bias.

    A subclass that changes attn_bias and inherits score_mod would have flex add the wrong bias, so it
    keeps the dense mask."""
    mro = type(positions).__mro__
    defines = lambda name: next(i for i, cls in enumerate(mro) if name in vars(cls))  # noqa: E731
    return defines("score_mod") <= defines("attn_bias")


def outside_compiled_graphs(fn):
    """torch.compiler.disable(fn), made at fn's first call, so start-up skips torch._dynamo.

    Like torch's own _disable_dynamo (though dynamo traces this wrapper: on a first call inside a compile
    the graph breaks here, at the same place): the decorator imports torch._dynamo, 2 s that every command
    line paid at start-up though only a compiled run (or FlexAttention's compiled kernel) needs it."""

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
