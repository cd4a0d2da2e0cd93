"""probes.py: recorded attention is the model's own softmax, and per-head scores checked on a hand-built 2-layer
induction model (near 1) and a random one (near chance)."""

import math

import pytest
import torch

import probes
from conftest import build
from model import GPT, GPTConfig

V, T = 16, 16  # vocabulary and context of the hand-built model: probes of 8 distinct tokens, twice


@pytest.mark.parametrize("weights", [False, True])
def test_recorded_attention_is_the_models_own_softmax(weights):
    """probes.recording: the largest visible score (train.py's log_stability) and, with weights=True, the
    attention weights (interpret.py's maps): the softmax of the scores computed here from the model's own
    projections, to 1e-6; the model's output unchanged either way."""
    from probes import recording

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


def induction_model():
    """Two layers, residual stream = [token one-hot | previous token one-hot | position one-hot] (48 wide,
    3 heads of 16), MLPs zero. Layer 0 head 0 attends from position i to i - 1 (queries are positions,
    keys positions shifted by one) and writes that token into the "previous token" slot; layer 1 head 0
    attends to the positions whose previous token is the current token (queries the token slot, keys the
    previous-token slot) and copies what is there into the token slot, which the tied head reads: an
    induction head (Olsson et al. 2022, figure "induction head"). Scores after RMSNorm are about 12, so
    each softmax is within 1e-4 of one-hot."""
    config = GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=3, n_embd=3 * 16, pos_emb="learned",
                       norm="rmsnorm", mlp="relu2", bias=False, dropout=0.0)
    model = GPT(config).eval()
    tok, prev, pos = range(0, 16), range(16, 32), range(32, 48)
    q, k, v = 0, 48, 96  # row offsets of head 0's query, key and value in the fused qkv weight
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.norm_f, *(m for b in model.blocks for m in (b.norm1, b.norm2))):
            norm.weight.fill_(1.0)
        for t in range(V):
            model.tok_emb.weight[t, tok[t]] = 1.0
        for i in range(T):
            model.positions.wpe.weight[i, pos[i]] = 1.0
        a0, a1 = model.blocks[0].attn, model.blocks[1].attn
        for i in range(T):
            a0.qkv.weight[q + i, pos[i]] = 3.0  # query: my position
            if i + 1 < T:
                a0.qkv.weight[k + i + 1, pos[i]] = 1.0  # key: the position after mine
        for t in range(V):
            a0.qkv.weight[v + t, tok[t]] = 1.0  # value: my token
            a0.proj.weight[prev[t], t] = 0.2  # -> the previous-token slot (about one-hot after the norm's x4.9)
            a1.qkv.weight[q + t, tok[t]] = 3.0  # query: my token
            a1.qkv.weight[k + t, prev[t]] = 1.0  # key: the token before yours
            a1.qkv.weight[v + t, tok[t]] = 1.0  # value: your token
            a1.proj.weight[tok[t], t] = 4.0  # -> the token slot: the next-token prediction
    return model


def test_a_hand_built_induction_head_scores_near_one():
    s = probes.head_scores(induction_model(), rows=8)
    assert s["probe_len"] == 8
    assert s["previous"][0][0] > 0.999  # layer 0 head 0: the previous-token head
    # layer 1 head 0: the induction head. One position of eight shares its attention with a spurious key
    # (position 0 attends to itself, so its "previous token" is its own): 7.5/8 at best
    assert s["induction"][1][0] > 0.93 and s["duplicate"][1][0] < 0.07  # (the spurious key is a duplicate)
    assert probes.best(s["induction"]) == s["induction"][1][0]
    assert max(s["induction"][0] + s["induction"][1][1:]) < 0.2  # the other heads do not
    assert s["copying"][1][0] > 0.99  # its output raises the logit of the token it reads
    assert s["icl"] < -1.0 and s["loss_second"] < 0.5  # the second copy is predicted from the first


def test_a_random_model_scores_near_chance():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)).eval()
    s = probes.head_scores(model, rows=8)
    assert s["probe_len"] == 32 and 0.02 < s["chance"] < 0.03
    for layer in s["induction"]:
        for score in layer:
            assert 0.7 * s["chance"] < score < 1.4 * s["chance"]
    assert abs(s["icl"]) < 0.05


def test_a_window_hides_its_far_keys_and_a_linear_layer_has_no_map():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, pos_emb="rope",
                          attn_pattern="SR", attn_window=4)).eval()
    ids = list(range(10))
    logits, maps = probes.attention_maps(model, ids)
    assert torch.allclose(logits, model(torch.tensor([ids]))[0], atol=1e-5)
    weights, hidden = maps[0]
    i, j = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    seen = (j <= i) & (j > i - 4)  # causal, and within the last 4 positions
    assert torch.equal(hidden, ~seen.expand(2, 10, 10)) and torch.all(weights[hidden] == 0)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 10))
    assert maps[1] is None  # the linear-attention layer
    s = probes.head_scores(model, rows=2)
    assert s["induction"][1] is None and len(s["copying"][1]) == 2


def test_head_scores_refuse_a_probe_that_does_not_fit():
    from configurator import ConfigError

    with pytest.raises(ConfigError, match="probe_len=9"):
        probes.head_scores(induction_model(), n=9)


def test_copying_scores_are_fp32_under_autocast():
    """train.py --log_heads computes them inside the run's autocast: on CUDA a bf16 matrix reached
    torch.linalg.eigvals, which refuses it. The scores are computed in fp32 whatever autocast says (on
    CPU, whose autocast ran the products in bf16 before: scores off by about 1e-3)."""
    from conftest import build

    model = build(n_layer=2)
    plain = probes.copying_scores(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = probes.copying_scores(model)
    assert under == plain
