"""positions.py: ALiBi slopes, T5's buckets, RoPE scaling (as transformers' Llama), running at a longer context."""

import pytest
import torch

from conftest import TINY_RUN, run_main
from generate import Sampling
from model import GPT, GPTConfig
from positions import alibi_slopes, t5_bucket


def tiny(**overrides):
    torch.manual_seed(0)
    config = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def test_alibi_slopes():
    assert alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    # 6 heads: the 4-head sequence, then every other slope of the 8-head one
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


@pytest.mark.parametrize("buckets, max_distance", [(32, 128), (8, 20), (6, 10), (2, 2)])
def test_t5_buckets_are_transformers(buckets, max_distance):
    T5Attention = pytest.importorskip("transformers.models.t5.modeling_t5").T5Attention
    distance = torch.arange(0, 4 * max_distance + 300)
    theirs = T5Attention._relative_position_bucket(-distance, bidirectional=False, num_buckets=buckets,
                                                   max_distance=max_distance)
    assert torch.equal(t5_bucket(distance, buckets, max_distance), theirs)


def test_t5_bias_is_learned_through_sdpa_as_through_the_explicit_path():
    grads = []
    for impl in ("sdpa", "explicit"):
        model = tiny(pos_emb="t5", t5_buckets=8, t5_max_distance=16, attn_impl=impl).train()
        with torch.no_grad():
            model.positions.bias.weight.normal_()
        idx = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))
        model(idx, idx)[1].backward()
        grads.append(model.positions.bias.weight.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)
    assert tiny(pos_emb="t5").get_num_params() - tiny(pos_emb="none").get_num_params() == 32 * 4  # buckets x heads


@pytest.mark.parametrize("pos_emb", ["rope", "alibi", "t5", "none", "sinusoidal"])
def test_a_longer_context_runs_and_is_cached_like_uncached(pos_emb):
    """set_context(96) on a model built at 32: the first 32 positions compute what they did; past them,
    generation through the cache equals generation without it (greedy tokens, and logits within 1e-5)."""
    model = tiny(pos_emb=pos_emb, t5_max_distance=20)
    idx = torch.randint(0, 61, (1, 90), generator=torch.Generator().manual_seed(2))
    before = model(idx[:, :32])[0]
    model.set_context(96)
    assert model.config.block_size == 96 and model.config.trained_block_size == 32
    torch.testing.assert_close(model(idx[:, :32])[0], before, rtol=0, atol=1e-6)
    full = model(idx)[0]
    cache = model.new_cache(96)
    steps = [model(idx[:, :40], kv_cache=cache)[0]] + [model(idx[:, t : t + 1], kv_cache=cache)[0] for t in range(40, 90)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    greedy = Sampling(temperature=0)
    assert torch.equal(model.generate(idx[:, :8], 80, greedy), model.generate(idx[:, :8], 80, greedy, use_cache=False))


def test_learned_positions_refuse_a_longer_context():
    with pytest.raises(ValueError, match="pos_emb='learned' has a trained vector for each of 32 positions"):
        tiny(pos_emb="learned").set_context(64)


@pytest.mark.parametrize("keys, message", [
    (dict(rope_scaling="yarn", pos_emb="alibi"), "rope_scaling='yarn' scales RoPE: it needs pos_emb='rope'"),
    (dict(rope_scaling="linear", rope_factor=0.5, pos_emb="rope"), "rope_factor=0.5 must be >= 1"),
    (dict(rope_factor=2.0, pos_emb="rope"), "and 1 with rope_scaling='none'"),
    (dict(pos_emb="t5", t5_buckets=8, t5_max_distance=4), "t5_max_distance=4 above half of it"),
    (dict(rope_scaling="ntk"), "rope_scaling='ntk' is not one of"),
])
def test_new_keys_are_validated(keys, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(**keys)


@pytest.mark.parametrize("scaling", ["linear", "yarn"])
def test_rope_scaling_matches_transformers_llama(tmp_path, scaling):
    """A Llama-shaped model trained at 16 tokens, run at 64 with 4x scaling, exported and loaded by
    transformers: the logits of a 48-token sequence (3x the trained length) agree."""
    transformers = pytest.importorskip("transformers")
    model = tiny(block_size=16, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # away from the init, so the positions matter
    model.set_context(64, rope_scaling=scaling, rope_factor=4.0)
    model.save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert theirs.config.rope_parameters["rope_type"] == scaling
    idx = torch.randint(0, 61, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours_logits, their_logits = model(idx)[0], theirs(idx).logits
        plain = tiny(block_size=64, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
        plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(ours_logits, their_logits, rtol=0, atol=3e-6)
    assert (ours_logits - plain(idx)[0]).abs().max() > 1e-3  # the scaling changed them
    back = GPT.from_pretrained(str(tmp_path))  # and the scaling comes back from the export
    assert (back.config.rope_scaling, back.config.rope_factor, back.config.trained_block_size) == (scaling, 4.0, 16)
    torch.testing.assert_close(back(idx)[0], ours_logits, rtol=0, atol=1e-6)


def test_eval_and_resume_at_a_longer_context(tmp_path, char_dataset):
    """eval.py --block_size past the trained length for a relative scheme; one line for learned positions;
    train.py --init_from=resume --block_size continues at the longer context with a note."""
    import train

    run = str(tmp_path / "alibi")
    train.main([*TINY_RUN, "--block_size=16", "--pos_emb=alibi", f"--dataset={char_dataset}", f"--out_dir={run}",
                "--max_iters=4", "--eval_interval=4"])
    result = run_main("eval.py", f"--out_dir={run}", "--block_size=64", "--device=cpu")
    assert result.returncode == 0 and "bits per byte" in result.stdout, result.stderr
    result = run_main("sample.py", f"--out_dir={run}", "--block_size=64", "--max_new_tokens=60", "--num_samples=1",
                        "--start=The ", "--device=cpu", "--temperature=0")
    assert result.returncode == 0 and len(result.stdout) > 60, result.stderr  # 64 tokens of context, one cache
    learned = str(tmp_path / "learned")
    train.main([*TINY_RUN, "--block_size=16", f"--dataset={char_dataset}", f"--out_dir={learned}", "--max_iters=2",
                "--eval_interval=2"])
    result = run_main("eval.py", f"--out_dir={learned}", "--block_size=64", "--device=cpu")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "pos_emb='learned' has a trained vector for each of 16 positions" in result.stderr
    result = run_main("train.py", f"--out_dir={run}", "--init_from=resume", "--block_size=48", "--max_iters=6",
                        f"--dataset={char_dataset}")
    assert result.returncode == 0, result.stderr
    assert "note: resuming at block_size=48 (the checkpoint had block_size=16)" in result.stdout
    from checkpoint import load_checkpoint

    config = load_checkpoint(f"{run}/ckpt.pt")["model_config"]
    assert (config["block_size"], config["trained_block_size"]) == (48, 16)
    result = run_main("train.py", f"--out_dir={learned}", "--init_from=resume", "--block_size=48", "--max_iters=4",
                        f"--dataset={char_dataset}")
    assert result.returncode == 2 and "learned positions their length" in result.stderr
