"""hf.py: parity with Hugging Face transformers (tiny random-weight models saved locally); offline downloads."""

import os

import pytest
import torch

from conftest import max_logit_diff, one_error_line, run_script
from generate import Sampling
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="parity tests need transformers (requirements-dev.txt)")

VOCAB = 97


def hf_gpt2(tmp_path, **overrides):
    config = dict(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2, n_head=4, bos_token_id=None,
                  eos_token_id=None)
    config.update(overrides)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()
    model.save_pretrained(tmp_path)
    return model


def hf_llama(tmp_path, tie, n_kv_heads=2):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=n_kv_heads, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return saved_with_random_norms(transformers.LlamaForCausalLM(config).eval(), tmp_path)


def saved_with_random_norms(model, tmp_path):
    """HF initialises norm gains to one; randomise them so the test sees whether they load. Saved to tmp_path."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    return model


@pytest.fixture
def idx():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def hf_greedy(model, idx, n):
    return model.generate(idx, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones_like(idx))


def test_gpt2_logits_and_greedy(tmp_path, idx):
    theirs = hf_gpt2(tmp_path)
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    assert ours.config.pos_emb == "learned" and ours.config.tie_embeddings
    assert max_logit_diff(ours, theirs, idx) <= 1e-4
    assert torch.equal(ours.generate(idx, 30, Sampling(temperature=0)), hf_greedy(theirs, idx, 30))


@pytest.mark.parametrize("tie", [True, False])
def test_llama_gqa_logits_and_greedy(tmp_path, idx, tie):
    theirs = hf_llama(tmp_path, tie)
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    c = ours.config
    assert (c.n_head, c.n_kv_head, c.rope_theta, c.norm_eps, c.tie_embeddings) == (4, 2, 5000.0, 1e-5, tie)
    assert max_logit_diff(ours, theirs, idx) <= 1e-4
    assert torch.equal(ours.generate(idx, 30, Sampling(temperature=0)), hf_greedy(theirs, idx, 30))


def test_pytorch_model_bin_loads(tmp_path, idx):
    theirs = hf_gpt2(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save(theirs.state_dict(), tmp_path / "pytorch_model.bin")
    assert max_logit_diff(GPT.from_pretrained(str(tmp_path)).eval(), theirs, idx) <= 1e-4


@pytest.mark.parametrize(
    "overrides",
    [
        dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True),
        dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=False, tie_embeddings=False),
        dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=2, tie_embeddings=True),
        dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_head=1, tie_embeddings=False),
    ],
)
def test_save_pretrained_loads_in_transformers(tmp_path, idx, overrides):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, **overrides)).eval()
    with torch.no_grad():  # non-trivial norm gains and biases, so a mapping error cannot hide behind ones/zeros
        for name, p in ours.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ours.save_pretrained(str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    expected = "GPT2LMHeadModel" if overrides["pos_emb"] == "learned" else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected
    assert max_logit_diff(ours, theirs, idx) <= 1e-4
    again = GPT.from_pretrained(str(tmp_path)).eval()
    assert max_logit_diff(again, theirs, idx) <= 1e-4


@pytest.mark.parametrize(
    "overrides, what",
    [
        (dict(pos_emb="alibi"), "pos_emb='alibi'"),
        (dict(qk_norm=True), "qk_norm=True"),
        (dict(norm="rmsnorm"), "norm='rmsnorm'"),
        (dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=True), "bias=True"),
        (dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, attn_pattern="SL", attn_window=4, n_layer=2),
         "attn_pattern='SL'"),  # a window layer and a full one: one model cannot mix them in transformers
        (dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, attn_pattern="R"), "attn_pattern='R'"),
        (dict(norm_placement="post"), "norm_placement='post'"),
    ],
)
def test_save_pretrained_refuses_inexpressible(tmp_path, overrides, what):
    model = GPT(GPTConfig(**{"block_size": 16, "vocab_size": VOCAB, "n_layer": 1, "n_head": 2, "n_embd": 16, **overrides}))
    with pytest.raises(ValueError, match="no Hugging Face equivalent") as err:
        model.save_pretrained(str(tmp_path / "out"))
    assert what in str(err.value)
    assert not (tmp_path / "out").exists()


def test_hub_name_offline_fails_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing to fall back on
    with pytest.raises(ValueError, match="could not download 'gpt2-medium'.*hf download.*pass that directory"):
        GPT.from_pretrained("gpt2-medium")


@pytest.mark.parametrize("script", ["sample.py", "train.py"])
def test_gpt2_offline_is_one_line_naming_hf_download(script, tmp_path, char_dataset):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    extra = [f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'out'}"] if script == "train.py" else []
    result = run_script(script, "--init_from=gpt2", "--device=cpu", *extra, env=env, timeout=120)
    assert result.returncode == 2
    line = one_error_line(result)
    assert "could not download 'gpt2'" in line and "hf download openai-community/gpt2" in line
    assert "huggingface-cli" not in line


def test_unknown_name_fails_clearly():
    with pytest.raises(ValueError, match="neither a local Hugging Face model directory nor one of gpt2"):
        GPT.from_pretrained("gtp2")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="model_type 'qwen2' is not supported; supported: gpt2, llama, mistral"):
        GPT.from_pretrained(str(tmp_path))


# Mistral: Llama with a sliding window in every layer. Sequences of 48 tokens, 6 windows of 8: a window
# off by one position, or one that is not applied, moves the logits by far more than the tolerance.
WINDOW = 8


def test_mistral_imports_with_its_window(tmp_path):
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        sliding_window=WINDOW, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = saved_with_random_norms(transformers.MistralForCausalLM(config).eval(), tmp_path)
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    assert (ours.config.attn_pattern, ours.config.attn_window, ours.config.n_kv_head) == ("S", WINDOW, 2)
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(ours, theirs, idx) <= 3e-6
    assert torch.equal(ours.generate(idx[:, :20], 30, Sampling(temperature=0)), hf_greedy(theirs, idx[:, :20], 30))
    full = GPT(GPTConfig(**{**vars(ours.config), "attn_pattern": "L", "attn_window": None}))
    full.load_state_dict(ours.state_dict())
    assert max_logit_diff(full.eval(), theirs, idx) > 1e-3  # the window matters on these sequences


def test_sliding_window_exports_as_mistral(tmp_path):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, pos_emb="rope",
                         norm="rmsnorm", mlp="swiglu", bias=False, attn_pattern="S", attn_window=WINDOW)).eval()
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    ours.save_pretrained(str(tmp_path))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(theirs).__name__ == "MistralForCausalLM" and theirs.config.sliding_window == WINDOW
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(ours, theirs, idx) <= 3e-6


def test_an_arcee_config_without_hidden_act_reads_as_relu2():
    """transformers' ArceeConfig defaults hidden_act to relu2: a config.json that omits it is still Arcee."""
    from hf import arcee_config

    hf = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64,
          "max_position_embeddings": 32, "vocab_size": 61, "model_type": "arcee"}
    config = arcee_config(hf, "dir")
    assert config["mlp"] == "relu2" and config["mlp_hidden"] == 64
