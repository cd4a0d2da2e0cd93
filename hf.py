"""
Hugging Face interop: GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM), Mistral (MistralForCausalLM:
Llama with a sliding window in every layer), Qwen3 (Qwen3ForCausalLM: Llama with QK-norm) and Arcee
(ArceeForCausalLM: Llama with a non-gated ReLU² MLP) weights into our GPT and back, and the tokenizer that
goes with pretrained weights; BERT, ViT and T5 (the other families) through hf_encoders.py.
GPT.from_pretrained and GPT.save_pretrained call in here; nothing here is needed to train or sample a
model of our own. This file converts and builds nothing: configs become our
GPTConfig keys as a dict, tensors become tensors under our names, and the model comes from the caller (so
hf.py imports no model, and model.py can import it without a circle).
"""

import json
import os
import torch

import attention
import hf_encoders
from configurator import DataError, PretrainedError, UserError
from tokenizer import CHAT_TEMPLATE, CHAT_TOKENS, ENCODER_TOKENS, EOT, HFTokenizer, TiktokenTokenizer, UNK, describe_meta


def load_pretrained(build, name_or_dir):
    """The model build(keys) makes from a Hugging Face config's GPTConfig keys, with the weights of a local
    Hugging Face directory (config.json plus model.safetensors or pytorch_model.bin), or of gpt2 /
    gpt2-medium / gpt2-large / gpt2-xl from the Hub."""
    directory = resolve_pretrained(name_or_dir)
    with open(os.path.join(directory, "config.json")) as f:
        hf_config = json.load(f)
    kind = hf_config.get("model_type")
    if kind not in HF_FAMILIES:
        raise PretrainedError(
            f"{directory}: model_type {kind!r} is not supported; supported: {', '.join(HF_FAMILIES)}"
        )
    to_config, to_ours, _, _ = HF_FAMILIES[kind]
    model = build(to_config(hf_config, directory))
    config = model.config
    state = to_ours(load_hf_state_dict(directory), config, hf_config)
    expected = model.state_dict()
    if config.tie_embeddings and "lm_head.weight" in expected:
        state["lm_head.weight"] = state["tok_emb.weight"]
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    if missing or unexpected:
        raise PretrainedError(
            f"{directory}: weights do not match the config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    for key, tensor in state.items():
        if tensor.shape != expected[key].shape:
            raise PretrainedError(f"{directory}: {key} has shape {tuple(tensor.shape)}, config implies "
                             f"{tuple(expected[key].shape)}")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model


def save_pretrained(model, directory):
    """Writes config.json and model.safetensors that transformers' Auto classes load: a GPT2LMHeadModel for
    GPT-2-shaped configs, a LlamaForCausalLM for Llama-shaped ones, ... (hf_family), BERT, ViT or T5 for
    the other families."""
    from safetensors.torch import save_file

    kind = hf_family(model.config)
    _, _, to_hf_config, to_hf = HF_FAMILIES[kind]
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    hf_state = to_hf(state, model.config)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(to_hf_config(model.config), f, indent=2)
    weights = os.path.join(directory, "model.safetensors")
    save_file({k: v.contiguous() for k, v in hf_state.items()}, weights, metadata={"format": "pt"})
    umask = os.umask(0)  # safetensors writes 0600; a model directory is shared like any other file
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)


def pretrained_tokenizer(name_or_dir, model):
    """The tokenizer.json beside Hugging Face weights; GPT-2 weights without one get tiktoken's gpt2; a
    vision transformer reads pixels (None)."""
    if model.config.image_size:
        return None
    path = os.path.join(name_or_dir, "tokenizer.json")
    if os.path.isdir(name_or_dir) and os.path.exists(path):
        with open(os.path.join(name_or_dir, "config.json")) as f:
            hf_config = json.load(f)
        eos = hf_config.get("eos_token_id")
        tokenizer = HFTokenizer(path, eos if isinstance(eos, int) else None)
        tokenizer.decoder_start = hf_config.get("decoder_start_token_id")  # an encoder-decoder's (T5: its pad, 0)
        settings = os.path.join(name_or_dir, "tokenizer_config.json")
        if tokenizer.eot_token is None and os.path.exists(settings):  # an export of ours names it there
            with open(settings) as f:
                name = json.load(f).get("eos_token")
            tokenizer.eot_token = tokenizer.tok.token_to_id(name) if isinstance(name, str) else None
        return tokenizer
    if uses_gpt2_tokenizer(model.config) and model.config.vocab_size >= 50257:
        return TiktokenTokenizer("gpt2")
    raise DataError(f"{name_or_dir}: no tokenizer.json beside the weights; sampling needs the model's tokenizer")


GPT2_HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def resolve_pretrained(name_or_dir):
    if os.path.isdir(name_or_dir):
        if not os.path.exists(os.path.join(name_or_dir, "config.json")):
            raise PretrainedError(f"{name_or_dir}: no config.json, so not a Hugging Face model directory (a training "
                                  f"run's folder loads with checkpoint.load_any({name_or_dir!r}))")
        return name_or_dir
    if name_or_dir not in GPT2_HUB_NAMES:
        raise PretrainedError(
            f"{name_or_dir!r} is neither a local Hugging Face model directory nor one of {', '.join(GPT2_HUB_NAMES)}"
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name_or_dir, allow_patterns=["config.json", "model.safetensors"])
    except Exception as e:  # offline, no cache, hub error: one actionable message
        raise PretrainedError(
            f"could not download {name_or_dir!r} from the Hugging Face Hub ({type(e).__name__}); without network, "
            f"download it where there is one (hf download openai-community/{name_or_dir} --local-dir {name_or_dir}) "
            "and pass that directory instead"
        ) from None


def load_hf_state_dict(directory):
    path = os.path.join(directory, "model.safetensors")
    if os.path.exists(path):
        from safetensors.torch import load_file

        return load_file(path)
    path = os.path.join(directory, "pytorch_model.bin")
    if os.path.exists(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise PretrainedError(f"{directory}: no model.safetensors or pytorch_model.bin (sharded checkpoints are not supported)")


# What each transformers architecture computes, in our keys: (its name, what it is, the keys it needs).
# "attention" is every layer's kind (attention/'s exports_as); "n_head" as a value means n_kv_head = n_head.
LLAMA_KEYS = {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "qk_norm": False}
FAMILY_KEYS = {
    "gpt2": ("GPT-2", "learned positions, LayerNorm, GELU", {"pos_emb": "learned", "norm": "layernorm", "mlp": "gelu",
                                                             "qk_norm": False, "n_kv_head": "n_head", "attention": "full"}),
    "llama": ("Llama", "RoPE, RMSNorm, SwiGLU, no biases", {**LLAMA_KEYS, "attention": "full"}),
    "mistral": ("Mistral", "Llama with a sliding window in every layer", {**LLAMA_KEYS, "attention": "window"}),
    "qwen3": ("Qwen3", "Llama with QK-norm", {**LLAMA_KEYS, "qk_norm": True, "attention": "full"}),
    "arcee": ("Arcee", "Llama with a non-gated ReLU² MLP", {**LLAMA_KEYS, "mlp": "relu2", "attention": "full"}),
}  # fmt: skip


def family_mismatches(config, keys):
    """The keys (as 'key=wanted') in which config differs from a family's, norm_placement='pre' included."""
    exported = {kind.exports_as for kind in attention.kinds_of(config).values()}
    wrong = [] if config.norm_placement == "pre" else ["norm_placement='pre'"]
    for key, wanted in keys.items():
        if key == "attention":
            if exported != {wanted}:
                letters = "/".join(attention.letters_exported_as(wanted))
                wrong.append(f"attn_pattern={letters or '?'!r} (every layer {'full attention' if wanted == 'full' else 'a sliding window'})")
        elif wanted == "n_head":
            if config.n_kv_head != config.n_head:
                wrong.append(f"n_kv_head={config.n_head} (= n_head)")
        elif getattr(config, key) != wanted:
            wrong.append(f"{key}={wanted!r}")
    return wrong


def family(config):
    """The transformers architecture with this config's computation (a FAMILY_KEYS name), or None."""
    if config.family != "decoder":
        try:
            return hf_encoders.family_of(config)
        except PretrainedError:
            return None
    return next((name for name, (_, _, keys) in FAMILY_KEYS.items() if not family_mismatches(config, keys)), None)


def uses_gpt2_tokenizer(config):
    """GPT-2's architecture: such weights (GPT-2 itself, or a model exported as GPT2LMHeadModel) expect
    tiktoken's gpt2 tokens."""
    return family(config) == "gpt2"


def hf_family(config):
    if config.family != "decoder":  # BERT, ViT, T5
        return hf_encoders.family_of(config)
    kind = family(config)
    if kind is not None:
        return kind
    c = config
    misses = {name: family_mismatches(c, keys) for name, (_, _, keys) in FAMILY_KEYS.items()}
    nearest = min(misses, key=lambda name: len(misses[name]))
    title, what, _ = FAMILY_KEYS[nearest]
    others = "; ".join(f"{t} ({w})" for t, w, _ in FAMILY_KEYS.values())
    raise PretrainedError(
        f"this config has no Hugging Face equivalent: the nearest is {title} ({what}), which needs "
        f"{', '.join(misses[nearest])} (got pos_emb={c.pos_emb!r}, norm={c.norm!r}, mlp={c.mlp!r}, bias={c.bias}, "
        f"qk_norm={c.qk_norm}, n_kv_head={c.n_kv_head}, n_head={c.n_head}, attn_pattern={c.attn_pattern!r}, "
        f"norm_placement={c.norm_placement!r}); exported architectures: {others}"
    )


def gpt2_config(hf, directory):
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise PretrainedError(f"{directory}: GPT-2 activation {act!r} is not supported (tanh GELU only)")
    if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
        raise PretrainedError(f"{directory}: non-standard GPT-2 attention scaling is not supported")
    return dict(
        block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"], n_head=hf["n_head"],
        n_embd=hf["n_embd"], bias=True, pos_emb="learned", norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="gelu", mlp_hidden=hf.get("n_inner") or 4 * hf["n_embd"],
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


# our per-layer name -> GPT-2's; GPT-2 stores Linear weights transposed (its Conv1D is x @ W)
GPT2_LAYER_KEYS = {
    "norm1.weight": "ln_1.weight", "norm1.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.proj.weight": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
    "norm2.weight": "ln_2.weight", "norm2.bias": "ln_2.bias",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias",
}  # fmt: skip
GPT2_TOP_KEYS = {"tok_emb.weight": "wte.weight", "positions.wpe.weight": "wpe.weight", "norm_f.weight": "ln_f.weight", "norm_f.bias": "ln_f.bias"}


def gpt2_to_ours(hf_state, config, hf_config=None):
    hf_state = {k.removeprefix("transformer."): v for k, v in hf_state.items()}
    state = {ours: hf_state[theirs] for ours, theirs in GPT2_TOP_KEYS.items()}
    for i in range(config.n_layer):
        for ours, theirs in GPT2_LAYER_KEYS.items():
            w = hf_state[f"h.{i}.{theirs}"]
            state[f"blocks.{i}.{ours}"] = w.t() if ours.endswith("weight") and w.dim() == 2 else w
    if not config.tie_embeddings:
        state["lm_head.weight"] = hf_state["lm_head.weight"]
    return state


def gpt2_from_ours(state, config):
    hf = {f"transformer.{theirs}": bias_or_zeros(state, ours) for ours, theirs in GPT2_TOP_KEYS.items()}
    for i in range(config.n_layer):
        for ours, theirs in GPT2_LAYER_KEYS.items():
            w = bias_or_zeros(state, f"blocks.{i}.{ours}")
            hf[f"transformer.h.{i}.{theirs}"] = w.t() if w.dim() == 2 else w
    if not config.tie_embeddings:
        hf["lm_head.weight"] = state["lm_head.weight"]
    return hf


def bias_or_zeros(state, key):
    """GPT-2 always has biases; a bias-free model exports zeros, which computes the same function."""
    if key in state:
        return state[key]
    weight = state[key.removesuffix("bias") + "weight"]
    return weight.new_zeros(weight.shape[0])


def gpt2_hf_config(config):
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
        "n_positions": config.block_size, "n_embd": config.n_embd, "n_layer": config.n_layer,
        "n_head": config.n_head, "n_inner": config.mlp_hidden, "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps, "resid_pdrop": config.dropout, "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout, "tie_word_embeddings": config.tie_embeddings, "dtype": "float32",
    }  # fmt: skip


def llama_config(hf, directory, act="silu"):
    if hf.get("hidden_act", act) != act:  # absent: the family's default
        raise PretrainedError(f"{directory}: {hf.get('model_type', 'llama')} activation {hf['hidden_act']!r} is not "
                              f"supported ({act} only)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise PretrainedError(f"{directory}: attention_bias/mlp_bias is not supported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = {"default": "none", "linear": "linear", "yarn": "yarn"}.get(rope_type)
    extras = set(rope) - {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings"}
    if scaling is None or extras:
        raise PretrainedError(f"{directory}: RoPE {rope_type!r} with {sorted(extras) or 'these settings'} is not "
                              "supported (plain, linear and yarn with its default betas and attention factor)")
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim", n_embd // n_head) != n_embd // n_head:
        raise PretrainedError(f"{directory}: head_dim={hf['head_dim']} != hidden_size/num_attention_heads")
    return dict(
        block_size=hf["max_position_embeddings"], vocab_size=hf["vocab_size"], n_layer=hf["num_hidden_layers"],
        n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head, n_embd=n_embd, bias=False,
        pos_emb="rope", rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), rope_scaling=scaling,
        rope_factor=float(rope.get("factor") or 1.0) if scaling != "none" else 1.0,
        trained_block_size=rope.get("original_max_position_embeddings"), norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", mlp_hidden=hf["intermediate_size"],
        tie_embeddings=hf.get("tie_word_embeddings", False),
    )


LLAMA_LAYER_KEYS = {
    "norm1.weight": "input_layernorm.weight", "attn.proj.weight": "self_attn.o_proj.weight",
    "norm2.weight": "post_attention_layernorm.weight", "mlp.proj.weight": "mlp.down_proj.weight",
}  # fmt: skip
# fused here, separate in Llama: our matrix is their matrices stacked along the output dimension
LLAMA_FUSED_KEYS = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
QWEN3_LAYER_KEYS = {**LLAMA_LAYER_KEYS, "attn.q_norm.weight": "self_attn.q_norm.weight",
                    "attn.k_norm.weight": "self_attn.k_norm.weight"}
ARCEE_FUSED_KEYS = {**LLAMA_FUSED_KEYS, "mlp.fc.weight": ("mlp.up_proj.weight",)}  # one matrix: no gate


def llama_like(layer_keys=LLAMA_LAYER_KEYS, fused_keys=LLAMA_FUSED_KEYS):
    """(to_ours, from_ours) for a Llama-shaped state dict with these per-layer names."""

    def to_ours(hf_state, config, hf_config=None):
        state = {"tok_emb.weight": hf_state["model.embed_tokens.weight"], "norm_f.weight": hf_state["model.norm.weight"]}
        for i in range(config.n_layer):
            for ours, theirs in layer_keys.items():
                state[f"blocks.{i}.{ours}"] = hf_state[f"model.layers.{i}.{theirs}"]
            for ours, parts in fused_keys.items():
                state[f"blocks.{i}.{ours}"] = torch.cat([hf_state[f"model.layers.{i}.{p}"] for p in parts])
        if not config.tie_embeddings:
            state["lm_head.weight"] = hf_state["lm_head.weight"]
        return state

    def from_ours(state, config):
        hf = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm_f.weight"]}
        head_dim = config.n_embd // config.n_head
        split_sizes = {
            "attn.qkv.weight": [config.n_head * head_dim, config.n_kv_head * head_dim, config.n_kv_head * head_dim],
            "mlp.fc.weight": [config.mlp_hidden] * len(fused_keys["mlp.fc.weight"]),
        }
        for i in range(config.n_layer):
            for ours, theirs in layer_keys.items():
                hf[f"model.layers.{i}.{theirs}"] = state[f"blocks.{i}.{ours}"]
            for ours, parts in fused_keys.items():
                for part, tensor in zip(parts, state[f"blocks.{i}.{ours}"].split(split_sizes[ours])):
                    hf[f"model.layers.{i}.{part}"] = tensor
        if not config.tie_embeddings:
            hf["lm_head.weight"] = state["lm_head.weight"]
        return hf

    return to_ours, from_ours


llama_to_ours, llama_from_ours = llama_like()
qwen3_to_ours, qwen3_from_ours = llama_like(QWEN3_LAYER_KEYS)
arcee_to_ours, arcee_from_ours = llama_like(fused_keys=ARCEE_FUSED_KEYS)


def llama_hf_config(config):
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd, "intermediate_size": config.mlp_hidden,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head, "head_dim": config.n_embd // config.n_head,
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_parameters": llama_rope_parameters(config),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": config.dropout,
        "tie_word_embeddings": config.tie_embeddings, "dtype": "float32",
    }  # fmt: skip


def llama_rope_parameters(config):
    """Llama's rope_parameters (transformers 5's name for rope_scaling) for our RoPE and its scaling."""
    if config.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    return {"rope_type": config.rope_scaling, "rope_theta": config.rope_theta, "factor": config.rope_factor,
            "original_max_position_embeddings": config.trained_block_size or config.block_size}


def mistral_config(hf, directory):
    """Mistral is Llama whose every layer attends over the last sliding_window tokens (None: all of them)."""
    config = llama_config(hf, directory)
    window = hf.get("sliding_window")
    return config | {"attn_pattern": attention.letters_exported_as("window")[0], "attn_window": window} if window else config


def mistral_hf_config(config):
    hf = {k: v for k, v in llama_hf_config(config).items() if k not in ("attention_bias", "mlp_bias")}
    return hf | {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": config.attn_window}


def qwen3_config(hf, directory):
    """Qwen3 is Llama with an RMSNorm over each head's queries and keys (before RoPE); its sliding-window
    layers (use_sliding_window) are not supported."""
    if hf.get("use_sliding_window"):
        raise PretrainedError(f"{directory}: Qwen3 with use_sliding_window=true is not supported")
    return llama_config(hf, directory) | {"qk_norm": True}


def qwen3_hf_config(config):
    hf = {k: v for k, v in llama_hf_config(config).items() if k != "mlp_bias"}
    return hf | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                 "sliding_window": None}


def arcee_config(hf, directory):
    """Arcee (AFM) is Llama whose MLP is up_proj, ReLU², down_proj: no gate."""
    return llama_config(hf, directory, act="relu2") | {"mlp": "relu2"}


def arcee_hf_config(config):
    return llama_hf_config(config) | {"architectures": ["ArceeForCausalLM"], "model_type": "arcee", "hidden_act": "relu2"}


HF_FAMILIES = {
    "gpt2": (gpt2_config, gpt2_to_ours, gpt2_hf_config, gpt2_from_ours),
    "llama": (llama_config, llama_to_ours, llama_hf_config, llama_from_ours),
    "mistral": (mistral_config, llama_to_ours, mistral_hf_config, llama_from_ours),
    "qwen3": (qwen3_config, qwen3_to_ours, qwen3_hf_config, qwen3_from_ours),
    "arcee": (arcee_config, arcee_to_ours, arcee_hf_config, arcee_from_ours),
    **hf_encoders.FAMILIES,
}



# ----------------------------------------------------------------------------------------------------
# Tokenizers for exported models: a tokenizer.json that transformers' AutoTokenizer (and sample.py)
# load, built with the `tokenizers` package from our tokenizer's own tables.


def byte_to_unicode():
    """GPT-2's byte-level alphabet: every byte as a printable character (the table in its encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(extra)}


def gpt2_byte_level():
    """tiktoken's gpt2 as a byte-level BPE in GPT-2's alphabet: ({token text: id} without <|endoftext|>, merges)."""
    encoding = TiktokenTokenizer("gpt2").enc
    ranks = {token: encoding.encode_single_token(token) for token in encoding.token_byte_values()}  # bytes -> id
    alphabet = byte_to_unicode()
    text = lambda token: "".join(alphabet[b] for b in token)  # noqa: E731
    return {text(token): rank for token, rank in ranks.items()}, [(text(a), text(b)) for a, b in bpe_merges(ranks)]


def bpe_merges(ranks):
    """The merge list of a byte-level BPE from tiktoken's ranks (token bytes -> id): each token of two or
    more bytes is what BPE over its own bytes, with only lower-ranked merges, joins last."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        parts = [bytes([b]) for b in token]
        while len(parts) > 2:
            pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def save_tokenizer(meta, directory, max_length):
    """Writes tokenizer.json and tokenizer_config.json for our tokenizer (its meta dict) into directory.
    GPT-2's BPE also gets vocab.json and merges.txt. A chat model's tokenizer gets the chat template's
    tokens as special tokens at our ids and the template itself (Jinja, in tokenizer_config.json), so
    transformers' apply_chat_template renders our prompt ids, and <|end|> as its end of sequence.
    Returns a line saying what was written."""
    try:
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return "no tokenizer written: it needs the tokenizers package (pip install tokenizers)"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    with open(os.path.join(directory, "config.json")) as f:  # its end-of-text ids are this tokenizer's
        model_config = json.load(f)  # (transformers' defaults: GPT-2's 50256, Llama's 1 and 2)
    chat, encoder = meta.get("kind") == "chat", meta.get("kind") == "encoder"
    special = list(CHAT_TOKENS) if chat else list(ENCODER_TOKENS) if encoder else []
    meta = meta["base"] if chat or encoder else meta
    eot = 50256
    if meta == {"kind": "tiktoken", "encoding": "gpt2"}:
        vocab, merges = gpt2_byte_level()
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([EOT])  # id 50256, after the 50,256 BPE tokens
        config.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
        with open(os.path.join(directory, "vocab.json"), "w") as f:
            json.dump(vocab | {EOT: len(vocab)}, f, ensure_ascii=False)
        with open(os.path.join(directory, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
        what = "GPT-2's BPE (tokenizer.json, vocab.json, merges.txt)"
    elif meta.get("kind") == "bpe":  # our own BPE is a tokenizer.json already
        tokenizer = Tokenizer.from_str(meta["json"])
        config.update(bos_token=EOT, eos_token=EOT, unk_token=EOT)
        eot = tokenizer.token_to_id(EOT)
        what = f"the BPE of {meta['vocab_size']} tokens learned for its dataset (tokenizer.json)"
    elif meta.get("kind") == "char":
        eot = None  # no end-of-text token: config.json's bos/eos (GPT-2's 50256 by default) must not name one
        chars, vocab_size = meta["chars"], model_config["vocab_size"]
        vocab = {c: i for i, c in enumerate([*chars, *special])}  # the chat tokens at our ids, marked special below
        what = f"a {len(chars)}-character vocabulary (tokenizer.json)"
        if vocab_size > len(vocab):  # a padded row, never an input in training: other characters read as it
            vocab[UNK] = len(vocab)
            config.update(unk_token=UNK)
            what += f"; any other character reads as {UNK} (id {vocab[UNK]}, a padding row of the model)"
        else:  # no row to spare, and an added one would take probability from the real characters
            what += (f"; transformers' tokenizer raises 'Missing [UNK] token' on any other character (train with "
                     f"--vocab_size={len(vocab) + 1} or more and the export maps them to {UNK})")
        tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK if UNK in vocab else None))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
        tokenizer.decoder = decoders.Fuse()  # and back without spaces between them
    else:
        return f"no tokenizer written: {describe_meta(meta)} has no Hugging Face equivalent here"
    if chat or encoder:
        first = tokenizer.get_vocab_size(with_added_tokens=True) if meta.get("kind") != "char" else len(meta["chars"])
        tokenizer.add_special_tokens(special)  # appended after the base vocabulary (a character one has them already)
        if [tokenizer.token_to_id(t) for t in special] != list(range(first, first + len(special))):
            raise UserError(f"the special tokens did not land at ids {first}-{first + len(special) - 1} in the exported tokenizer")
    if encoder:  # BERT's names for them; [SEP] ends a text
        eot = tokenizer.token_to_id("[SEP]")
        config.update(cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", pad_token="[PAD]", eos_token="[SEP]",
                      bos_token=None, additional_special_tokens=special)
        what += f"; BERT's {len(special)} tokens (ids {first}-{first + len(special) - 1})"
    if chat:
        eot = tokenizer.token_to_id(CHAT_TOKENS[-1])  # a reply ends at <|end|>: transformers' generate stops there
        config.update(eos_token=CHAT_TOKENS[-1], chat_template=CHAT_TEMPLATE, additional_special_tokens=special)
        config.setdefault("bos_token", None)
        what += f"; the chat template and its {len(special)} tokens (ids {first}-{first + len(special) - 1})"
    ids = {"bos_token_id": eot, "eos_token_id": eot}
    if encoder:  # (T5's decoder starts at [CLS] here, and pads with [PAD])
        ids |= {"decoder_start_token_id": tokenizer.token_to_id("[CLS]"), "pad_token_id": tokenizer.token_to_id("[PAD]")}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(model_config | ids, f, indent=2)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return f"tokenizer: {what}"
