"""
Hugging Face interop for the chapter's other two families: BERT (BertForMaskedLM,
BertForSequenceClassification) and ViT (ViTForImageClassification), encoders; T5
(T5ForConditionalGeneration), an encoder-decoder. hf.py dispatches here by model_type (loading) and by
GPTConfig.family (saving); as there, configs become our GPTConfig keys as a dict and tensors our names.

Where the computations differ only by a constant, the constant moves into a weight, exactly: T5 leaves its
scores unscaled (we scale q.k by 1/sqrt(head_dim): its query rows are multiplied by sqrt(head_dim)) and
v1.0 scales its tied head's input by d_model^-0.5 (folded into the decoder's final norm; a tied export
says scale_decoder_outputs, an untied one does not); a model without token types exports one all-zero
type row, one without ViT's qkv bias loads zeros.
"""

import math
import os
import re

import torch

from configurator import PretrainedError

ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}  # theirs: ours
T5_MLPS = {"relu": "relu", "gated-gelu": "geglu", "gelu": "gelu_exact", "gated-silu": "swiglu"}  # feed_forward_proj: ours


def activation(hf, directory):
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise PretrainedError(f"{directory}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def encoder_keys(hf, directory):
    """What BERT and ViT share: the stack's shape, its MLP and its norms."""
    n_embd, n_head = hf["hidden_size"], hf["num_attention_heads"]
    if n_embd % n_head:
        raise PretrainedError(f"{directory}: hidden_size={n_embd} is not divisible by num_attention_heads={n_head}")
    return dict(family="encoder", n_layer=hf["num_hidden_layers"], n_head=n_head, n_embd=n_embd, bias=True,
                pos_emb="learned", norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
                mlp=activation(hf, directory), mlp_hidden=hf["intermediate_size"])


def n_labels(hf):
    return len(hf.get("id2label") or {}) or hf.get("num_labels", 2)


# ----------------------------------------------------------------------------------------------------
# BERT: post-norm blocks, an embedding LayerNorm, token types; the masked-token head or a pooled classifier


def bert_config(hf, directory):
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise PretrainedError(f"{directory}: BERT with position_embedding_type={hf['position_embedding_type']!r} is "
                              "not supported (absolute only)")
    architecture = (hf.get("architectures") or ["BertForMaskedLM"])[0]
    classify = architecture == "BertForSequenceClassification"
    if not classify and architecture not in ("BertForMaskedLM", "BertForPreTraining"):  # (BertModel: no head to load)
        raise PretrainedError(f"{directory}: {architecture} is not supported (BertForMaskedLM, BertForPreTraining's "
                              "masked-token head, BertForSequenceClassification)")
    return encoder_keys(hf, directory) | dict(
        block_size=hf["max_position_embeddings"], vocab_size=hf["vocab_size"], norm_placement="post", emb_norm=True,
        type_vocab_size=hf.get("type_vocab_size", 2), head="classify" if classify else "mlm",
        n_classes=n_labels(hf) if classify else 0, pooler=classify, tie_embeddings=hf.get("tie_word_embeddings", True))


BERT_TOP = {"tok_emb": "embeddings.word_embeddings", "positions.wpe": "embeddings.position_embeddings",
            "type_emb": "embeddings.token_type_embeddings", "emb_norm": "embeddings.LayerNorm"}
BERT_LAYER = {"attn.proj": "attention.output.dense", "norm1": "attention.output.LayerNorm",
              "mlp.fc": "intermediate.dense", "mlp.proj": "output.dense", "norm2": "output.LayerNorm"}
BERT_HEADS = {"mlm_dense": "cls.predictions.transform.dense", "mlm_norm": "cls.predictions.transform.LayerNorm",
              "pooler": "bert.pooler.dense", "classifier": "classifier"}
VIT_TOP = {"norm_f": "vit.layernorm", "patches": "vit.embeddings.patch_embeddings.projection", "classifier": "classifier"}
VIT_LAYER = {"norm1": "layernorm_before", "attn.proj": "attention.output.dense", "norm2": "layernorm_after",
             "mlp.fc": "intermediate.dense", "mlp.proj": "output.dense"}


def renamed(source, names, to_ours):
    """{ours.weight/bias: theirs.weight/bias} over `names` (ours: theirs), from source's side to the other."""
    out = {}
    for ours, theirs in names.items():
        a, b = (theirs, ours) if to_ours else (ours, theirs)
        for suffix in (".weight", ".bias"):
            if a + suffix in source:
                out[b + suffix] = source[a + suffix]
    return out


def qkv_in(state, prefix, names=("query", "key", "value")):
    """Their three projections stacked into our qkv (a missing bias, ViT's qkv_bias=False, as zeros)."""
    out = {"weight": torch.cat([state[f"{prefix}.{n}.weight"] for n in names])}
    if f"{prefix}.{names[0]}.bias" in state or f"{prefix}.{names[0]}.weight" in state:
        out["bias"] = torch.cat([state.get(f"{prefix}.{n}.bias", state[f"{prefix}.{n}.weight"].new_zeros(
            state[f"{prefix}.{n}.weight"].size(0))) for n in names])
    return out


def layers_to_ours(hf_state, config, layer, names, qkv):
    """Every block's weights (an encoder's: BERT's, ViT's) under our names; layer: their block's prefix
    with {i}, names: ours -> theirs within it, qkv: where their query, key and value sit."""
    state = {}
    for i in range(config.n_layer):
        prefix = layer.format(i=i)
        state |= {f"blocks.{i}.{k}": v for k, v in renamed(hf_state, {o: f"{prefix}.{t}" for o, t in names.items()}, True).items()}
        three = qkv_in(hf_state, f"{prefix}.{qkv}")
        state[f"blocks.{i}.attn.qkv.weight"], state[f"blocks.{i}.attn.qkv.bias"] = three["weight"], three["bias"]
    return state


def layers_from_ours(state, config, layer, names, qkv):
    """layers_to_ours the other way."""
    hf = {}
    for i in range(config.n_layer):
        prefix = layer.format(i=i)
        hf |= renamed({k.removeprefix(f"blocks.{i}."): v for k, v in state.items() if k.startswith(f"blocks.{i}.")},
                      {o: f"{prefix}.{t}" for o, t in names.items()}, False)
        for part in ("weight", "bias"):
            for name, t in zip(("query", "key", "value"), state[f"blocks.{i}.attn.qkv.{part}"].chunk(3)):
                hf[f"{prefix}.{qkv}.{name}.{part}"] = t
    return hf


def bert_to_ours(hf_state, config, hf_config=None):
    # old checkpoints name LayerNorm's weight and bias gamma and beta; a masked-token model's file may hold a
    # pooler and pretraining's next-sentence head, which it does not use (transformers skips them too)
    unused = ("bert.pooler.", "cls.seq_relationship.") if config.head != "classify" else ()
    s = {re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)): v
         for k, v in hf_state.items() if not k.startswith(unused)}
    s = {k.removeprefix("bert.") if not k.startswith("bert.pooler") else k: v for k, v in s.items()}
    state = renamed(s, BERT_TOP, True) | renamed(s, BERT_HEADS, True)
    state |= layers_to_ours(s, config, "encoder.layer.{i}", BERT_LAYER, "attention.self")
    if config.head == "mlm":
        state["lm_head.bias"] = s.get("cls.predictions.decoder.bias", s.get("cls.predictions.bias"))  # (untied: its own)
        if not config.tie_embeddings:
            state["lm_head.weight"] = s["cls.predictions.decoder.weight"]
    return state


def bert_from_ours(state, config):
    hf = {("" if k.startswith("bert.pooler") or not k.startswith("embeddings") else "bert.") + k: v
          for k, v in renamed(state, BERT_TOP, False).items()}
    hf |= renamed(state, BERT_HEADS, False)
    if config.type_vocab_size == 0:  # BERT always adds a type row: one of zeros computes the same
        hf["bert.embeddings.token_type_embeddings.weight"] = state["tok_emb.weight"].new_zeros(1, config.n_embd)
    hf |= layers_from_ours(state, config, "bert.encoder.layer.{i}", BERT_LAYER, "attention.self")
    if config.head == "mlm":  # (transformers ties the decoder's bias, and its weight when tied, on loading)
        hf["cls.predictions.bias"] = state["lm_head.bias"]
        if not config.tie_embeddings:  # untied, the decoder's bias is its own too
            hf["cls.predictions.decoder.weight"] = state["lm_head.weight"]
            hf["cls.predictions.decoder.bias"] = state["lm_head.bias"].clone()
    return hf


def bert_hf_config(config):
    architecture = "BertForSequenceClassification" if config.head == "classify" else "BertForMaskedLM"
    extra = {"id2label": {str(i): f"LABEL_{i}" for i in range(config.n_classes)}} if config.head == "classify" else {}
    return {
        "architectures": [architecture], "model_type": "bert", "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd, "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "intermediate_size": config.mlp_hidden, "hidden_act": their_activation(config),
        "max_position_embeddings": config.block_size, "type_vocab_size": config.type_vocab_size or 1,
        "layer_norm_eps": config.norm_eps, "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.dropout, "position_embedding_type": "absolute",
        "tie_word_embeddings": config.tie_embeddings, "pad_token_id": 0, "dtype": "float32", **extra,
    }  # fmt: skip


def their_activation(config):
    return {ours: theirs for theirs, ours in ACTIVATIONS.items() if theirs != "gelu_pytorch_tanh"}[config.mlp]


# ----------------------------------------------------------------------------------------------------
# ViT: pre-norm blocks over a class token and patches, learned positions, a classifier on the class token


def vit_config(hf, directory):
    size, patch = hf.get("image_size", 224), hf.get("patch_size", 16)
    if size % patch:
        raise PretrainedError(f"{directory}: image_size={size} is not a multiple of patch_size={patch}")
    return encoder_keys(hf, directory) | dict(
        block_size=(size // patch) ** 2 + 1, vocab_size=1, head="classify", n_classes=n_labels(hf), image_size=size,
        patch_size=patch, channels=hf.get("num_channels", 3))


def vit_to_ours(hf_state, config, hf_config=None):
    state = renamed(hf_state, VIT_TOP, True)
    state["cls_token"] = hf_state["vit.embeddings.cls_token"]
    state["positions.wpe.weight"] = hf_state["vit.embeddings.position_embeddings"][0]
    return state | layers_to_ours(hf_state, config, "vit.encoder.layer.{i}", VIT_LAYER, "attention.attention")


def vit_from_ours(state, config):
    hf = renamed(state, VIT_TOP, False)
    hf["vit.embeddings.cls_token"] = state["cls_token"]
    hf["vit.embeddings.position_embeddings"] = state["positions.wpe.weight"][None]
    return hf | layers_from_ours(state, config, "vit.encoder.layer.{i}", VIT_LAYER, "attention.attention")


def vit_hf_config(config):
    return {
        "architectures": ["ViTForImageClassification"], "model_type": "vit", "image_size": config.image_size,
        "patch_size": config.patch_size, "num_channels": config.channels, "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "intermediate_size": config.mlp_hidden, "hidden_act": their_activation(config), "qkv_bias": True,
        "layer_norm_eps": config.norm_eps, "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.dropout, "dtype": "float32",
        "id2label": {str(i): f"LABEL_{i}" for i in range(config.n_classes)},
    }  # fmt: skip


def save_image_processor(meta, directory):
    """preprocessor_config.json (transformers' ViTImageProcessor: resize, then the pixels' scale our images
    were prepared with, no normalisation) and the class names as config.json's labels. Returns a line."""
    import json

    size = meta["image_size"]
    processor = {"image_processor_type": "ViTImageProcessor", "do_resize": True, "size": {"height": size, "width": size},
                 "do_rescale": True, "rescale_factor": meta["rescale"], "do_normalize": False,
                 "image_mean": [0.0] * meta["channels"], "image_std": [1.0] * meta["channels"]}
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=2)
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    labels = dict(enumerate(meta["classes"]))
    config |= {"id2label": {str(i): c for i, c in labels.items()}, "label2id": {c: i for i, c in labels.items()}}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return f"image processor: {size}x{size} pixels times {meta['rescale']:g}, labels {', '.join(meta['classes'][:10])}"


# ----------------------------------------------------------------------------------------------------
# T5: pre-RMSNorm stacks without biases, relative buckets in each stack's first layer (shared by its layers)


def t5_config(hf, directory):
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in T5_MLPS:
        raise PretrainedError(f"{directory}: feed_forward_proj={proj!r} is not supported ({', '.join(T5_MLPS)})")
    n_embd, n_head = hf["d_model"], hf["num_heads"]
    if hf.get("d_kv", n_embd // n_head) * n_head != n_embd:
        raise PretrainedError(f"{directory}: num_heads * d_kv = {n_head * hf['d_kv']} differs from d_model={n_embd} "
                              "(heads of another width than d_model / num_heads are not supported)")
    return dict(
        family="encoder-decoder", block_size=hf.get("n_positions", 512), vocab_size=hf["vocab_size"],
        n_layer=hf.get("num_decoder_layers") or hf["num_layers"], n_encoder_layer=hf["num_layers"], n_head=n_head,
        n_embd=n_embd, bias=False, pos_emb="t5", t5_buckets=hf.get("relative_attention_num_buckets", 32),
        t5_max_distance=hf.get("relative_attention_max_distance", 128), norm="rmsnorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-6), mlp=T5_MLPS[proj], mlp_hidden=hf["d_ff"],
        tie_embeddings=hf.get("tie_word_embeddings", True) and not has_own_head(directory))


def has_own_head(directory):
    """Whether a T5 checkpoint holds an lm_head of its own that differs from the embeddings (transformers 5
    writes tie_word_embeddings=true for every T5 and keeps such a head untied)."""
    path = os.path.join(directory, "model.safetensors")
    if os.path.exists(path):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            if "lm_head.weight" not in f.keys():
                return False
            return not torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("shared.weight"))
    path = os.path.join(directory, "pytorch_model.bin")
    if os.path.exists(path):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return "lm_head.weight" in state and not torch.equal(state["lm_head.weight"], state["shared.weight"])
    return False


def t5_scaled(hf):
    """T5 v1.0 scales the tied head's input by d_model^-0.5; transformers 5 says so in scale_decoder_outputs."""
    return hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True))


def t5_layer_names(config, stack, i):
    """(ours, theirs) prefixes of one block's sublayers: self-attention, [cross-attention], MLP."""
    ours, theirs = ("encoder." if stack == "encoder" else "") + f"blocks.{i}", f"{stack}.block.{i}.layer"
    names = [(f"{ours}.norm1", f"{theirs}.0.layer_norm")]
    if stack == "decoder":
        names.append((f"{ours}.norm_x", f"{theirs}.1.layer_norm"))
    names.append((f"{ours}.norm2", f"{theirs}.{len(names)}.layer_norm"))
    return ours, theirs, names


def t5_fc(config):
    return ("wi_0", "wi_1") if config.mlp in ("geglu", "swiglu") else ("wi",)


def t5_to_ours(hf_state, config, hf_config):
    s, root = hf_state, math.sqrt(config.n_embd // config.n_head)  # T5's scores are q.k, unscaled
    state = {"tok_emb.weight": s["shared.weight"], "encoder.norm_f.weight": s["encoder.final_layer_norm.weight"],
             "encoder.positions.bias.weight": s["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
             "positions.bias.weight": s["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
             "norm_f.weight": s["decoder.final_layer_norm.weight"] * (config.n_embd**-0.5 if t5_scaled(hf_config) else 1)}
    for stack, n in (("encoder", config.n_encoder_layer), ("decoder", config.n_layer)):
        for i in range(n):
            ours, theirs, norms = t5_layer_names(config, stack, i)
            state |= {f"{o}.weight": s[f"{t}.weight"] for o, t in norms}
            a = f"{theirs}.0.SelfAttention"
            state[f"{ours}.attn.qkv.weight"] = torch.cat([s[f"{a}.q.weight"] * root, s[f"{a}.k.weight"], s[f"{a}.v.weight"]])
            state[f"{ours}.attn.proj.weight"] = s[f"{a}.o.weight"]
            mlp = f"{theirs}.{len(norms) - 1}.DenseReluDense"
            state[f"{ours}.mlp.fc.weight"] = torch.cat([s[f"{mlp}.{w}.weight"] for w in t5_fc(config)])
            state[f"{ours}.mlp.proj.weight"] = s[f"{mlp}.wo.weight"]
            if stack == "decoder":
                x = f"{theirs}.1.EncDecAttention"
                state[f"{ours}.cross.q.weight"] = s[f"{x}.q.weight"] * root
                state[f"{ours}.cross.kv.weight"] = torch.cat([s[f"{x}.k.weight"], s[f"{x}.v.weight"]])
                state[f"{ours}.cross.proj.weight"] = s[f"{x}.o.weight"]
    if not config.tie_embeddings:
        state["lm_head.weight"] = s["lm_head.weight"]
    return state


def t5_from_ours(state, config):
    root = math.sqrt(config.n_embd // config.n_head)
    hf = {"shared.weight": state["tok_emb.weight"], "encoder.final_layer_norm.weight": state["encoder.norm_f.weight"],
          "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": state["encoder.positions.bias.weight"],
          "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": state["positions.bias.weight"],
          "decoder.final_layer_norm.weight": state["norm_f.weight"] / (config.n_embd**-0.5 if config.tie_embeddings else 1)}
    if not config.tie_embeddings:  # (transformers ties the embeddings' copies, and a tied head, on loading)
        hf["lm_head.weight"] = state["lm_head.weight"]
    for stack, n in (("encoder", config.n_encoder_layer), ("decoder", config.n_layer)):
        for i in range(n):
            ours, theirs, norms = t5_layer_names(config, stack, i)
            hf |= {f"{t}.weight": state[f"{o}.weight"] for o, t in norms}
            a = f"{theirs}.0.SelfAttention"
            q, k, v = state[f"{ours}.attn.qkv.weight"].chunk(3)
            hf |= {f"{a}.q.weight": q / root, f"{a}.k.weight": k, f"{a}.v.weight": v, f"{a}.o.weight": state[f"{ours}.attn.proj.weight"]}
            mlp = f"{theirs}.{len(norms) - 1}.DenseReluDense"
            hf |= dict(zip((f"{mlp}.{w}.weight" for w in t5_fc(config)), state[f"{ours}.mlp.fc.weight"].chunk(len(t5_fc(config)))))
            hf[f"{mlp}.wo.weight"] = state[f"{ours}.mlp.proj.weight"]
            if stack == "decoder":
                x = f"{theirs}.1.EncDecAttention"
                k, v = state[f"{ours}.cross.kv.weight"].chunk(2)
                hf |= {f"{x}.q.weight": state[f"{ours}.cross.q.weight"] / root, f"{x}.k.weight": k, f"{x}.v.weight": v,
                       f"{x}.o.weight": state[f"{ours}.cross.proj.weight"]}
    return hf


def t5_hf_config(config):
    proj = {ours: theirs for theirs, ours in T5_MLPS.items()}[config.mlp]
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": config.vocab_size,
        "d_model": config.n_embd, "d_kv": config.n_embd // config.n_head, "d_ff": config.mlp_hidden,
        "num_layers": config.n_encoder_layer, "num_decoder_layers": config.n_layer, "num_heads": config.n_head,
        "relative_attention_num_buckets": config.t5_buckets, "relative_attention_max_distance": config.t5_max_distance,
        "layer_norm_epsilon": config.norm_eps, "feed_forward_proj": proj, "dropout_rate": config.dropout,
        "tie_word_embeddings": config.tie_embeddings, "scale_decoder_outputs": config.tie_embeddings,
        "is_encoder_decoder": True, "n_positions": config.block_size,
        "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, "dtype": "float32",
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Which of them a config is


def wanted(config):
    """(transformers' name, {key: value it needs}) for an encoder or encoder-decoder config."""
    if config.family == "encoder-decoder":
        return "t5", dict(pos_emb="t5", norm="rmsnorm", bias=False, norm_placement="pre", qk_norm=False,
                          n_kv_head=config.n_head, attn_pattern="L", mlp=config.mlp if config.mlp in T5_MLPS.values() else "relu")
    common = dict(pos_emb="learned", norm="layernorm", bias=True, qk_norm=False, n_kv_head=config.n_head, attn_pattern="L",
                  mlp=config.mlp if config.mlp in ("gelu", "gelu_exact", "relu") else "gelu_exact")
    if config.image_size:
        return "vit", common | dict(norm_placement="pre", emb_norm=False, pooler=False)
    return "bert", common | dict(norm_placement="post", emb_norm=True, pooler=config.head == "classify")


def family_of(config):
    """'bert', 'vit' or 't5' for an encoder's or encoder-decoder's config; else one line of what differs."""
    name, keys = wanted(config)
    wrong = [f"{k}={v!r}" for k, v in keys.items() if getattr(config, k) != v]
    if wrong:
        title = {"t5": "T5", "vit": "ViT", "bert": "BERT"}[name]
        raise PretrainedError(f"this {config.family} has no Hugging Face equivalent: {title} needs {', '.join(wrong)}")
    return name


FAMILIES = {  # model_type: (its config -> our keys, its weights -> ours, our config -> its, our weights -> its)
    "bert": (bert_config, bert_to_ours, bert_hf_config, bert_from_ours),
    "vit": (vit_config, vit_to_ours, vit_hf_config, vit_from_ours),
    "t5": (t5_config, t5_to_ours, t5_hf_config, t5_from_ours),
}
