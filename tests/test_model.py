import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from configurator import ConfigError
from device import estimate_mfu
from generate import Sampling, filter_logits, sample_next
from model import GPT, GPTConfig, gelu_tanh, gelu_tanh_as_sigmoid, lm_loss
from optim import adamw_everywhere
from positions import RotaryPositions, alibi_slopes
import quantize
from quantize import Int8Linear, for_inference, quantize_int8

SCHEMES = ["learned", "rope", "sinusoidal", "alibi", "t5", "none"]

GREEDY = Sampling(temperature=0)


def tiny(**overrides):
    base = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    base.update(overrides)
    return GPTConfig(**base)


def build(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(tiny(**overrides)).eval()


# ---------------------------------------------------------------------------------------------------
# Config validation


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_embd=30, n_head=4), "n_embd=30 must be divisible by n_head=4"),
        (dict(n_head=4, n_kv_head=3), "n_head=4 must be divisible by n_kv_head=3"),
        (dict(n_embd=36, n_head=4, pos_emb="rope"), "needs an even head size"),
        (dict(pos_emb="rotary"), "pos_emb='rotary' is not one of 'learned', 'rope', 'sinusoidal', 'alibi', 't5', 'none'"),
        (dict(norm="batchnorm"), "norm='batchnorm' is not one of 'layernorm', 'rmsnorm'"),
        (dict(mlp="geglu"), "mlp='geglu' is not one of"),
        (dict(attn_impl="flash"), "attn_impl='flash' is not one of 'sdpa', 'explicit'"),
        (dict(dropout=1.0), "dropout=1.0 must be in [0, 1)"),
        (dict(z_loss=-1e-4), "z_loss=-0.0001 must be >= 0"),
        (dict(n_layer=0), "n_layer=0 must be a positive integer"),
    ],
)
def test_invalid_config_names_field(overrides, message):
    with pytest.raises(ValueError) as err:
        tiny(**overrides)
    assert str(err.value).startswith("GPTConfig.") and message in str(err.value)


def test_defaults_resolved():
    assert tiny().n_kv_head == 4
    assert tiny().mlp_hidden == 128
    assert tiny(mlp="swiglu").mlp_hidden == 128  # 8/3 * 32 = 85.3, rounded up to a multiple of 64
    assert tiny(mlp="swiglu", n_embd=96).mlp_hidden == 256


def test_gpt2_small_parameter_count():
    config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=True,
                       pos_emb="learned", norm="layernorm", mlp="gelu", tie_embeddings=True)
    with torch.device("meta"):
        model = GPT(config)
    assert model.get_num_params() == 124_439_808
    assert model.get_num_params(non_embedding=True) == 124_439_808 - 1024 * 768


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=8, n_embd=256, n_head=4))
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.blocks[3].attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_tied_and_untied_head():
    tied = build(tie_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.tok_emb.weight.data_ptr()
    untied = build(tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert untied.get_num_params() == tied.get_num_params() + 61 * 32


def test_optimizer_decays_matrices_only():
    model = build(mlp="swiglu", norm="rmsnorm", qk_norm=True)
    (opt,) = adamw_everywhere(model, SimpleNamespace(weight_decay=0.1, learning_rate=1e-3, beta1=0.9, beta2=0.95), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert opt.defaults["fused"] is True


# ---------------------------------------------------------------------------------------------------
# Attention and positions


@pytest.mark.parametrize("pos_emb", SCHEMES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_causal(pos_emb, qk_norm):
    model = build(pos_emb=pos_emb, qk_norm=qk_norm, n_kv_head=2)
    idx = torch.randint(0, 61, (2, 20))
    changed = idx.clone()
    changed[:, 11:] = torch.randint(0, 61, (2, 9))
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :11], b[:, :11], rtol=0, atol=0)
    assert (a[:, 11:] - b[:, 11:]).abs().max() > 1e-3


def test_rope_scores_depend_only_on_offset():
    rope = RotaryPositions(tiny(pos_emb="rope", block_size=64))
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(q_pos, k_pos):
        q_rot, _ = rope.rotate(q, q, q_pos)
        _, k_rot = rope.rotate(k, k, k_pos)
        return (q_rot * k_rot).sum().item()

    for offset in (0, 3, 17):
        reference = score(offset, 0)
        for shift in (1, 10, 40):
            assert score(offset + shift, shift) == pytest.approx(reference, abs=1e-5)
    assert abs(score(5, 0) - score(9, 0)) > 1e-3  # and it does depend on the offset


@pytest.mark.parametrize("pos_emb", SCHEMES)
def test_sdpa_matches_explicit(pos_emb):
    sdpa = build(pos_emb=pos_emb, n_kv_head=2, qk_norm=True)
    explicit = build(pos_emb=pos_emb, n_kv_head=2, qk_norm=True, attn_impl="explicit")
    idx = torch.randint(0, 61, (3, 32))
    torch.testing.assert_close(sdpa(idx)[0], explicit(idx)[0], rtol=0, atol=1e-5)
    # and through the cache: a prefill, a chunk of several tokens (explicit mask) and single tokens
    for model in (sdpa, explicit):
        cache = model.new_cache(32)
        chunks = [model(idx[:, a:b], kv_cache=cache)[0] for a, b in [(0, 10), (10, 15), (15, 16), (16, 32)]]
        torch.testing.assert_close(torch.cat(chunks, dim=1), sdpa(idx)[0], rtol=0, atol=1e-5)


def test_alibi_slopes():
    assert alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    # 6 heads: the 4-head sequence, then every other slope of the 8-head one
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


def test_sequence_longer_than_block_is_refused():
    model = build()
    with pytest.raises(ValueError, match="longer than block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------
# Loss


def test_z_loss_zero_is_plain_cross_entropy():
    model = build(z_loss=0.0)
    idx, targets = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    logits, loss = model(idx, targets)
    assert torch.equal(loss, F.cross_entropy(logits.view(-1, 61), targets.view(-1)))


def test_z_loss_adds_stated_term():
    model = build(z_loss=1e-2)
    idx, targets = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    targets[0, :4] = -1  # ignored positions count in neither term
    logits, loss = model(idx, targets)
    flat, flat_targets = logits.view(-1, 61), targets.view(-1)
    ce = F.cross_entropy(flat, flat_targets, ignore_index=-1)
    z = torch.logsumexp(flat[flat_targets != -1], dim=-1).square().mean()
    torch.testing.assert_close(loss, ce + 1e-2 * z)
    total, plain = lm_loss(logits, targets, 1e-2)
    torch.testing.assert_close(plain, ce)
    assert total.item() > plain.item()


# ---------------------------------------------------------------------------------------------------
# Generation


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
    model = build(pos_emb="rope")
    prompt = torch.randint(0, 61, (1, 50))
    cached = model.generate(prompt, 5, GREEDY)
    uncached = model.generate(prompt, 5, GREEDY, use_cache=False)
    assert torch.equal(cached, uncached) and torch.equal(cached[:, :50], prompt)


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


def test_estimate_mfu():
    model = build()
    assert estimate_mfu(model, 1000.0, 32, device="cpu") is None
    flops = model.flops_per_token(32)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops == 6 * matmul + 12 * 2 * 32 * 32
    assert estimate_mfu(model, 1000.0, 32, peak_flops=flops * 2000.0) == pytest.approx(0.5)


@pytest.mark.parametrize("weights", [False, True])
def test_recorded_attention_is_the_models_own_softmax(weights):
    """interpret.recording: the largest visible score (train.py's log_stability) and, with weights=True, the
    attention weights (interpret.py's maps): the softmax of the scores computed here from the model's own
    projections, to 1e-6; the model's output unchanged either way."""
    from interpret import recording

    model = build(n_layer=1, pos_emb="rope")
    idx = torch.randint(0, 61, (2, 12))
    with recording(model, weights=weights) as found:
        logits = model(idx)[0]
    assert (logits - model(idx)[0]).abs().max() <= (1e-5 if weights else 0)  # recording changes nothing
    attn = model.blocks[0].attn
    x = model.blocks[0].norm1(model.positions.embed(model.tok_emb(idx), 0))
    q, k, _ = attn.qkv(x).split(32, dim=-1)
    q, k = (t.view(2, 12, 4, 8).transpose(1, 2) for t in (q, k))
    q, k = model.positions.rotate(q, k, 0)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    assert len(found) == 1 and found[0].max_logit.item() == pytest.approx(scores[..., causal].max().item(), rel=1e-5)
    if weights:
        expected = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        assert (found[0].weights - expected).abs().max() <= 1e-6
        assert torch.equal(found[0].hidden, ~causal.expand(2, 4, 12, 12))
    assert attn.attend.__name__ == "attention_sdpa"  # restored afterwards


@pytest.mark.parametrize("norm_placement", ["pre", "post"])
def test_attention_only_blocks(norm_placement):
    """mlp='none': blocks of attention alone (no MLP, no norm for it: no parameter left unused, which DDP
    would refuse); generation with the cache equals generation without it."""
    model = build(mlp="none", pos_emb="rope", norm="rmsnorm", norm_placement=norm_placement)
    full = build(mlp="relu2", pos_emb="rope", norm="rmsnorm", norm_placement=norm_placement)
    assert not any(".mlp." in k or ".norm2." in k for k in model.state_dict())
    mlp_params = sum(p.numel() for b in full.blocks for p in (*b.mlp.parameters(), *b.norm2.parameters()))
    assert model.get_num_params() == full.get_num_params() - mlp_params
    idx = torch.randint(0, 61, (2, 6))
    greedy = Sampling(temperature=0)
    assert torch.equal(model.generate(idx, 12, greedy), model.generate(idx, 12, greedy, use_cache=False))
    loss = model(idx, idx)[1]
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gelu_tanh_is_the_same_function_compiled_or_not():
    x = torch.linspace(-10, 10, 4001, dtype=torch.float64, requires_grad=True)
    sigmoid_form, aten = gelu_tanh_as_sigmoid(x), F.gelu(x, approximate="tanh")
    torch.testing.assert_close(sigmoid_form, aten, atol=1e-12, rtol=1e-12)  # float64: the identity is exact
    grads = [torch.autograd.grad(y.sum(), x)[0] for y in (sigmoid_form, aten)]
    torch.testing.assert_close(*grads, atol=1e-12, rtol=1e-12)
    x = torch.randn(4096) * 4
    compiled = torch.compile(gelu_tanh, backend="eager", fullgraph=True)  # traces the compiling branch, no inductor
    torch.testing.assert_close(compiled(x), F.gelu(x, approximate="tanh"), atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Inference weights: one-row products (RowLinear), int8


@pytest.mark.parametrize("product", list(quantize.ROW_PRODUCTS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_linear_computes_what_linear_does(bias, dtype, product):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    if quantize.time_row_products([(linear.weight.detach(), linear.bias)], rounds=1)[product] == 0.0:
        pytest.skip(f"{product} cannot run {dtype} on this CPU (oneDNN has no bf16 inner product without AVX512-BF16)")
    row = quantize.row_linear(linear, product)
    exact = lambda x: F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.02, rtol=0.02)
    for shape in [(1, 1, 96), (1, 96), (96,), (2, 3, 96)]:  # one row (the chosen product), then several (F.linear)
        x = torch.randn(shape).to(dtype)
        y = row(x)
        assert y.shape == (*shape[:-1], 40) and y.dtype == dtype
        torch.testing.assert_close(y.double(), exact(x), **tolerance)


@pytest.mark.parametrize("speeds, chosen", [
    (dict(linear=45, addmv=44, mv=46, onednn=29), "linear"),  # MKL at memory speed (Intel): kept
    (dict(linear=10.7, addmv=11.1, mv=11.1, onednn=15.2), "onednn"),  # MKL's generic path (measured, AMD EPYC)
    (dict(linear=12.6, addmv=11.0, mv=11.8, onednn=13.0), "linear"),  # a near tie stays with the earlier one
    (dict(linear=4.0, addmv=2.5, mv=9.0, onednn=3.0), "mv"),  # bf16 without fast bf16: mv, the bias after it
    (dict(linear=4.0, addmv=9.0, mv=9.5, onednn=3.0), "addmv"),  # bf16 on AMX: the fused bias, not a near tie
])  # fmt: skip
def test_the_row_product_changes_only_for_a_clear_gain(speeds, chosen):
    assert quantize.pick_row_product(speeds) == chosen


def test_row_product_is_measured_once_and_can_be_set(monkeypatch):
    monkeypatch.setattr(quantize, "_chosen", {})
    linears = [(torch.randn(64, 32, dtype=torch.float16), None)]
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "mv")
    assert quantize.row_product(linears) == "mv" and "mv (SMALLGPT_ROW_PRODUCT)" in quantize.row_product_choices()["float16"]
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "onednn")
    assert quantize.row_product(linears) == "mv"  # decided once per process and dtype
    monkeypatch.setattr(quantize, "_chosen", {})
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "blas")
    with pytest.raises(ConfigError, match="SMALLGPT_ROW_PRODUCT='blas': use one of linear, addmv, mv, onednn, or unset it"):
        quantize.row_product(linears)
    monkeypatch.delenv(quantize.ROW_OVERRIDE)
    chosen = quantize.row_product(linears)
    speeds = quantize._chosen[torch.float16][1]
    assert set(speeds) == set(quantize.ROW_PRODUCTS) and speeds["linear"] > 0 and speeds[chosen] > 0
    # a product this build cannot run for a dtype (oneDNN has no fp16 inner product on many CPUs) scores 0
    monkeypatch.setitem(quantize.ROW_PRODUCTS, "onednn", lambda *args: torch.ops.mkldnn.no_such_op(*args))
    assert quantize.time_row_products(linears, rounds=1)["onednn"] == 0.0


@pytest.mark.parametrize("arch", [dict(), dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2,
                                                tie_embeddings=False)], ids=["gpt2", "llama"])
def test_bf16_inference_decodes_like_the_uncached_bf16_forward(arch):
    torch.manual_seed(0)
    model = for_inference(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100, **arch)), "bfloat16")
    assert not model.training and all(p.dtype == torch.bfloat16 for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is quantize.RowLinear for m in linears)
    assert len({m.product for m in linears}) == 1
    assert (model.lm_head.weight is model.tok_emb.weight) == model.config.tie_embeddings
    idx = torch.randint(100, (1, 20))
    with torch.no_grad():
        reference = model(idx)[0].float()  # no cache: every position through F.linear and fp32 attention
        cache = model.new_cache()
        model(idx[:, :12], kv_cache=cache)  # prefill, then one token at a time: matrix-vector products, bf16 attention
        for t in range(12, 20):
            step = model(idx[:, t : t + 1], kv_cache=cache)[0][0, -1].float()
            # bf16 rounding moves these logits by at most 0.4% of the largest; a key left out moves them by 2-6%
            torch.testing.assert_close(step, reference[0, t], atol=0.01 * reference.abs().max().item(), rtol=0)
    assert type(for_inference(GPT(model.config), "float32").lm_head) is quantize.RowLinear
    assert type(for_inference(GPT(model.config), "int8").lm_head) is Int8Linear


def test_int8_linear_is_within_half_a_step_per_weight_and_its_two_paths_agree():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    q = Int8Linear(linear)
    dequantised = q.weight.float() * q.scale.float()[:, None]
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127
    scale_rounding = (linear.weight.abs() + step) * 2**-8  # the scales are bf16
    assert ((dequantised - linear.weight).abs() <= step / 2 + scale_rounding).all()
    assert ((dequantised - linear.weight).abs() > step / 4).any()  # it is quantised, not a copy
    x = torch.randn(3, 40, 64)  # 120 rows: the dequantised bf16 path
    reference = F.linear(x.bfloat16(), dequantised.bfloat16(), q.bias).float()
    torch.testing.assert_close(q(x), reference, atol=0.03, rtol=0.02)
    for row in range(0, 120, 40):  # one row at a time: the int8 kernel
        torch.testing.assert_close(q(x.view(-1, 64)[row : row + 1]), reference.view(-1, 48)[row : row + 1],
                                   atol=0.03, rtol=0.02)
    assert q(x).dtype == torch.float32 and q(x).shape == (3, 40, 48)


@pytest.mark.parametrize("arch", [dict(), dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2,
                                                tie_embeddings=False)], ids=["gpt2", "llama"])
def test_int8_model_stays_close_to_the_float_model(arch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100, **arch)).eval()
    idx = torch.randint(100, (2, 24))
    with torch.no_grad():
        reference = model(idx)[0]
    quantized = GPT(model.config)
    quantized.load_state_dict(model.state_dict())
    assert quantize_int8(quantized) is quantized and not quantized.training
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert quantized.tok_emb.weight.dtype == torch.float32  # the lookup table is left as it is
    with torch.no_grad():
        for rows in (idx, idx[:1, :8]):  # the prefill path, then the int8 kernel
            error = (quantized(rows)[0] - reference[: rows.size(0), : rows.size(1)]).abs().max()
            assert error < 0.1 * reference.std(), (error, reference.std())
    tokens = quantized.generate(idx[:1, :4], 10, GREEDY)
    assert tokens.shape == (1, 14) and tokens.max() < 100
