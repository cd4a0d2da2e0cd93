"""attention/: the attention kinds (sliding windows and their rolling cache, causal linear attention's state)
and the registry: a kind registered from outside the project runs everywhere."""

from dataclasses import replace

import pytest
import torch

import attention
from attention.linear import linear_attention_chunk
from conftest import ROOT, TINY_RUN, build, run_main, tiny
from generate import Sampling, next_logits
from model import GPT, GPTConfig

SCHEMES = ["learned", "rope", "sinusoidal", "alibi", "t5", "none"]
RELATIVE = ["rope", "alibi", "t5", "none"]
GREEDY = Sampling(temperature=0)


def with_pattern(model, **keys):
    """The same weights with other attention keys (attn_pattern, attn_window)."""
    other = GPT(replace(model.config, **keys)).eval()
    other.load_state_dict(model.state_dict())
    return other


def steps_of(model):
    """Records the number of tokens of every forward through the model."""
    sizes, forward = [], model.hidden_states

    def recording(idx, kv_cache=None):
        sizes.append(idx.size(1))
        return forward(idx, kv_cache)

    model.hidden_states = recording
    return sizes


# ---------------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(attn_pattern="LX"), "attn_pattern='LX': each letter must be one of L .* got 'X'"),
        (dict(attn_pattern=""), "attn_pattern='': each letter must be one of L"),
        (dict(attn_pattern="SL"), "attn_pattern='SL' has sliding-window layers \\(S\\): set attn_window"),
        (dict(attn_pattern="S", attn_window=0), "attn_window=0 must be a positive integer"),
        (dict(attn_window=16), "attn_window=16 is set but attn_pattern='L' has no S layer"),
        (dict(attn_pattern="RL", pos_emb="alibi"), "never form the score matrix that pos_emb='alibi'"),
        (dict(attn_pattern="R", pos_emb="t5"), "pos_emb='t5'"),
        (dict(attn_pattern="R", pos_emb="rope", rope_scaling="linear", rope_factor=2.0), "RoPE is not scaled"),
        (dict(norm_placement="middle"), "norm_placement='middle' is not one of 'pre', 'post'"),
        (dict(label_smoothing=1.0), "label_smoothing=1.0 must be in \\[0, 1\\)"),
    ],
)
def test_bad_attention_keys_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=32, **overrides)


def test_pattern_tiles_over_the_layers():
    config = GPTConfig(n_layer=6, n_head=2, n_embd=16, attn_pattern="SSSL", attn_window=4)
    assert config.layer_kinds == "SSSLSS"
    model = GPT(replace(config, vocab_size=61, block_size=16))
    assert [b.attn.window for b in model.blocks] == [4, 4, 4, None, 4, 4]
    assert GPTConfig(n_layer=3, n_head=2, n_embd=16, attn_pattern="RL").layer_kinds == "RLR"


# ---------------------------------------------------------------------------------------------------
# Sliding windows


@pytest.mark.parametrize("pos_emb", SCHEMES)
def test_window_sdpa_matches_explicit_and_the_rolling_cache(pos_emb):
    keys = dict(pos_emb=pos_emb, n_kv_head=2, attn_pattern="SL", attn_window=6)
    sdpa, explicit = build(**keys), build(attn_impl="explicit", **keys)
    idx = torch.randint(0, 61, (3, 32))
    reference = explicit(idx)[0]
    torch.testing.assert_close(sdpa(idx)[0], reference, rtol=0, atol=1e-5)
    # through the cache: a prefill, chunks longer and shorter than the window, single tokens
    for model in (sdpa, explicit):
        cache = model.new_cache()
        spans = [(0, 10), (10, 12), (12, 13), (13, 21), (21, 22), (22, 32)]
        chunks = [model(idx[:, a:b], kv_cache=cache)[0] for a, b in spans]
        torch.testing.assert_close(torch.cat(chunks, dim=1), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("pos_emb", RELATIVE)
def test_a_window_sees_exactly_itself_and_the_window_minus_one_before(pos_emb):
    # one windowed layer at position i computes what full attention computes over tokens i-4..i alone
    windowed = build(n_layer=1, n_kv_head=2, pos_emb=pos_emb, attn_pattern="S", attn_window=5)
    full = with_pattern(windowed, attn_pattern="L", attn_window=None)
    idx = torch.randint(0, 61, (2, 20))
    out = windowed(idx)[0]
    for i in range(20):
        torch.testing.assert_close(out[:, i], full(idx[:, max(0, i - 4) : i + 1])[0][:, -1], rtol=0, atol=1e-5)
    assert (out[:, 10:] - full(idx)[0][:, 10:]).abs().max() > 1e-3  # and the window is not full attention


@pytest.mark.parametrize("pos_emb", RELATIVE)
def test_windowed_model_generates_past_block_size_one_step_per_token(pos_emb):
    model = build(pos_emb=pos_emb, attn_pattern="S", attn_window=8, n_kv_head=2)
    assert model.config.context_limit is None
    prompt = torch.randint(0, 61, (2, 5))
    sizes = steps_of(model)
    cached = model.generate(prompt, 4 * 32, GREEDY)
    assert sizes == [5] + [1] * (4 * 32 - 1)  # no recompute past block_size=32
    uncached = model.generate(prompt, 4 * 32, GREEDY, use_cache=False)  # the whole sequence every step
    assert torch.equal(cached, uncached)


def cache_bytes_while_decoding(model, n):
    """Decodes n tokens greedily from one token through the cache; returns {length: bytes held}."""
    seq = torch.zeros(1, n + 1, dtype=torch.long)
    cache, held = model.new_cache(), {}
    with torch.no_grad():
        for length in range(1, n + 1):
            seq[0, length] = next_logits(model, seq, length, cache).argmax()
            held[cache.length] = cache.nbytes()
    return held


@pytest.mark.parametrize("pattern", ["S", "R", "SR", "D", "N", "M"])
def test_cache_memory_is_bounded_by_the_window_or_the_state(pattern):
    model = build(pos_emb="rope", attn_pattern=pattern, attn_window=8 if "S" in pattern else None)
    held = cache_bytes_while_decoding(model, 4 * 32)
    assert held[32] == held[4 * 32] > 0
    full = cache_bytes_while_decoding(build(pos_emb="rope", block_size=128), 4 * 32)
    assert full[4 * 32] == 4 * full[32]  # where full attention's grows with the text


def test_speculative_decoding_rolls_a_window_back():
    import speculative

    model = build(pos_emb="rope", attn_pattern="S", attn_window=4)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    plain = model.generate(prompt, 90, GREEDY)
    draft = speculative.NgramDraft(num_draft=3)
    assert torch.equal(speculative.generate(model, prompt, 90, GREEDY, draft), plain)
    assert draft.proposed > 0


# ---------------------------------------------------------------------------------------------------
# Causal linear attention


def test_linear_attention_chunk_is_the_causal_sum():
    torch.manual_seed(0)
    q, k, v = (torch.rand(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    rq, rk = torch.randn_like(q), torch.randn_like(k)  # rotated stand-ins: the numerator's only
    y, (S, z) = linear_attention_chunk(q, k, rq, rk, v, None, eps=0.0)
    for i in range(7):
        numerator = sum((rq[:, :, i] * rk[:, :, j]).sum(-1, keepdim=True) * v[:, :, j] for j in range(i + 1))
        denominator = sum((q[:, :, i] * k[:, :, j]).sum(-1, keepdim=True) for j in range(i + 1))
        torch.testing.assert_close(y[:, :, i], numerator / denominator)
    torch.testing.assert_close(S, rk.transpose(-2, -1) @ v)
    torch.testing.assert_close(z, k.sum(2))


@pytest.mark.parametrize("letter", ["R", "D", "N", "M"])
@pytest.mark.parametrize("pos_emb", ["rope", "none", "learned", "sinusoidal"])
def test_linear_attention_recurrent_decode_equals_parallel_form(pos_emb, letter):
    # block_size 160 spans three chunks of 64 in the parallel form; decoding carries only the state
    model = build(pos_emb=pos_emb, block_size=160, n_kv_head=2, attn_pattern=letter + "L" if pos_emb == "learned" else letter)
    idx = torch.randint(0, 61, (2, 160))
    parallel = model(idx)[0]
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(idx[:, :37], kv_cache=cache)[0]] + [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(37, 160)]
    torch.testing.assert_close(torch.cat(steps, dim=1), parallel, rtol=0, atol=1e-5)


@pytest.mark.parametrize("letter", ["R", "D", "N", "M"])
@pytest.mark.parametrize("pos_emb", ["rope", "none"])
def test_linear_model_decodes_past_block_size_one_step_per_token(pos_emb, letter):
    model = build(pos_emb=pos_emb, attn_pattern=letter, n_kv_head=2)
    prompt = torch.randint(0, 61, (2, 5))
    sizes = steps_of(model)
    cached = model.generate(prompt, 3 * 32, GREEDY)
    assert sizes == [5] + [1] * (3 * 32 - 1)
    assert torch.equal(cached, model.generate(prompt, 3 * 32, GREEDY, use_cache=False))


def test_hybrid_with_absolute_positions_keeps_block_size():
    model = build(attn_pattern="RRRL")
    assert model.config.context_limit == 32
    prompt = torch.randint(0, 61, (1, 5))
    assert torch.equal(model.generate(prompt, 40, GREEDY), model.generate(prompt, 40, GREEDY, use_cache=False))


def test_linear_state_cannot_roll_back_and_speculation_says_so():
    import speculative
    from configurator import ConfigError

    model = build(attn_pattern="R")
    cache = model.new_cache()
    model(torch.randint(0, 61, (1, 6)), kv_cache=cache)
    with pytest.raises(ValueError, match="cannot roll back to 4"):
        cache.rewind(4)
    with pytest.raises(ConfigError, match="causal linear attention\\) layers .* cannot roll back rejected drafts"):
        speculative.generate(model, torch.zeros(1, 3, dtype=torch.long), 5, GREEDY, speculative.NgramDraft())


@pytest.mark.parametrize("pattern", ["RL", "DL", "NL", "ML"])
def test_linear_attention_trains(pattern):
    model = build(pos_emb="rope", attn_pattern=pattern).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 61, (4, 32))
    losses = []
    for _ in range(30):
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------------------------------------------
# Rows of different sequences in one step (a server's batch)


@pytest.mark.parametrize("keys", [dict(), dict(pos_emb="rope", attn_pattern="SL", attn_window=4), dict(pos_emb="alibi"),
                                  dict(pos_emb="rope", attn_pattern="RL"), dict(pos_emb="t5", norm_placement="post")],
                         ids=["learned", "windows", "alibi", "linear", "t5-post"])
def test_decode_rows_steps_each_row_as_if_alone(keys):
    model = build(n_kv_head=2, **keys)
    seqs = [torch.randint(0, 61, (1, n)) for n in (3, 9, 17)]  # three rows at three positions
    caches = [model.new_cache() for _ in seqs]
    with torch.no_grad():
        for seq, cache in zip(seqs, caches):
            model.forward_cached(seq[:, :-1], cache)
        rows = model.decode_rows(torch.cat([seq[:, -1:] for seq in seqs]), caches)
    assert [cache.length for cache in caches] == [3, 9, 17]
    torch.testing.assert_close(rows, torch.cat([model(seq)[0][:, -1] for seq in seqs]), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# A kind registered from outside the project: the guide's worked example, run as written there


def guide_block(heading):
    """The first ```python block after `heading` in docs/guide.md."""
    text = (ROOT / "docs" / "guide.md").read_text()
    return text[text.index(heading):].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture
def gated_kind():
    """The guide's OutputGatedLinearAttention, registered as "G" for one test and removed afterwards."""
    import attention

    before = dict(attention.KINDS)
    namespace = {}
    exec(compile(guide_block("### Adding an attention kind"), "docs/guide.md", "exec"), namespace)
    kind = namespace["OutputGatedLinearAttention"]
    try:
        yield kind
    finally:
        attention.KINDS.clear()
        attention.KINDS.update(before)


def test_a_kind_registered_from_outside_runs_everywhere(gated_kind):
    """A subclass of a registered kind with a letter of its own, from tests/ with no project file edited:
    the model builds, its gates reach the output and get gradients, one training step runs, generation
    with the cache equals generation without it (with a full layer beside it, and alone past block_size),
    decode_rows equals each row alone, and its FLOPs are its parent's."""
    import attention

    assert issubclass(gated_kind, attention.KINDS["R"]) and attention.KINDS["G"] is gated_kind
    model = build(n_layer=2, attn_pattern="LG", pos_emb="rope")
    assert isinstance(model.blocks[1].attn, gated_kind) and model.blocks[1].attn.gate.weight.shape == (4, 32)
    x, y = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, loss = model(x, y)
    loss.backward()
    assert model.blocks[1].attn.gate.weight.grad.abs().sum() > 0  # the gate is in the forward pass
    optimizer.step()
    assert torch.isfinite(model(x, y)[1]) and model(x, y)[1] < loss
    model.eval()
    prompt = torch.randint(0, 61, (2, 5))
    for m in (model, build(n_layer=2, attn_pattern="G", pos_emb="rope")):  # the second runs past block_size
        m.eval()
        cached = m.generate(prompt, 40, GREEDY)
        assert torch.equal(cached, m.generate(prompt, 40, GREEDY, use_cache=False))
    assert model.config.context_limit == 32 and build(attn_pattern="G", pos_emb="rope").config.context_limit is None
    import train

    assert "G output-gated linear attention" in next(k.help for k in train.config_keys() if k.name == "attn_pattern")
    seqs = [torch.randint(0, 61, (1, n)) for n in (3, 7)]
    caches = [model.new_cache() for _ in seqs]
    for seq, cache in zip(seqs, caches):
        model.forward_cached(seq[:, :-1], cache)
    rows = model.decode_rows(torch.cat([seq[:, -1:] for seq in seqs]), caches)
    for row, seq in zip(rows, seqs):
        torch.testing.assert_close(row, model(seq)[0][0, -1], rtol=0, atol=1e-5)
    matmuls = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.flops_per_token(100) == 6 * matmuls + 12 * 32 * (100 + (64 + 8))  # L: all 100 keys; G: chunk + head


COPIED = {"L": {}, "S": dict(attn_window=5), "R": dict(pos_emb="rope"), "D": dict(pos_emb="rope"), "N": dict(pos_emb="none"),
          "M": dict(pos_emb="none")}


@pytest.mark.parametrize("letter", list(COPIED))
def test_a_kind_copied_under_a_new_letter_builds_trains_and_gives_its_logits(letter):
    """Every built-in kind, subclassed from outside under a new letter with nothing else changed: the model
    builds with the copy's weights in the same places, gives the original's logits bit for bit (cached
    generation included), and one training step moves both alike. What registration does not inherit
    (exports_as, StaticCache) stays off for the copy."""
    import attention

    copy = type(f"Copy{letter}", (attention.KINDS[letter],), {"letter": "X", "description": f"a copy of {letter}"})
    attention.register(copy)
    try:
        keys = dict(n_layer=2, **COPIED[letter])
        original, twin = build(attn_pattern=f"L{letter}", **keys), build(attn_pattern="LX", **keys)
        twin.load_state_dict(original.state_dict())  # strict: the same parameters under the same names
        assert type(twin.blocks[1].attn) is copy and copy.exports_as is None and copy.StaticCache is None
        x, y = torch.randint(0, 61, (2, 20)), torch.randint(0, 61, (2, 20))
        assert torch.equal(original(x)[0], twin(x)[0])
        losses = []
        for model in (original, twin):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            loss = model(x, y)[1]
            loss.backward()
            optimizer.step()
            losses.append((loss.item(), model(x, y)[1].item()))
        assert losses[0] == losses[1] and losses[0][1] < losses[0][0]
        original.eval(), twin.eval()
        assert torch.equal(original.generate(x[:, :4], 12, GREEDY), twin.generate(x[:, :4], 12, GREEDY))
    finally:
        attention.KINDS.pop("X", None)


def test_a_plug_in_that_breaks_the_protocol_fails_at_its_boundary():
    """A kind whose mix returns the wrong shape is named when its layer runs (not deep inside SDPA), and a
    cache class without the protocol's attributes is refused when the kind registers."""
    import attention

    class Flat(attention.KINDS["L"]):
        letter, description = "X", "a test's kind that forgets its heads"

        def mix(self, q, k, v, gates, start, mask, cache, positions):
            return super().mix(q, k, v, gates, start, mask, cache, positions).transpose(1, 2)

    class NoRewind:
        bounded = False

    class Uncached(attention.KINDS["L"]):
        letter, description, Cache = "Y", "a test's kind with half a cache", NoRewind

    attention.register(Flat)
    try:
        with pytest.raises(ValueError, match=r"attention kind X \(Flat\): mix/decode_one returned \(2, 12, 4, 8\)"):
            build(n_layer=1, attn_pattern="X")(torch.randint(0, 61, (2, 12)))
        with pytest.raises(ValueError, match="Uncached.Cache=NoRewind lacks rewinds, rewind, nbytes"):
            attention.register(Uncached)
        assert "Y" not in attention.KINDS
    finally:
        attention.KINDS.pop("X", None)


def test_a_kind_registered_from_outside_trains_samples_and_is_refused_speculation(gated_kind, char_dataset, tmp_path):
    """The same kind through the scripts: train.py trains and checkpoints it, sample.py samples from the
    checkpoint, and speculative decoding refuses it in one line because its cache cannot roll back."""
    out = tmp_path / "run"
    trained = run_main("train.py", *TINY_RUN, "--attn_pattern=LG", "--pos_emb=rope", "--max_iters=3",
                       f"--dataset={char_dataset}", f"--out_dir={out}")
    assert trained.returncode == 0, trained.stderr
    common = (f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=10", "--temperature=0")
    sampled = run_main("sample.py", *common)
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr
    refused = run_main("sample.py", *common, "--draft=ngram")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "G (output-gated linear attention) layers (attn_pattern='LG'), whose cache cannot roll back" in refused.stderr


def test_register_refuses_a_taken_or_bad_letter():
    import attention

    class Again(attention.KINDS["L"]):
        letter = "L"

    with pytest.raises(ValueError, match="attention kind 'L' is taken by FullAttention"):
        attention.register(Again)
    Again.letter = "Q"  # a subclass may change the math: it exports as nothing unless it says otherwise
    try:
        attention.register(Again)
        assert Again.exports_as is None and attention.KINDS["L"].exports_as == "full"
        from hf import family

        assert family(tiny(attn_pattern="Q", pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)) is None
        assert family(tiny(attn_pattern="L", pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)) == "llama"
    finally:
        del attention.KINDS["Q"]
    Again.letter = "LL"
    with pytest.raises(ValueError, match="Again.letter='LL': a kind's letter is one letter"):
        attention.register(Again)
    assert attention.KINDS["L"] is not Again


# ---------------------------------------------------------------------------------------------------
# FlexAttention: the GPU path of windows and position biases, its forward checked here on CPU


FLEX_CASES = {  # the model (heads of 16: FlexAttention's least), and how many of its layers FlexAttention runs
    "window": (dict(attn_pattern="SL", attn_window=5, n_head=2), 1),  # (a plain causal L layer: SDPA's flash)
    "alibi": (dict(pos_emb="alibi", n_head=2), 2),
    "t5 window gqa": (dict(pos_emb="t5", attn_pattern="S", attn_window=9, n_head=2, n_kv_head=1), 2),
}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the unfused form, on purpose
@pytest.mark.parametrize("case, flex_layers", FLEX_CASES.values(), ids=FLEX_CASES.keys())
def test_flex_attention_forward_equals_sdpa_with_the_dense_mask(monkeypatch, case, flex_layers):
    """Where FlexAttention runs (a GPU's training forward), its block masks and score_mods are the dense
    masks' and biases' (torch 2.13 has its forward on CPU, not its backward: weights frozen here).
    Evaluation (no gradients), other lengths and narrow heads keep the dense mask."""
    from torch.nn.attention.flex_attention import flex_attention

    model = build(**case).requires_grad_(False)
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.block_size), generator=torch.Generator().manual_seed(0))
    dense = model(idx)[0]
    monkeypatch.setattr(attention.kernels, "FLEX_DEVICES", ("cpu",))
    # the unfused form of the same mask_mod and score_mod: their semantics (compiled, the whole model gave
    # the same to 1.2e-7 on CPU; compiling costs 15-20 s cold here, and the GPU tier compiles it)
    monkeypatch.setattr(attention.kernels, "flex_kernel", lambda: flex_attention)
    calls = []
    monkeypatch.setattr(attention.kernels, "attention_flex", lambda *a: calls.append(a[3]) or real_flex(*a))
    flex = model(idx)[0]
    assert len(calls) == flex_layers and all(isinstance(m, attention.kernels.FlexMask) for m in calls)
    assert (flex - dense).abs().max().item() < 1e-5
    q = torch.randn(2, model.config.n_head, idx.size(1), 16)  # the explicit path (interpret.py) takes it densely
    assert torch.equal(attention.attention_scores(q, q, calls[0]), attention.attention_scores(q, q, calls[0].dense()))
    with torch.no_grad():
        model(idx)
    shorter = model(idx[:, :-1])[0]
    narrow = build(**{**case, "n_head": 4}).requires_grad_(False)(idx)[0]
    assert len(calls) == flex_layers and torch.allclose(shorter, dense[:, :-1], atol=1e-5) and narrow.isfinite().all()


real_flex = attention.kernels.attention_flex


# ---------------------------------------------------------------------------------------------------
# Retention (D): linear attention with a fixed decay per head


@pytest.mark.parametrize("gates", ["per head (retention)", "per token (Mamba-2, GLA)"])
def test_a_decaying_chunked_form_is_its_recurrence_and_the_naive_sum(gates):
    from attention.linear import decay_chunk

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 70, 5, generator=g, dtype=torch.float64) for _ in range(3))
    if gates.startswith("per head"):  # short memories: the decay shows
        log_gate = torch.log1p(-(2.0 ** (-1.0 - torch.arange(3, dtype=torch.float64))))[None, :, None].expand(2, 3, 70)
    else:
        log_gate = -torch.nn.functional.softplus(torch.randn(2, 3, 70, generator=g, dtype=torch.float64))
    expected = torch.zeros_like(v)  # y_t = sum_{j<=t} (prod_{j<s<=t} a_s) (q_t . k_j) v_j, as written
    for t in range(70):
        for j in range(t + 1):
            w = log_gate[:, :, j + 1 : t + 1].sum(-1, keepdim=True).exp() * (q[:, :, t] * k[:, :, j]).sum(-1, keepdim=True)
            expected[:, :, t] += w * v[:, :, j]
    state, chunked = None, []
    for a in range(0, 70, 16):  # chunks of 16, the state carried across
        part = slice(a, a + 16)
        y, state = decay_chunk(q[:, :, part], k[:, :, part], v[:, :, part], log_gate[:, :, part], state)
        chunked.append(y)
    torch.testing.assert_close(torch.cat(chunked, 2), expected, rtol=0, atol=1e-10)
    S = torch.zeros(2, 3, 5, 5, dtype=torch.float64)
    recurrent = []
    for t in range(70):  # one token at a time: S = a_t S + k^T v, y = q S
        S = log_gate[:, :, t, None, None].exp() * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        recurrent.append((q[:, :, t, None] @ S))
    torch.testing.assert_close(torch.cat(recurrent, 2), expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, S, rtol=0, atol=1e-10)


def test_retention_refuses_bias_positions_and_speculation():
    import speculative
    from configurator import ConfigError

    with pytest.raises(ValueError, match="never form the score matrix that pos_emb='alibi'"):
        GPTConfig(n_layer=1, n_head=2, n_embd=16, attn_pattern="D", pos_emb="alibi")
    model = build(pos_emb="rope", attn_pattern="DL")
    with pytest.raises(ConfigError, match="D \\(linear attention with a fixed decay per head"):
        speculative.generate(model, torch.zeros(1, 3, dtype=torch.long), 5, GREEDY, speculative.NgramDraft())


# ---------------------------------------------------------------------------------------------------
# The gated delta rule's core (attention.delta.gated_delta_chunk), against a naive loop and transformers'


def gated_delta_inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, Dk, Dv = 2, 3, 8, 6
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, T, Dk, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=dtype)
    gate = -torch.nn.functional.softplus(torch.randn(B, H, T, generator=g, dtype=dtype))  # log a_t <= 0
    beta = torch.sigmoid(torch.randn(B, H, T, generator=g, dtype=dtype))
    return q * Dk**-0.5, k, v, gate, beta


def naive_gated_delta(q, k, v, gate, beta):
    """The recurrence as written: forget, read what the state predicts for k_t, correct it toward v_t, read."""
    S = torch.zeros(q.size(0), q.size(1), k.size(-1), v.size(-1), dtype=q.dtype)
    ys = []
    for t in range(q.size(2)):
        S = gate[:, :, t, None, None].exp() * S
        predicted = (k[:, :, t, None, :] @ S)[:, :, 0]
        S = S + k[:, :, t, :, None] * (beta[:, :, t, None] * (v[:, :, t] - predicted))[:, :, None, :]
        ys.append((q[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(ys, 2), S


def chunked_gated_delta(q, k, v, gate, beta, chunk):
    state, ys = None, []
    for a in range(0, q.size(2), chunk):
        part = slice(a, a + chunk)
        y, state = attention.delta.gated_delta_chunk(q[:, :, part], k[:, :, part], v[:, :, part], gate[:, :, part], beta[:, :, part], state)
        ys.append(y)
    return torch.cat(ys, 2), state


def test_the_gated_delta_rules_chunked_form_is_its_recurrence():
    q, k, v, gate, beta = gated_delta_inputs(70, torch.float64)
    y, S = naive_gated_delta(q, k, v, gate, beta)
    for chunk in (1, 16, 64):  # 1: the decoded token's recurrence
        yc, Sc = chunked_gated_delta(q, k, v, gate, beta, chunk)
        torch.testing.assert_close(yc, y, rtol=0, atol=1e-10)
        torch.testing.assert_close(Sc, S, rtol=0, atol=1e-10)


def test_the_gated_delta_rule_equals_transformers_qwen3_next_reference():
    """transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule (Qwen3-Next's torch
    fallbacks; they take (B, T, H, D), scale q by Dk^-1/2 themselves and L2-normalise with use_qk_l2norm_in_kernel)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, gate, beta = gated_delta_inputs(100, torch.float32, seed=1)
    q = q * q.size(-1) ** 0.5  # theirs scales q
    ours, our_state = chunked_gated_delta(q * q.size(-1) ** -0.5, k, v, gate, beta, 64)
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    for reference in (qwen3_next.torch_chunk_gated_delta_rule, qwen3_next.torch_recurrent_gated_delta_rule):
        theirs, their_state = reference(t(q), t(k), t(v), t(gate), t(beta), output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(t(theirs), ours, rtol=0, atol=1e-5)
        torch.testing.assert_close(their_state, our_state, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# N: the gated delta rule layer (attention.GatedDeltaNet), against transformers' Qwen3NextGatedDeltaNet


def qwen3_next_twin(attn):
    """transformers' Qwen3NextGatedDeltaNet holding our layer's weights (its projections interleave q, k,
    v, z and b, a per key head group)."""
    qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    hd, n_v, n_k = attn.head_dim, attn.n_head, attn.n_kv_head
    config = Qwen3NextConfig(hidden_size=attn.proj.out_features, linear_num_value_heads=n_v, linear_num_key_heads=n_k,
                             linear_key_head_dim=hd, linear_value_head_dim=hd, linear_conv_kernel_dim=attn.conv_kernel,
                             rms_norm_eps=1e-6, hidden_act="silu", num_hidden_layers=1, layer_types=["linear_attention"])
    twin = qwen3_next.Qwen3NextGatedDeltaNet(config, 0).eval()
    r = n_v // n_k
    wq, wk, wv = attn.qkv.weight.detach().split([n_k * hd, n_k * hd, n_v * hd])
    wz, (wb, wa) = attn.z.weight.detach(), attn.ba.weight.detach().chunk(2)
    groups = lambda w, size: w.split(size)  # noqa: E731
    qkvz = [torch.cat(parts) for parts in zip(groups(wq, hd), groups(wk, hd), groups(wv, r * hd), groups(wz, r * hd))]
    ba = [torch.cat(parts) for parts in zip(groups(wb, r), groups(wa, r))]
    with torch.no_grad():
        twin.in_proj_qkvz.weight.copy_(torch.cat(qkvz))
        twin.in_proj_ba.weight.copy_(torch.cat(ba))
        twin.conv1d.weight.copy_(attn.conv.weight)
        twin.dt_bias.copy_(attn.dt_bias)
        twin.A_log.copy_(attn.A_log)
        twin.norm.weight.copy_(attn.out_norm.weight)
        twin.out_proj.weight.copy_(attn.proj.weight)
    return twin


@pytest.mark.parametrize("n_kv_head", [4, 2])  # 2: two value heads per key head (Qwen3-Next's grouping)
def test_the_gated_delta_rule_layer_equals_qwen3_nexts(n_kv_head):
    torch.manual_seed(0)
    model = build(pos_emb="rope", attn_pattern="N", n_kv_head=n_kv_head, block_size=160, bias=False)
    attn = model.blocks[0].attn
    with torch.no_grad():
        for p in (attn.dt_bias, attn.out_norm.weight):
            p.uniform_(0.5, 1.5)  # not their initial ones: a mapping that swapped them would show
    twin = qwen3_next_twin(attn)
    x = torch.randn(2, 150, model.config.n_embd)  # three chunks
    with torch.no_grad():
        ours = attn(x, model.positions, 0, None, None)
        theirs = twin(x)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    # and the gradients training follows (a detached gate or beta would train a different layer)
    xa, xb, w = x.clone().requires_grad_(), x.clone().requires_grad_(), torch.randn_like(x)
    (attn(xa, model.positions, 0, None, None) * w).sum().backward()
    (twin.train()(xb) * w).sum().backward()
    pairs = [(xa, xb), (attn.A_log, twin.A_log), (attn.dt_bias, twin.dt_bias), (attn.conv.weight, twin.conv1d.weight),
             (attn.out_norm.weight, twin.norm.weight), (attn.proj.weight, twin.out_proj.weight)]
    for a, b in pairs:
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-5)


def test_the_gated_delta_rule_layer_refuses_speculation():
    import speculative
    from configurator import ConfigError

    model = build(pos_emb="rope", attn_pattern="NL", n_kv_head=2)
    with pytest.raises(ConfigError, match="N \\(gated delta rule"):
        speculative.generate(model, torch.zeros(1, 3, dtype=torch.long), 5, GREEDY, speculative.NgramDraft())


@pytest.mark.parametrize("letter", ["N", "M"])
def test_the_gated_kinds_start_with_a_memory(letter):
    """Mamba-2's initialisation: e^g = e^{-A dt} with dt in [0.001, 0.1] and A in [1, 16], so a state keeps
    1 to 1,000 tokens at the start (dt_bias = 1 forgot nearly everything each token, and recall stayed at
    chance on MQAR)."""
    model = build(pos_emb="rope", attn_pattern=letter)
    with torch.no_grad():
        g = model.blocks[0].attn.gates(torch.randn(2, 16, model.config.n_embd))[2]
    keep = g.exp()
    assert 0.5 < keep.median() and keep.max() < 1 and keep.min() > 0.1


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_one_query_attention_of_the_compiled_cpu_step_is_the_textbooks(heads):
    """What a compiled CPU decode step computes in place of SDPA: rowdot.cpp's one_query_attention where
    quantize.py built it, else attention.kernels.attention_one_query; both for a boolean mask of the static
    cache's filled slots and for a position bias holding -inf there (per head, or one for all heads)."""
    import quantize
    from attention.kernels import ONE_QUERY, attention_explicit, attention_one_query

    quantize.rowdot_kernel()
    H, Hkv = heads
    g = torch.Generator().manual_seed(H + Hkv)
    q, k, v = torch.randn(2, H, 1, 16, generator=g), torch.randn(2, Hkv, 9, 16, generator=g), torch.randn(2, Hkv, 9, 16, generator=g)
    seen = torch.rand(2, 1, 1, 9, generator=g) > 0.3
    seen[..., 0] = True
    bias = torch.randn(2, H, 1, 9, generator=g).masked_fill(~seen, float("-inf"))
    for way in [attention_one_query] + ([ONE_QUERY["op"]] if "op" in ONE_QUERY else []):
        for mask in (seen, bias, bias[:, :1]):
            torch.testing.assert_close(way(q, k, v, mask), attention_explicit(q, k, v, mask), atol=1e-6, rtol=1e-5)
