"""
Sampling and the decode loop, as functions of a model (GPT.generate and GPT.stream call these).

  next_logits(model, seq, length, cache)   the logits after seq[:, :length]: a prefill, then a token a step
  generate(model, idx, max_new_tokens, Sampling(temperature=0.8, top_k=200), eos_token_id)
  stream(...)                              the same, yielding each new column of tokens as it exists
  generate(..., lengths=[...])             prompts of different lengths in one call (stream_rows, over the
                                           server's row batch: BatchRows)

Sampling says how a token is drawn (temperature, top-k, top-p); sample_next draws one per row, with one
generator per row if asked. speculative.py plugs its drafts into stream() as a step that may return
several tokens.
"""

import os
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

import attention


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn: temperature, top-k and top-p.

    Temperature 0 is greedy; top_k keeps the k most likely tokens, top_p the smallest set whose
    probability reaches p (None: no filter)."""

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
    """Sets to -inf every logit outside the top_k largest and outside the top_p nucleus.

    Sets to -inf every logit outside the top_k largest (ties with the k-th kept) and outside the
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
    """(B, vocab) logits -> (B, 1) token ids, one generator per row if asked.

    generator: None, one torch.Generator for the batch, or a list with one per row (row i then draws
    exactly what a batch of one with that generator would)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return pick(logits, sampling, race_noise(logits.shape, logits.device, generator))


def race_noise(shape, device, generator=None):
    """Exp(1) noise (B, vocab) for pick(): one draw per token, row i from generator[i] when it is a list."""
    if isinstance(generator, list):
        return torch.stack([torch.empty(shape[-1], device=device).exponential_(generator=g) for g in generator])
    return torch.empty(shape, device=device).exponential_(generator=generator)


def pick(logits, sampling, noise):
    """The token drawn from sampling's distribution by the exponential race (gpt-fast's sampler).

    The token drawn from sampling's distribution by the exponential race: argmax of p / E with E ~ Exp(1)
    per token is exactly a draw from p (E / p is Exp(p), and the least of independent exponentials is
    index i with probability p_i). Unlike torch.multinomial it never waits for the device, and a compiled
    step takes the noise as an input (gpt-fast's sampler)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    return (sampling.probs(logits) / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1, keepdim=True)


def check_max_new_tokens(max_new_tokens):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")


def next_logits(model, seq, length, cache=None, source=None, pad_mask=None):
    """The logits (B, vocab) of the token after seq[:, :length], through the cache or afresh.

    The tokens the cache has not seen yet go through it (the whole prompt first, then one per step),
    or, without a cache or once the sequence has outgrown block_size, the last block_size tokens run
    afresh. Past block_size every cached key is stale (each depended on tokens that have left the
    window), so both ways compute the same. A model that runs any length (config.context_limit None:
    windows and linear layers, relative positions) never recomputes: the cache takes the new tokens,
    block_size at a time, and without a cache the whole sequence runs, which computes the same. source
    (pad_mask): an encoder-decoder's, read afresh with the decoder's tokens wherever no cache serves."""
    block_size, limit = model.config.block_size, model.config.context_limit
    if source is not None and (cache is None or (limit is not None and length > block_size)):  # afresh, encoder included
        window = seq[:, :length] if limit is None else seq[:, max(0, length - block_size) : length]
        return model.forward_cached(window, source=source, pad_mask=pad_mask)[:, -1]
    if model.config.context_limit is None:
        if cache is None:
            return model.forward_cached(seq[:, :length])[:, -1]
        for begin in range(cache.length, length, block_size):
            logits = model.forward_cached(seq[:, begin : min(begin + block_size, length)], cache)
        return logits[:, -1]
    if cache is None or length > block_size:
        return model.forward_cached(seq[:, max(0, length - block_size) : length])[:, -1]
    return model.forward_cached(seq[:, cache.length : length], cache)[:, -1]


@torch.no_grad()
def generate(model, idx, max_new_tokens, sampling=Sampling(), *, eos_token_id=None, use_cache=True, generator=None,
             step=None, source=None, pad_mask=None, lengths=None):
    """Continues each row of idx (B, T; rows of equal length) by up to max_new_tokens tokens.

    Returns (B, T + new). Call model.eval() first, or dropout stays on. With the cache, the prompt runs
    once and then one token per step; without it, each step recomputes the last block_size tokens
    (next_logits). Tokens are the same either way.

    A row that emits eos_token_id stops growing: later positions repeat eos_token_id. Generation ends
    early when every row has stopped, so `new` can be less than max_new_tokens.

    generator: None, a torch.Generator, or a list of one per row (row i then draws exactly the tokens
    a batch of one with that generator would). step: as stream's (StaticDecode: the compiled step).
    Speculative decoding: speculative.generate. source (B, S): an encoder-decoder's source ids (pad_mask:
    True on their real tokens), encoded once; idx then starts the decoder (T5: its pad id, 0).

    lengths: prompts of different lengths in one call (stream_rows): row b's prompt is idx[b, :lengths[b]]
    (what follows it is padding, never read), and its new tokens are columns T.. of the result as for
    every row."""
    columns = stream(model, idx, max_new_tokens, sampling, eos_token_id=eos_token_id, use_cache=use_cache,
                     generator=generator, step=step, source=source, pad_mask=pad_mask, lengths=lengths)
    return torch.cat([idx, *columns], dim=1)


@torch.no_grad()
def stream(model, idx, max_new_tokens, sampling=Sampling(), *, eos_token_id=None, use_cache=True, generator=None,
           step=None, source=None, pad_mask=None, lengths=None):
    """generate() one step at a time: yields each new (B, 1) column of tokens as soon as it exists.


    step: None, or step(seq, length, end, cache) -> (B, n) tokens to append after seq[:, :length], or
    None for an ordinary step; it may return several tokens at once (speculative.py's drafts do) and
    leaves the cache holding the sequence up to, at most, the new tokens' last."""
    check_max_new_tokens(max_new_tokens)
    generator = list(generator) if isinstance(generator, (list, tuple)) else generator
    if lengths is not None:
        if step is not None or source is not None or not use_cache:
            raise ValueError("lengths (prompts of different lengths) decodes through each row's cache: "
                             "no step, source or use_cache=False with it")
        yield from stream_rows(model, idx, lengths, max_new_tokens, sampling, eos_token_id, generator)
        return
    B, T = idx.shape
    seq = torch.empty(B, T + max_new_tokens, dtype=idx.dtype, device=idx.device)
    seq[:, :T] = idx
    cache = (model.new_cache(source=source, pad_mask=pad_mask) if source is not None else model.new_cache()) if use_cache else None
    finished = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)
    length, end = T, T + max_new_tokens
    while length < end:
        tokens = None if step is None else step(seq, length, end, cache)
        if tokens is None:
            tokens = sample_next(next_logits(model, seq, length, cache, source, pad_mask), sampling, generator)
        for token in tokens.split(1, dim=1):
            if eos_token_id is not None:
                token = token.masked_fill(finished, eos_token_id)
                finished |= token == eos_token_id
            seq[:, length] = token[:, 0]
            length += 1
            yield token
            if eos_token_id is not None and bool(finished.all()):
                return


# ----------------------------------------------------------------------------------------------------
# Rows decoded together, each at its own length: a server's batch (engine.py) and prompts of different
# lengths in one generate() call (stream_rows)


class BatchRows:
    """Up to max_rows sequences in one set of static caches, each row at its own length.

    A step is one GPT.decode_static over rows 0..n-1 (attention for every row in one call per layer, one
    mask). A sequence joins at row n (its prefill's cache copied in) and one that ends has the last row
    moved into its place, so a step takes views, never copies. Full layers hold the longest row's
    positions, rounded up to a power of two (from 16) and at most block_size: memory is at most max_rows x
    block_size positions per full layer, a window's ring or a linear layer's sums per row for the others."""

    def __init__(self, model, max_rows):
        self.model, self.max_rows, self.layers, self.n, self.capacity = model, max_rows, None, 0, 0

    def fit(self, length):
        capacity = 16
        while capacity < length:
            capacity *= 2
        return min(capacity, self.model.config.block_size)

    def reserve(self, length):
        """Room for positions up to length - 1 in every row."""
        if self.layers is not None and length > self.capacity:
            self.capacity = self.fit(length)
            self.layers = [layer.grow(self.capacity) for layer in self.layers]

    def add(self, cache):
        """A prefilled sequence (its dynamic KVCache) joins; returns its row."""
        if self.layers is None:
            self.capacity = self.fit(cache.length + 1)
        self.reserve(cache.length + 1)
        rows = [block.attn.static_cache(layer, cache.length, self.capacity) for block, layer in zip(self.model.blocks, cache.layers)]
        if self.layers is None:
            self.layers = [type(row).batch(row, self.max_rows) for row in rows]
        for layer, row in zip(self.layers, rows):
            layer.put(self.n, row)
        self.n += 1
        return self.n - 1

    def remove(self, row):
        """Row `row` leaves; the last row takes its place (the caller moves its own record the same way)."""
        self.n -= 1
        if row != self.n:
            for layer in self.layers:
                layer.move(self.n, row)

    def decode(self, tokens, positions):
        """tokens (n, 1) at positions (a list of n ints) -> logits (n, vocab).

        Full layers attend over the positions up to the longest row's, not their whole capacity."""
        return self.model.decode_static(*self.inputs(tokens, positions))

    def decode_and_prefill(self, tokens, positions, idx, cache, last=1):
        """decode(), and in the same pass idx (1, T) into a joining sequence's own cache.

        decode(), and in the same pass idx (1, T) into a joining sequence's own cache (GPT.decode_and_prefill)
        -> (logits (n, vocab), idx's last `last` logits (1, last, vocab))."""
        return self.model.decode_and_prefill(*self.inputs(tokens, positions), idx, cache, last)

    def inputs(self, tokens, positions):
        length = max(positions) + 1
        self.reserve(length)
        pos = torch.tensor(positions, device=tokens.device)
        return tokens, pos, [layer.rows(self.n, length) for layer in self.layers]


class DynamicRows:
    """BatchRows for models with a kind that has no StaticCache: a dynamic cache per row.

    Each row keeps its own dynamic cache and GPT.decode_rows runs attention row by row (the
    projections and MLPs still once for the batch)."""

    def __init__(self, model, max_rows):
        self.model, self.caches = model, []

    def add(self, cache):
        self.caches.append(cache)
        return len(self.caches) - 1

    def remove(self, row):
        last = self.caches.pop()
        if row < len(self.caches):
            self.caches[row] = last

    def decode(self, tokens, positions):
        return self.model.decode_rows(tokens, self.caches)

    def decode_and_prefill(self, tokens, positions, idx, cache, last=1):
        """decode() and the prefill of idx, one after the other (decode_rows has no shared pass)."""
        return self.decode(tokens, positions), self.model.forward_cached(idx, cache, last)


@torch.no_grad()
def stream_rows(model, idx, lengths, max_new_tokens, sampling, eos_token_id=None, generator=None):
    """stream() for prompts of different lengths: row b's prompt is idx[b, :lengths[b]].

    Each prompt is prefilled alone (rows with the same prompt once, when the batch copies caches in: a
    GRPO group's samples share theirs), then every row decodes in one batch at its own position
    (row_batch: the server's). No padding token is ever read, so with a generator per row, row b draws the
    tokens it would alone, up to the rounding of a batched product (one generator: one (B, vocab) block of
    noise a step, as stream() draws it). With eos_token_id, a row that fills the model's context ends there
    (its later tokens are eos) while the others go on; without it, every row must fit."""
    check_max_new_tokens(max_new_tokens)
    B, T = idx.shape
    lengths = [int(n) for n in lengths]
    if B == 0 or len(lengths) != B or min(lengths) < 1 or max(lengths) > T:
        raise ValueError(f"lengths must give each of the {B} rows a prompt length in 1..{T}; got {lengths}")
    limit = model.config.context_limit
    room = [max_new_tokens if limit is None else min(max_new_tokens, limit + 1 - n) for n in lengths]
    if min(room) < 1 or (eos_token_id is None and min(room) < max_new_tokens):
        raise ValueError(f"a prompt of {max(lengths)} tokens and {max_new_tokens} new ones pass block_size={limit}: "
                         "lower max_new_tokens" + (", or shorten the prompt" if min(room) < 1 else
                                                   ", or give eos_token_id (a row that fills the context then ends)"))
    batch = row_batch(model, B)
    first, prefilled = [], {}
    for b, n in enumerate(lengths):
        key = tuple(idx[b, :n].tolist()) if isinstance(batch, BatchRows) else b  # (DynamicRows keeps each row's cache itself)
        if key not in prefilled:
            cache = model.new_cache()
            prefilled[key] = (cache, model.forward_cached(idx[b : b + 1, :n], cache)[0, -1])
        cache, logits = prefilled[key]
        batch.add(cache)
        first.append(logits)
    logits, positions = torch.stack(first), lengths
    last = torch.tensor(room, device=idx.device)[:, None] - 1  # each row's last new token: the context is full after it
    finished = torch.zeros(B, 1, dtype=torch.bool, device=idx.device)
    for n in range(max_new_tokens):
        token = sample_next(logits, sampling, generator)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
            finished |= (token == eos_token_id) | (last == n)
        yield token
        if n == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
            return
        # (a row that has ended goes on at its last position: its logits are never read)
        logits = batch.decode(token, positions if limit is None else [min(p, limit - 1) for p in positions])
        positions = [p + 1 for p in positions]


def row_batch(model, max_rows):
    """The batch a server decodes its requests in: BatchRows where every layer's kind has a StaticCache (an
    encoder-decoder's rows each cross-attend to their own source: DynamicRows)."""
    dynamic = without_static_step(model) or model.config.family != "decoder"
    return (DynamicRows if dynamic else BatchRows)(model, max_rows)


# ----------------------------------------------------------------------------------------------------
# A compiled decode step over static caches (gpt-fast's shape): after an eager prefill, each layer's cache
# becomes its kind's StaticCache (a full layer's keys preallocated to block_size, a window's ring, a linear
# layer's sums), and one step is a pure function of tensors (the token, each row's position, the caches,
# the sampler's noise), compiled with fullgraph=True: with CUDA graphs on a GPU (triton.cudagraphs, what
# mode="reduce-overhead" sets), with a C++ wrapper on a CPU (compiled_step).


STATIC_BACKEND = "inductor"  # torch.compile's backend for the step (tests trace it with "eager": no C++ to build)
_compiled = weakref.WeakKeyDictionary()  # model -> (its structure, its compiled step)
CPP_WRAPPER = os.environ.get("SMALLGPT_CPP_WRAPPER", "1") == "1"


def decode_one_token(model, tokens, pos, caches, noise, sampling):
    return pick(model.decode_static(tokens, pos, caches), sampling, noise)


def structure(model):
    """What a compiled step was traced for.

    Each module's type and mode and each tensor's name, shape, dtype, layout and memory, and how it compiles:
    in-place changes of values keep it; quantising, relaying or moving the weights, or train() do not."""
    return (STATIC_BACKEND, CPP_WRAPPER, tuple((type(m).__name__, m.training) for m in model.modules()),
            tuple((name, t.shape, t.dtype, t.stride(), t.data_ptr()) for name, t in
                  [*model.named_parameters(), *model.named_buffers()]))


def compiled_step(model, device_type):
    """decode_one_token compiled for this model, once per model and structure.

    Its own cache of compiled entries (isolate_recompiles) lets its guards skip the modules' attributes,
    which cost 0.8 ms a token for 12 layers on a CPU, since this compile only ever sees this model as it is
    now (structure)."""
    key = (device_type, structure(model))
    if model not in _compiled or _compiled[model][0] != key:
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if STATIC_BACKEND == "inductor":
            # CUDA graphs on a GPU (what mode="reduce-overhead" sets); on a CPU, a C++ wrapper calls the kernels
            # CPU: inductor's own kernels here are the small ones (norms, rope, the cache's writes, argmax; the
            # products and attention are rowdot.cpp's), and vectorising them costs 6.7 s of a 6x384 step's cold
            # compile (17.7 -> 11.0 s) for no speed a token measures (docs/benchmarks.md)
            options.update({"triton.cudagraphs": True} if device_type == "cuda" else
                           {"cpp_wrapper": CPP_WRAPPER, "cpp.vec_isa_ok": False})
        _compiled[model] = key, torch.compile(decode_one_token, fullgraph=True, dynamic=False, backend=STATIC_BACKEND,
                                              options=options, isolate_recompiles=True)
    return _compiled[model][1]


def without_static_step(model):
    """The model's kinds that have no StaticCache (attention/), sorted."""
    return sorted({kind for kind in model.config.layer_kinds if attention.KINDS[kind].StaticCache is None})


def check_static(model):
    """ValueError naming the kinds that have no compiled decode step (attention/'s StaticCache)."""
    missing = without_static_step(model)
    if missing:
        raise ValueError(f"compile=True decodes through each layer's static cache; {attention.named(missing)} "
                         "layers have none (StaticCache in attention/): use compile=False")


class StaticDecode:
    """stream()'s step for compile=True: each decoded token through a compiled static-cache step.

    The prefill and any step that runs afresh (past block_size for models with a context limit) go the
    eager way; every other token through decode_one_token, compiled. Draws the same tokens as the eager
    loop (the same sampler, the noise drawn the same way), up to the rounding of attention over a padded
    cache."""

    def __init__(self, model, sampling, generator=None, compile=True, max_len=None):
        check_static(model)
        self.model, self.sampling, self.generator, self.max_len = model, sampling, generator, max_len
        self.run = compiled_step(model, next(model.parameters()).device.type) if compile else decode_one_token
        self.caches = None

    def __call__(self, seq, length, end, cache):
        limit = self.model.config.context_limit
        if cache is None or (limit is not None and length >= limit):
            return None  # the eager step: runs afresh past the context
        if self.caches is None:
            # the prefill is the eager way's: the caches are made from what it left, once it has run (a
            # one-token prompt's cache is still empty at its first step, though length - 1 is 0 there too)
            if cache.length == 0 or cache.length != length - 1:
                return None
            max_len = self.max_len or min(self.model.config.block_size, end)
            self.caches = [block.attn.static_cache(layer, cache.length, max_len)
                           for block, layer in zip(self.model.blocks, cache.layers)]
            if seq.device.type == "cuda":  # CUDA graphs replay on fixed addresses: the caches are updated in place
                for c in self.caches:
                    for name in c.fields:
                        torch._dynamo.mark_static_address(getattr(c, name))
        B = seq.size(0)
        pos = torch.full((B,), length - 1, dtype=torch.long, device=seq.device)
        noise = None if self.sampling.temperature == 0 else race_noise((B, self.model.config.vocab_size), seq.device, self.generator)
        # a copy: a CUDA graph's output is overwritten by its next replay, and stream() hands tokens out
        return self.run(self.model, seq[:, length - 1 : length], pos, self.caches, noise, self.sampling).clone()


MEASURED_TOKENS, MEASURED_ROUNDS = 8, 3  # faster_static_step: tokens each way decodes per round, interleaved rounds


def faster_static_step(model, idx, max_new_tokens, sampling):
    """(StaticDecode or None, a line for stderr): the compiled step where it decodes faster than eager here.

    The compiled static-cache step is slower than the eager loop on some CPUs (docs/benchmarks.md). Both
    decode MEASURED_TOKENS tokens after idx (the run's own rows, sampling and cache size, so that the run
    reuses what was compiled), MEASURED_ROUNDS rounds interleaved after one that compiles; medians decide."""
    import time

    check_static(model)
    max_len = min(model.config.block_size, idx.size(1) + max_new_tokens)
    n = min(MEASURED_TOKENS, max_len - idx.size(1))
    if n < 2:  # the first new token is the eager prefill's: no compiled step would run
        return None, "compile: at most one new token fits in the static cache, which no compiled step decodes: decoding eager"
    ways = {"compiled": lambda: StaticDecode(model, sampling, max_len=max_len), "eager": lambda: None}
    times = {name: [] for name in ways}
    start = time.perf_counter()
    for r in range(MEASURED_ROUNDS + 1):
        for name, step in ways.items():
            begin = time.perf_counter()
            generate(model, idx, n, sampling, step=step(), generator=torch.Generator(idx.device).manual_seed(0))
            if idx.device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                times[name].append(time.perf_counter() - begin)
            elif name == "compiled":
                compile_seconds = time.perf_counter() - start
    compiled, eager = (sorted(t)[len(t) // 2] for t in (times["compiled"], times["eager"]))
    faster = compiled < eager
    line = (f"compile: the compiled step decodes {'faster' if faster else 'slower'} than eager here "
            f"({eager / compiled:.2f}x eager's speed over {n} tokens, compiled in {compile_seconds:.1f} s): "
            f"{'using it' if faster else 'decoding eager'}")
    return (StaticDecode(model, sampling, max_len=max_len) if faster else None), line
