"""model.py: GPTConfig's checks, the network (causal, SDPA = explicit, z-loss, label smoothing, post-norm)."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import build, tiny
from generate import Sampling
from model import GPT, GPTConfig, gelu_tanh, gelu_tanh_as_sigmoid, lm_loss
from positions import RotaryPositions

SCHEMES = ["learned", "rope", "sinusoidal", "alibi", "t5", "none"]


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
        (dict(mlp="reglu"), "mlp='reglu' is not one of"),
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


def test_the_training_forward_with_its_loss_is_one_graph():
    """train.py takes (loss, cross_entropy) from the forward itself, so torch.compile puts the loss in the
    model's graph (no graph break: fullgraph=True traces it whole) and it equals the eager loss."""
    model = build(z_loss=1e-2, label_smoothing=0.1, pos_emb="rope", norm="rmsnorm")
    idx, targets = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    traced = torch.compile(model, backend="eager", fullgraph=True)
    (_, eager), (_, graph) = model(idx, targets, with_ce=True), traced(idx, targets, with_ce=True)
    for a, b in zip(eager, graph):  # the traced graph may order a reduction otherwise: to rounding
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert eager[0] > eager[1]  # the training loss carries the z-loss and smoothing terms; ce is plain


def test_the_loss_is_one_graph_with_z_loss_and_label_smoothing():
    """No boolean indexing (a data-dependent shape: a host sync every micro-step on a GPU, and a graph
    break under torch.compile): the loss, z-loss and label smoothing included, traces as one graph
    (torch.compile's front end, fullgraph=True, without inductor's code generation) and equals eager."""
    logits = torch.randn(2, 16, 61)
    targets = torch.randint(0, 61, (2, 16))
    targets[0, :4] = -1
    traced = torch.compile(lm_loss, backend="eager", fullgraph=True)
    for z_loss, smoothing in ((1e-2, 0.0), (1e-2, 0.1)):
        for eager, graph in zip(lm_loss(logits, targets, z_loss, smoothing), traced(logits, targets, z_loss, smoothing)):
            torch.testing.assert_close(graph, eager, rtol=0, atol=0)


def test_label_smoothing_is_the_training_loss_only():
    model = build(label_smoothing=0.1)
    idx, targets = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    targets[0, :3] = -1  # ignored positions count in neither term
    logits, loss = model(idx, targets)
    logp = F.log_softmax(logits.view(-1, 61), dim=-1)[targets.view(-1) != -1]
    kept = targets.view(-1)[targets.view(-1) != -1]
    nll = -logp.gather(1, kept[:, None]).mean()
    by_hand = 0.9 * nll - 0.1 * logp.mean(dim=-1).mean()  # 0.9 on the target, 0.1 spread evenly over 61
    torch.testing.assert_close(loss, by_hand)
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, 61), targets.view(-1), ignore_index=-1, label_smoothing=0.1))
    trained_on, reported = lm_loss(logits, targets, 0.0, 0.1)
    torch.testing.assert_close(reported, nll)  # evaluation and bits per byte see the plain cross-entropy
    assert not reported.requires_grad and trained_on.requires_grad


# ---------------------------------------------------------------------------------------------------
# Blocks: post-norm, attention-only, the GELU


def test_post_norm_block_is_the_2017_recipe():
    model = build(n_layer=1, norm_placement="post", mlp="relu2")
    idx = torch.randint(0, 61, (2, 10))
    block = model.blocks[0]
    x = model.positions.embed(model.tok_emb(idx), 0)
    q, k, v = block.attn.qkv(x).split(32, dim=-1)
    q, k, v = (t.view(2, 10, 4, 8).transpose(1, 2) for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    attn = block.attn.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 10, 32))
    x = F.layer_norm(x + attn, (32,), block.norm1.weight, block.norm1.bias)
    x = F.layer_norm(x + block.mlp.proj(F.relu(block.mlp.fc(x)).square()), (32,), block.norm2.weight, block.norm2.bias)
    torch.testing.assert_close(model(idx)[0], x @ model.tok_emb.weight.T, rtol=0, atol=1e-5)  # no final norm
    assert isinstance(model.norm_f, torch.nn.Identity)


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


def test_one_log_z_gives_pytorchs_cross_entropy_label_smoothing_and_z_loss():
    """lm_loss computes log Z once for the cross-entropy, label smoothing and z-loss; each equals the
    reference (F.cross_entropy with and without label_smoothing, a z-loss over the kept positions)."""
    logits = torch.randn(3, 8, 61) * 3
    targets = torch.randint(0, 61, (3, 8))
    targets[1, :5] = -1
    flat, flat_t = logits.view(-1, 61), targets.view(-1)
    ce = F.cross_entropy(flat, flat_t, ignore_index=-1)
    smoothed = F.cross_entropy(flat, flat_t, ignore_index=-1, label_smoothing=0.1)
    z = torch.logsumexp(flat[flat_t != -1], dim=-1).square().mean()
    for z_loss, smoothing, expected in ((0.0, 0.0, ce), (1e-2, 0.0, ce + 1e-2 * z), (0.0, 0.1, smoothed),
                                        (1e-2, 0.1, smoothed + 1e-2 * z)):
        loss, plain = lm_loss(logits, targets, z_loss, smoothing)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(plain, ce, rtol=1e-6, atol=1e-6)
