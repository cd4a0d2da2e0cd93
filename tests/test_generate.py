"""generate.py: Sampling, filter_logits, sample_next, next_logits and the decode loop (generate, stream)."""

import math
import time

import pytest
import torch

import generate
from conftest import build
from generate import Sampling, filter_logits, next_logits, sample_next

SCHEMES = ["learned", "rope", "sinusoidal", "alibi", "t5", "none"]

GREEDY = Sampling(temperature=0)


@pytest.mark.parametrize("pos_emb", SCHEMES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_cached_generation_equals_uncached(pos_emb, qk_norm):
    model = build(pos_emb=pos_emb, qk_norm=qk_norm, n_kv_head=2)
    prompt = torch.randint(0, 61, (2, 5))
    # 40 new tokens run past block_size=32, where both paths recompute the last 32 tokens
    runs = []
    for use_cache in (True, False):
        g = torch.Generator().manual_seed(123)
        runs.append(model.generate(prompt, 40, Sampling(temperature=1.0, top_k=20), use_cache=use_cache, generator=g))
    assert runs[0].shape == (2, 45)
    assert torch.equal(runs[0], runs[1])
    # the cache's last-position logits equal the full forward's
    seq = runs[0][:, :30]
    cache = model.new_cache(32)
    model(seq[:, :20], kv_cache=cache)
    for t in range(20, 30):
        step_logits = model(seq[:, t : t + 1], kv_cache=cache)[0][:, -1]
        torch.testing.assert_close(step_logits, model(seq[:, : t + 1])[0][:, -1], rtol=0, atol=1e-5)


def test_long_prompt_is_cropped_like_uncached():
    """Past block_size (32) a step sees the last 32 tokens alone. generate(), with the cache and without, equals
    a naive loop that runs the model without a cache on the last block_size tokens and takes the argmax, and
    next_logits equals that forward's logits at every step (a random model's argmax seldom notices a window
    one token off; its logits do, by about 5e-3): for a prompt longer than block_size, cropped from the first
    step, and for a shorter one that grows past it (the cache first, then the cropped recompute)."""
    model = build(pos_emb="rope")
    block_size = model.config.block_size
    assert model.config.context_limit == block_size  # full attention: past block_size the window is recomputed

    def naive_logits(seq):
        with torch.no_grad():
            return model(seq[:, -block_size:])[0][:, -1]

    for length, steps in ((50, 5), (20, 30)):
        prompt = torch.randint(0, 61, (2, length))
        expected = prompt
        for _ in range(steps):
            expected = torch.cat([expected, naive_logits(expected).argmax(-1, keepdim=True)], dim=1)
        for use_cache in (True, False):
            generated = model.generate(prompt, steps, GREEDY, use_cache=use_cache)
            assert torch.equal(generated, expected), (length, use_cache)
            cache = model.new_cache() if use_cache else None
            for end in range(length, length + steps):
                torch.testing.assert_close(next_logits(model, expected, end, cache), naive_logits(expected[:, :end]),
                                           rtol=0, atol=1e-5, msg=lambda m: f"prompt {length}, cache {use_cache}, "
                                           f"length {end}: {m}")


def test_eos_rows_stop_and_pad():
    model = build()
    prompt = torch.randint(0, 61, (3, 4))
    free = model.generate(prompt, 12, GREEDY)
    eos = int(free[1, 6])  # the token row 1 emits at its third step
    stopped = model.generate(prompt, 12, GREEDY, eos_token_id=eos)
    for row in range(3):  # every row is either still free-running or padded with eos after its first eos
        hits = (free[row, 4 : stopped.size(1)] == eos).nonzero()
        end = hits[0].item() + 5 if len(hits) else stopped.size(1)
        assert torch.equal(stopped[row, :end], free[row, :end])
        assert (stopped[row, end:] == eos).all()


def test_generation_stops_when_all_rows_done():
    model = build()
    prompt = torch.randint(0, 61, (1, 4))
    first = int(model.generate(prompt, 1, GREEDY)[0, -1])
    out = model.generate(prompt, 10, GREEDY, eos_token_id=first)
    assert out.shape == (1, 5)


def test_greedy_is_temperature_zero():
    model = build()
    prompt = torch.randint(0, 61, (2, 4))
    out = model.generate(prompt, 6, GREEDY)
    idx = prompt
    for _ in range(6):
        idx = torch.cat([idx, model(idx)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, idx)


# ---------------------------------------------------------------------------------------------------
# Sampling


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
        (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
        (dict(top_k=0), "top_k=0 must be >= 1"),
    ],
)
def test_bad_sampling_arguments(kwargs, message):
    args = dict(max_new_tokens=3) | kwargs
    with pytest.raises(ValueError) as err:
        build().generate(torch.zeros(1, 2, dtype=torch.long), args.pop("max_new_tokens"), Sampling(**args))
    assert message in str(err.value)


def test_top_k_keeps_exactly_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0, 0.0]])
    kept = torch.isfinite(filter_logits(logits, top_k=3))
    assert kept.tolist() == [[False, True, True, True, False, False]]
    assert torch.equal(filter_logits(logits, top_k=6), logits)


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.05, 0.5, 0.2, 0.25]])
    logits = probs.log()
    keep = lambda p: torch.isfinite(filter_logits(logits, top_p=p)).tolist()[0]  # noqa: E731
    assert keep(0.5) == [False, True, False, False]  # 0.5 alone reaches 0.5
    assert keep(0.6) == [False, True, False, True]  # 0.5 + 0.25
    assert keep(0.75) == [False, True, False, True]
    assert keep(0.76) == [False, True, True, True]
    assert keep(0.96) == [True, True, True, True]
    assert keep(0.01) == [False, True, False, False]  # the most likely token is always kept
    assert keep(1.0) == [True, True, True, True]


def test_sampling_follows_filtered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(4000, 1)
    g = torch.Generator().manual_seed(0)
    draws = sample_next(logits, Sampling(temperature=1.0, top_k=2), g)[:, 0]
    assert set(draws.tolist()) == {2, 3}
    share = (draws == 3).float().mean().item()
    assert share == pytest.approx(math.e / (1 + math.e), abs=0.03)


def test_per_row_generators_match_single_rows():
    model = build()
    prompt = torch.randint(0, 61, (1, 4)).repeat(4, 1)
    batch = model.generate(prompt, 15, generator=[torch.Generator().manual_seed(100 + i) for i in range(4)])
    for i in range(4):
        single = model.generate(prompt[:1], 15, generator=torch.Generator().manual_seed(100 + i))
        assert torch.equal(batch[i : i + 1], single)
    assert len({tuple(row.tolist()) for row in batch}) > 1


@pytest.mark.parametrize("case", ["learned", "rope gqa", "window and full", "gated delta rule and full"])
def test_prompts_of_different_lengths_decode_in_one_call_as_each_alone(case):
    """generate(lengths=...): row b's prompt is idx[b, :lengths[b]] (what follows is padding, never read);
    greedy and per-row-seeded samples equal one-row generate() (rows sharing a prompt share its prefill),
    and eos pads a finished row as in the equal-length loop."""
    model = build(**STATIC_CASES[case])
    prompts = [torch.randint(0, 59, (n,)) for n in (3, 7, 3, 11)]  # (60: the pad, never an answer here)
    prompts[2] = prompts[0]
    idx = torch.full((4, 11), 60)  # a pad id the rows would notice if they read it
    for b, p in enumerate(prompts):
        idx[b, : len(p)] = p
    lengths = [len(p) for p in prompts]
    for sampling in (GREEDY, Sampling(temperature=1.0)):
        seeds = [torch.Generator().manual_seed(7 + b) for b in range(4)]
        out = model.generate(idx, 9, sampling, lengths=lengths, generator=seeds)
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], 9, sampling, generator=[torch.Generator().manual_seed(7 + b)])
            assert torch.equal(out[b, 11:], alone[0, len(p) :]), (case, sampling, b)
    free = model.generate(idx, 9, GREEDY, lengths=lengths)
    eos = int(free[1, 13])  # row 1's third new token
    stopped = model.generate(idx, 9, GREEDY, lengths=lengths, eos_token_id=eos)
    for b in range(4):
        hits = (free[b, 11:] == eos).nonzero()
        end = 11 + (hits[0].item() + 1 if len(hits) else 9)
        assert torch.equal(stopped[b, 11:end], free[b, 11:end]) and (stopped[b, end:] == eos).all()
    with pytest.raises(ValueError, match="prompt length in 1..11"):
        model.generate(idx, 2, GREEDY, lengths=[3, 0, 3, 11])
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        model.generate(idx, model.config.block_size, GREEDY, lengths=lengths)
    # with an end token, a row that fills the context (block_size 32) ends there and the others go on
    long = torch.randint(0, 59, (30,))
    both = torch.stack([long, torch.cat([prompts[1], torch.zeros(23, dtype=torch.long)])])
    out = model.generate(both, 6, GREEDY, lengths=[30, 7], eos_token_id=60)
    assert torch.equal(out[0, 30:33], model.generate(long[None], 3, GREEDY)[0, 30:]) and (out[0, 33:] == 60).all()
    assert torch.equal(out[1, 30:], model.generate(prompts[1][None], 6, GREEDY)[0, 7:])


# ---------------------------------------------------------------------------------------------------
# The static-cache decode step (generate.StaticDecode): the eager loop's tokens


STATIC_CASES = {
    "learned": {}, "rope gqa": dict(pos_emb="rope", n_kv_head=2), "alibi": dict(pos_emb="alibi"),
    "t5": dict(pos_emb="t5"), "sinusoidal": dict(pos_emb="sinusoidal"),
    "window and full": dict(pos_emb="rope", attn_pattern="SL", attn_window=5),
    "linear and window, past block_size": dict(pos_emb="rope", attn_pattern="RS", attn_window=6),
    "retention and full": dict(pos_emb="rope", attn_pattern="DL"),
    "gated delta rule and full": dict(pos_emb="rope", attn_pattern="NL", n_kv_head=2),
    "data-dependent decay and full": dict(pos_emb="rope", attn_pattern="ML", n_kv_head=2),
}  # fmt: skip


def eager_and_static(model, sampling, new_tokens, compile, eos=None, prompt_len=7):
    idx = torch.randint(0, 61, (3, prompt_len), generator=torch.Generator().manual_seed(1))
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(3)]  # noqa: E731
    eager = model.generate(idx, new_tokens, sampling, eos_token_id=eos, generator=gens())
    g = gens()
    static = generate.generate(model, idx, new_tokens, sampling, eos_token_id=eos, generator=g,
                               step=generate.StaticDecode(model, sampling, g, compile=compile))
    return eager, static


@pytest.mark.parametrize("case", STATIC_CASES.values(), ids=STATIC_CASES.keys())
def test_static_decode_step_gives_the_eager_loops_tokens(case):
    """Every kind's StaticCache and every position scheme's *_at hooks, uncompiled: the same greedy and
    seeded tokens as the eager loop, past block_size (32) too (there: afresh, or the ring and the sums)."""
    model = build(**case)
    for sampling in (Sampling(temperature=0), Sampling(temperature=0.9, top_k=20)):
        eager, static = eager_and_static(model, sampling, 50, compile=False, eos=5)
        assert torch.equal(eager, static), sampling


@pytest.mark.parametrize("case", [{}, dict(pos_emb="rope", attn_pattern="SR", attn_window=4)], ids=["full", "window and linear"])
def test_the_static_step_after_a_one_token_prompt(case):
    """A one-token prompt (sample.py's default "\\n") has its prefill run eager before the static caches are
    made from it; the step took the empty cache for a prefilled one and read cache.k while it was None."""
    model = build(**case)
    for sampling in (Sampling(temperature=0), Sampling(temperature=0.9, top_k=20)):
        eager, static = eager_and_static(model, sampling, 12, compile=False, prompt_len=1)
        assert torch.equal(eager, static), sampling


def test_the_static_step_of_windows_and_linear_layers_traces_whole(monkeypatch):
    """fullgraph=True: dynamo traces the step of a window's ring and the linear layers' states without a break
    (with its eager backend: inductor's C++ costs 15-20 s cold here; the GPU tier compiles it), and the
    traced step draws the eager loop's tokens."""
    monkeypatch.setattr(generate, "STATIC_BACKEND", "eager")
    torch._dynamo.reset()
    model = build(pos_emb="rope", attn_pattern="SRDNM", n_layer=5, n_head=2, attn_window=4)  # every bounded kind
    eager, static = eager_and_static(model, Sampling(temperature=0.8, top_p=0.9), 20, compile=True)
    assert torch.equal(eager, static)


def test_a_kind_without_a_static_step_is_refused_in_one_line():
    """StaticCache is never inherited: a subclass that changes the math has no compiled step until it writes one."""
    import attention

    class Gated(attention.LinearAttention):
        letter, description = "Q", "a test's gated linear attention"

    attention.register(Gated)
    try:
        assert Gated.StaticCache is None and attention.LinearAttention.StaticCache is not None
        with pytest.raises(ValueError, match=r"Q \(a test's gated linear attention\) layers have none \(StaticCache"):
            generate.StaticDecode(build(pos_emb="rope", attn_pattern="QL"), Sampling())
    finally:
        del attention.KINDS["Q"]


def test_each_model_and_structure_gets_its_own_compiled_step(monkeypatch):
    """The compiled step skips guards on the modules' attributes (0.8 ms a token on a CPU), so it must never
    serve another model, or this one after its weights were quantised, relaid or moved."""
    monkeypatch.setattr(generate, "STATIC_BACKEND", "eager")
    a, b = build(), build()
    step = generate.compiled_step(a, "cpu")
    assert generate.compiled_step(a, "cpu") is step and generate.compiled_step(b, "cpu") is not step
    a.to(torch.bfloat16)
    assert generate.compiled_step(a, "cpu") is not step
    a.float()
    sampling = Sampling(temperature=0)
    idx = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(1))
    for model in (a, b):  # each its own tokens through its own step
        torch._dynamo.reset()
        assert torch.equal(generate.generate(model, idx, 10, sampling, step=generate.StaticDecode(model, sampling)),
                           model.generate(idx, 10, sampling))


def test_compile_keeps_the_compiled_step_only_where_it_measures_faster(monkeypatch):
    monkeypatch.setattr(generate, "STATIC_BACKEND", "eager")
    model = build()
    idx = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    sampling = Sampling(temperature=0.8, top_k=10)
    slow_down = lambda call: lambda *a, **k: (time.sleep(0.002), call(*a, **k))[1]  # noqa: E731
    with monkeypatch.context() as m:  # (the compiled function itself is traced: slowed outside it)
        m.setattr(generate.StaticDecode, "__call__", slow_down(generate.StaticDecode.__call__))
        step, line = generate.faster_static_step(model, idx, 20, sampling)
    assert step is None and "slower than eager here" in line and "decoding eager" in line
    with monkeypatch.context() as m:
        m.setattr(generate, "next_logits", slow_down(generate.next_logits))
        step, line = generate.faster_static_step(model, idx, 20, sampling)
    assert isinstance(step, generate.StaticDecode) and step.max_len == 25 and "faster than eager here" in line
    g = [torch.Generator().manual_seed(i) for i in range(2)]
    step.generator = g
    assert torch.equal(generate.generate(model, idx, 20, sampling, step=step, generator=g),
                       model.generate(idx, 20, sampling, generator=[torch.Generator().manual_seed(i) for i in range(2)]))
