"""quantize.py: one-row products (RowLinear), bf16 inference weights (for_inference), int8 weights (Int8Linear)."""

import pytest
import torch
import torch.nn.functional as F

import generate
import quantize
from configurator import ConfigError
from generate import Sampling
from model import GPT, GPTConfig
from quantize import Int8Linear, for_inference, quantize_int8

GREEDY = Sampling(temperature=0)


@pytest.mark.parametrize("product", list(quantize.ROW_PRODUCTS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["natural", "product's"])
def test_row_linear_computes_what_linear_does(bias, dtype, product, layout):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    if layout == "product's":  # e.g. stored transposed for bags; F.linear (several rows) reads it too
        linear.weight.data = quantize.laid_out(linear.weight.data, product)
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
    (dict(linear=45, addmv=44, mv=46, onednn=29, linear_t=30, bags=50), "linear"),  # MKL at memory speed (Intel): kept
    (dict(linear=10.7, addmv=11.1, mv=11.1, onednn=15.2, linear_t=0.0, bags=0.0), "onednn"),  # MKL's generic path (AMD EPYC)
    (dict(linear=17.2, addmv=16.9, mv=17.1, onednn=30.4, bags=47.0), "bags"),  # every thread reads (measured, AMD Zen 5)
    (dict(linear=11.9, addmv=10.7, mv=11.5, onednn=13.5, linear_t=15.4, bags=14.6), "linear_t"),  # a tall matrix, AMD Zen 1
    (dict(linear=12.6, addmv=11.0, mv=11.8, onednn=13.0, linear_t=14.0, bags=14.0), "linear"),  # near ties stay with the earlier one
    (dict(linear=4.0, addmv=2.5, mv=9.0, onednn=3.0, bags=10.0), "mv"),  # bf16 without fast bf16: mv, the bias after it
    (dict(linear=4.0, addmv=9.0, mv=9.5, onednn=3.0, bags=2.0), "addmv"),  # bf16 on AMX: the fused bias, not a near tie
    (dict(linear=9.1, addmv=1.5, mv=8.8, onednn=0.0), "linear"),  # transposed layouts not timed (transposed_is_fine)
])  # fmt: skip
def test_the_row_product_changes_only_for_a_clear_gain(speeds, chosen):
    assert quantize.pick_row_product(speeds) == chosen


def test_row_products_are_measured_once_per_shape_and_can_be_set(monkeypatch):
    monkeypatch.setattr(quantize, "_chosen", {})
    linears = [(torch.randn(64, 32, dtype=torch.float16), None)]
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "mv")
    assert quantize.row_products(linears) == {(torch.float16, 64, 32): "mv"}
    assert quantize.row_product_choices()["float16 64x32"] == "mv (SMALLGPT_ROW_PRODUCT)"
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "onednn")
    assert quantize.row_products(linears) == {(torch.float16, 64, 32): "mv"}  # decided once per process and shape
    monkeypatch.setattr(quantize, "_chosen", {})
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "blas")
    with pytest.raises(ConfigError, match="SMALLGPT_ROW_PRODUCT='blas': use one of linear, addmv, mv, onednn, linear_t, bags, rowdot, or unset it"):
        quantize.row_products(linears)
    monkeypatch.delenv(quantize.ROW_OVERRIDE)
    two_shapes = linears + [(torch.randn(32, 64, dtype=torch.float16), torch.randn(32, dtype=torch.float16))]
    chosen = quantize.row_products(two_shapes)
    assert set(chosen) == {(torch.float16, 64, 32), (torch.float16, 32, 64)}  # each shape timed on its own
    for key, name in chosen.items():
        speeds = quantize._chosen[key][1]
        assert speeds["linear"] > 0 and speeds[name] > 0 and set(speeds) <= set(quantize.ROW_PRODUCTS)
    # a product this build cannot run for a dtype (oneDNN has no fp16 inner product on many CPUs) scores 0
    monkeypatch.setitem(quantize.ROW_PRODUCTS, "onednn", lambda *args: torch.ops.mkldnn.no_such_op(*args))
    assert quantize.time_row_products(linears, rounds=1)["onednn"] == 0.0 and not quantize.runs_here("onednn", linears)


def test_transposed_products_are_not_timed_where_several_rows_read_a_transposed_weight_slowly(monkeypatch):
    """As torch's bf16 matmul without fast bf16 (AVX2): 10-14x slower over the transposed weight. Simulated
    here by an F.linear that takes 20 ms on a transposed weight, on every CPU."""
    import time

    real = F.linear

    def linear(x, weight, bias=None):
        if not weight.is_contiguous() and x.numel() != x.size(-1):
            time.sleep(0.02)
        return real(x, weight, bias)

    monkeypatch.setattr(quantize, "_chosen", {})
    monkeypatch.setattr(quantize, "TIMED_MACS", 0)  # one call per timing: each sleeps
    monkeypatch.setattr(F, "linear", linear)
    weight = torch.randn(48, 32)
    assert not quantize.transposed_is_fine(weight, None)
    quantize.row_products([(weight, None)])
    assert not quantize.TRANSPOSED & set(quantize._chosen[torch.float32, 48, 32][1])  # neither linear_t nor bags timed

    def slow_row_major(x, weight, bias=None):  # the other way round: the transposed layout is the fast one
        if weight.is_contiguous() and x.numel() != x.size(-1):
            time.sleep(0.02)
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", slow_row_major)
    monkeypatch.setattr(quantize, "_chosen", {})
    assert quantize.transposed_is_fine(weight, None)
    quantize.row_products([(weight, None)])
    assert quantize.TRANSPOSED <= set(quantize._chosen[torch.float32, 48, 32][1])
    # a single row or column is the same memory either way (a (1, n_embd) gate of an M layer with one head)
    assert quantize.transposed_is_fine(torch.randn(1, 32), None) and quantize.transposed_is_fine(torch.randn(48, 1), None)


@pytest.mark.parametrize("arch", [dict(), dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2,
                                                tie_embeddings=False)], ids=["gpt2", "llama"])
def test_bf16_inference_decodes_like_the_uncached_bf16_forward(arch):
    torch.manual_seed(0)
    model = for_inference(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100, **arch)), "bfloat16")
    assert not model.training and all(p.dtype == torch.bfloat16 for p in model.parameters())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is quantize.RowLinear for m in linears)
    assert all(m.product == quantize._chosen[quantize.shape_key(m.weight)][0] for m in linears)  # each shape's own
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


def test_a_transposed_product_relays_the_weights_in_place_and_decodes_the_same_tokens(monkeypatch):
    monkeypatch.setattr(quantize, "_chosen", {})
    monkeypatch.setenv(quantize.ROW_OVERRIDE, "bags")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100))
    embedding = model.tok_emb.weight.detach().clone()
    model = for_inference(model, "float32")
    rows = [m for m in model.modules() if type(m) is quantize.RowLinear]
    assert {m.product for m in rows} == {"bags"} and all(m.weight.t().is_contiguous() for m in rows)
    assert model.lm_head.weight is model.tok_emb.weight and torch.equal(model.tok_emb.weight, embedding)
    prompt = torch.randint(100, (1, 5))
    with torch.no_grad():
        bags = generate.generate(model, prompt, 30, GREEDY)
        logits = model(prompt, kv_cache=model.new_cache())[0][0, -1]
        quantize.use_row_product(model, "linear")
        assert all(m.weight.is_contiguous() and m.product == "linear" for m in rows)
        assert model.lm_head.weight is model.tok_emb.weight and torch.equal(model.tok_emb.weight, embedding)
        torch.testing.assert_close(model(prompt, kv_cache=model.new_cache())[0][0, -1], logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(generate.generate(model, prompt, 30, GREEDY), bags)


def test_each_shape_gets_its_own_product_and_layout_and_the_tokens_stay_the_same(monkeypatch):
    def timed(linears, rounds=5, names=quantize.ROW_PRODUCTS):  # tall matrices: linear_t; the others: mv
        n, k = linears[0][0].shape
        return {name: 1.0 for name in names} | ({"linear_t": 2.0} if n > k else {"mv": 2.0})

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100))
    prompt = torch.randint(100, (1, 5))
    plain = for_inference(GPT(model.config), "float32")
    plain.load_state_dict(model.state_dict())
    quantize.use_row_product(plain, "linear")
    monkeypatch.setattr(quantize, "_chosen", {})
    monkeypatch.setattr(quantize, "time_row_products", timed)
    monkeypatch.setattr(quantize, "transposed_is_fine", lambda weight, bias: True)
    model = for_inference(model, "float32")
    for m in model.modules():
        if type(m) is quantize.RowLinear:
            tall = m.out_features > m.in_features  # qkv, mlp_fc and the head (100 x 64, tied): transposed
            assert m.product == ("linear_t" if tall else "mv") and m.weight.t().is_contiguous() == tall
    assert model.lm_head.weight is model.tok_emb.weight
    with torch.no_grad():
        assert torch.equal(generate.generate(model, prompt, 30, GREEDY), generate.generate(plain, prompt, 30, GREEDY))


def test_batches_through_a_packed_copy_compute_what_f_linear_does_and_decode_the_same_tokens(monkeypatch):
    weight, bias = torch.randn(48, 32), torch.randn(48)
    if quantize.time_batch_products([(weight, bias)], rows=4, rounds=1)["onednn_packed"] == 0.0:
        pytest.skip("this build has no oneDNN inner product")
    monkeypatch.setattr(quantize, "_chosen_batch", {})
    monkeypatch.setenv(quantize.BATCH_OVERRIDE, "packed")
    with pytest.raises(ConfigError, match="SMALLGPT_BATCH_PRODUCT='packed': use one of linear, onednn_packed, or unset it"):
        quantize.batch_products([(weight, bias)], 4)
    monkeypatch.delenv(quantize.BATCH_OVERRIDE)
    quantize.batch_products([(weight, bias)], 4)
    assert set(quantize._chosen_batch[torch.float32, 48, 32, 4][1]) == set(quantize.BATCH_PRODUCTS)  # both timed
    monkeypatch.setenv(quantize.BATCH_OVERRIDE, "onednn_packed")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100))
    plain = for_inference(GPT(model.config), "float32")
    plain.load_state_dict(model.state_dict())
    packed = for_inference(model, "float32", batch_rows=4)
    rows = [m for m in packed.modules() if type(m) is quantize.RowLinear]
    assert all(m.packed is not None for m in rows) and all(m.packed is None for m in plain.modules() if type(m) is quantize.RowLinear)
    x = torch.randn(3, 5, 64)
    for m in rows[:2]:  # several rows through the packed copy; one row through the row product
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m(x[0, 0]), F.linear(x[0, 0], m.weight, m.bias), atol=1e-5, rtol=1e-5)
    prompt = torch.randint(100, (3, 5))  # a batch of 3: the prefill and every step through the packed copies
    with torch.no_grad():
        assert torch.equal(generate.generate(packed, prompt, 20, GREEDY), generate.generate(plain, prompt, 20, GREEDY))
        rows[0].packed = quantize.prepack(torch.zeros_like(rows[0].weight), 4)  # several rows read the copy, not the weight
        assert torch.equal(rows[0](x), rows[0].bias.expand(3, 5, -1)) and not torch.equal(rows[0](x[0, 0]), rows[0].bias)


@pytest.mark.parametrize("speeds, chosen", [
    (dict(linear=35.3, onednn_packed=40.9), "onednn_packed"),  # 384x1536 at 32 rows, AMD Zen 1: 1.16x
    (dict(linear=27.8, onednn_packed=26.7), "linear"),  # a tie costs memory, not speed
    (dict(linear=21.6, onednn_packed=0.0), "linear"),  # oneDNN cannot (bf16 on AVX2)
])  # fmt: skip
def test_a_packed_copy_is_kept_only_where_it_is_faster(monkeypatch, speeds, chosen):
    monkeypatch.setattr(quantize, "_chosen_batch", {})
    monkeypatch.setattr(quantize, "time_batch_products", lambda linears, rows: speeds)
    assert quantize.batch_products([(torch.randn(48, 32), None)], 32) == {(torch.float32, 48, 32): chosen}


def test_every_weight_shape_loads_for_inference(monkeypatch):
    """Shapes with a single row or column (an M layer's gates with one head) go through the row products' checks."""
    monkeypatch.setattr(quantize, "_chosen", {})
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=32, block_size=16, vocab_size=50, attn_pattern="M"))
    assert any(1 in m.weight.shape for m in for_inference(model, "float32").modules() if type(m) is quantize.RowLinear)


def test_a_compiled_graph_computes_row_linear_with_f_linear_or_rowdot():
    """generate.StaticDecode compiles the decode step with RowLinears inside; inductor cannot lower oneDNN's
    op (sample.py --compile=True failed on a CPU whose row product was oneDNN): one row is rowdot.cpp's op
    where it runs here, several rows F.linear. Traced here with a backend that records the graph's ops."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    row = quantize.row_linear(linear, "onednn")
    x = torch.randn(1, 32)
    if not quantize.runs_here("onednn", [(linear.weight.detach(), linear.bias)]):
        pytest.skip("this build has no oneDNN inner product")
    row.packed = quantize.prepack(linear.weight.detach(), 4)
    ops = []

    def recording(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(row, backend=recording, fullgraph=True)
    with torch.no_grad():
        for rows in (x, torch.randn(4, 32)):  # one row (the row product's path) and several (the packed copy's)
            torch.testing.assert_close(compiled(rows), F.linear(rows, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)
    assert ops and not any("mkldnn" in op for op in ops) and any("linear" in op for op in ops), ops
    assert any("rowdot" in op for op in ops) == (quantize.rowdot_kernel() is not None), ops


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_the_compiled_step_over_rowdot_decodes_the_eager_tokens(monkeypatch, weights):
    """The compiled step's one-row products are rowdot's while the eager loop keeps the product measured
    fastest (MKL's, say): float32 greedy text is the eager text all the same (30 tokens, traced with the
    eager backend: the graph is the one inductor would compile), and int8's, whose products are rowdot's both ways."""
    kernel_or_skip()
    monkeypatch.setattr(generate, "STATIC_BACKEND", "eager")
    torch.manual_seed(0)
    model = for_inference(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100, pos_emb="rope",
                                        norm="rmsnorm", mlp="swiglu", bias=False)), weights)
    idx = torch.randint(100, (1, 5))
    eager = model.generate(idx, 30, GREEDY)
    torch._dynamo.reset()
    assert torch.equal(generate.generate(model, idx, 30, GREEDY, step=generate.StaticDecode(model, GREEDY)), eager)


# ---------------------------------------------------------------------------------------------------
# int8


def test_int8_linear_is_within_half_a_step_per_weight_and_its_two_paths_agree():
    torch.manual_seed(0)
    linear = torch.nn.Linear(70, 48)  # 70: two blocks of 32 and a partial one of 6
    q = Int8Linear(linear)
    assert q.weight.shape == (48, 70) and q.scale.shape == (48, 3) and q.scale.dtype == torch.float16
    dequantised = quantize.dequantize_blocks(q.weight, q.scale)
    blocks = F.pad(linear.weight.detach(), (0, 26)).view(48, 3, 32)
    step = (blocks.abs().amax(dim=-1, keepdim=True) / 127).expand(48, 3, 32).reshape(48, 96)[:, :70]
    scale_rounding = (linear.weight.abs() + step) * 2**-11  # the scales are float16
    assert ((dequantised - linear.weight).abs() <= step / 2 + scale_rounding).all()
    assert ((dequantised - linear.weight).abs() > step / 4).any()  # it is quantised, not a copy
    x = torch.randn(3, 40, 70)  # 120 rows: the dequantised bf16 path
    reference = F.linear(x.bfloat16(), dequantised.bfloat16(), q.bias.bfloat16()).float()
    torch.testing.assert_close(q(x), reference, atol=0.05, rtol=0.02)
    for row in range(0, 120, 40):  # one row at a time: rowdot (activations quantised in blocks too)
        torch.testing.assert_close(q(x.view(-1, 70)[row : row + 1]), reference.view(-1, 48)[row : row + 1],
                                   atol=0.05, rtol=0.02)
    assert q(x).dtype == torch.float32 and q(x).shape == (3, 40, 48)
    assert q(x[:, :0]).shape == (3, 0, 48)  # no rows: a chunk past the text's end


def test_int8_blocks_are_llama_cpps_q8_0_bit_for_bit():
    """What export.py --gguf_type=q8_0 writes (gguf's quantize) is what int8 inference multiplies by."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 96)  # blocks of very different scales
    w[3, :32] = 0  # an all-zero block
    w[4, :32] = torch.arange(32) + 0.5  # a scale of exactly 1 and every weight a tie: rounded away from zero
    w[4, 31] = 127
    q, scale = quantize.quantize_blocks(w)
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(40, 3, 34)
    assert torch.equal(q, torch.from_numpy(theirs[..., 2:].copy().view(np.int8)).reshape(40, 96))
    assert torch.equal(scale, torch.from_numpy(theirs[..., :2].copy().view(np.float16))[..., 0])
    back = gguf.quants.dequantize(theirs.reshape(40, 102), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(quantize.dequantize_blocks(q, scale), torch.from_numpy(back))


def kernel_or_skip():
    if quantize.rowdot_kernel() is None:
        pytest.skip(f"rowdot.cpp does not run here: {quantize.kernel_status()}")
    return quantize.rowdot_kernel()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("K", [64, 96, 70, 2048])  # whole blocks (an even and an odd count), a partial block, a wide row
def test_rowdot_kernel_computes_its_torch_reference(dtype, K):
    """rowdot.cpp against quantize.reference_rowdot (the fallback where it cannot be built): one row, a few, a
    server's batch, with and without a bias; int8's block dot products are exact integers either way."""
    op = kernel_or_skip()
    g = torch.Generator().manual_seed(K)
    w = torch.randn(37, K, generator=g) * torch.linspace(0.1, 3, K)
    weight, scale = quantize.quantize_blocks(w) if dtype == "int8" else (w.to(getattr(torch, dtype)), None)
    for M, bias in [(1, None), (3, torch.randn(37, generator=g)), (16, None)]:
        x = (torch.randn(M, K, generator=g) * 2).to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        ours, reference = op(x, weight, scale, bias), quantize.reference_rowdot(x, weight, scale, bias)
        assert ours.shape == (M, 37) and ours.dtype == x.dtype
        tolerance = dict(atol=1e-2, rtol=1e-2) if dtype == "bfloat16" else dict(atol=1e-3, rtol=1e-4)  # bf16: the output's rounding
        torch.testing.assert_close(ours.float(), reference.float(), **tolerance)
    with pytest.raises(RuntimeError, match="int8 weights take a scale"):
        op(torch.randn(1, K), weight, None if dtype == "int8" else torch.ones(37, 3, dtype=torch.float16), None)


def test_an_int8_model_decodes_alike_with_and_without_the_kernel(monkeypatch):
    """The fallback (torch, over dequantised blocks) is the kernel's arithmetic: the same logits up to float
    summation order, the same greedy tokens."""
    kernel_or_skip()
    torch.manual_seed(0)
    model = quantize_int8(GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=100)))
    idx = torch.randint(100, (1, 6))
    with torch.no_grad():
        fast = [model.forward_cached(idx[:, :t])[:, -1] for t in (1, 3)]
        tokens = model.generate(idx, 12, GREEDY)
        monkeypatch.setitem(quantize._kernel, "op", None)
        slow = [model.forward_cached(idx[:, :t])[:, -1] for t in (1, 3)]
        assert torch.equal(model.generate(idx, 12, GREEDY), tokens)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_large_weights_move_into_huge_pages_unchanged():
    t = torch.randn(3000, 1000)  # 12 MB
    moved = quantize.in_huge_pages(t)
    assert torch.equal(moved, t) and moved.data_ptr() != t.data_ptr()
    assert moved.data_ptr() % quantize.HUGE == 0 or not __import__("sys").platform.startswith("linux")
    small = torch.randn(10, 10)
    assert quantize.in_huge_pages(small).data_ptr() == small.data_ptr()  # small: left where it is
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=1024, block_size=16, vocab_size=1200))  # a 4.9 MB tied table
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    quantize.weights_in_huge_pages(model)
    assert model.lm_head.weight is model.tok_emb.weight
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert model.tok_emb.weight.data_ptr() % quantize.HUGE == 0


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


def test_auto_weights_are_bf16_on_a_gpu_with_bf16_and_float32_elsewhere(monkeypatch):
    """sample.py's and serve.py's default: a GPU ran full fp32 weights (and an fp32 cache) by default."""
    from quantize import inference_weights

    assert inference_weights("auto", "cpu") == inference_weights("auto", "mps") == "float32"
    assert inference_weights("int8", "cpu") == "int8"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert inference_weights("auto", "cuda") == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert inference_weights("auto", "cuda") == "float32"
