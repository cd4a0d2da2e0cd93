"""
GGUF, llama.cpp's one-file format: a trained model written so that llama.cpp (and so Ollama, LM Studio) runs it.

  write_gguf(model, tokenizer_meta, path, ftype)   export.py --gguf=FILE.gguf [--gguf_type=f32|f16|bf16|q8_0]

The architecture is the llama.cpp one that computes what the model computes: gpt2 for GPT-2's shape, llama for
RoPE + RMSNorm + SwiGLU (grouped heads too; a Mistral-shaped model whose window covers its whole context),
qwen3 with QK-norm, arcee for the non-gated ReLU² MLP (the Quick start's shape). The shapes come from hf.py's
families, so one table says which switches have a counterpart; anything else is refused in one line that names
what it needs. Tensors take llama.cpp's names (the gguf package's own map, from the Hugging Face names hf.py
writes) and its layouts: llama and arcee rotate q and k pairwise (GPT-J's order), so their rows are permuted
as llama.cpp's converter permutes them; GPT-2's matrices are stored as linear maps.

The tokenizer goes in as GPT-2's byte-level BPE, which llama.cpp reads ("gpt2", pre-tokenizer "gpt-2"): tiktoken's
gpt2 with its merges rebuilt from its ranks, our bpe:N with its own merges, and a character vocabulary as
byte-level tokens whose only merges join the bytes of one character (so every character stays one token). A
chat model's four template tokens are control tokens, its template is written in Jinja and its end token is
<|end|>. No beginning-of-text token is added, as we add none.
"""

import functools

import numpy as np
import torch

import hf
from configurator import UserError
from tokenizer import CHAT_TEMPLATE, CHAT_TOKENS, EOT

FTYPES = ("f32", "f16", "bf16", "q8_0")
ARCHS = {"gpt2": "GPT2", "llama": "LLAMA", "mistral": "LLAMA", "qwen3": "QWEN3", "arcee": "ARCEE"}  # hf family ->
ROTATES_PAIRS = ("LLAMA", "ARCEE")  # llama.cpp's NORM rope: q and k rows permuted from our rotate-half order


class GGUFError(UserError):
    """A model or file GGUF cannot carry: one line for the user, no traceback."""


def gguf_package():
    try:
        import gguf
    except ImportError:
        raise GGUFError("GGUF needs the gguf package (llama.cpp's own reader and writer): pip install gguf") from None
    return gguf


def arch_of(config):
    """The llama.cpp architecture (a gguf.MODEL_ARCH name) that computes what config computes, or a GGUFError."""
    try:
        family = hf.hf_family(config)
    except hf.PretrainedError as e:
        raise GGUFError(f"no llama.cpp architecture computes this model: {str(e).split(': ', 1)[-1]}") from None
    if family == "mistral" and config.attn_window < config.block_size:
        raise GGUFError(f"attn_window={config.attn_window} is shorter than block_size={config.block_size}: llama.cpp's "
                        "llama architecture attends over the whole context; export a model whose window covers it")
    return ARCHS[family]


def permute_pairs(w, n_head):
    """Rows of q or k from rotate-half order (ours, Hugging Face's) to llama.cpp's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, arch):
    """{llama.cpp name: fp32 tensor in its layout} for the model's weights."""
    gguf = gguf_package()
    c = model.config
    family = hf.hf_family(c)
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    hf_state = hf.HF_FAMILIES[family][3](state, c)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch), c.n_layer)
    out = {}
    for name, w in hf_state.items():
        if arch == "GPT2" and w.dim() == 2 and not name.endswith("wte.weight") and not name.endswith("wpe.weight") \
                and name != "lm_head.weight":
            w = w.t()  # GPT-2's Conv1D stores x @ W; GGUF holds the linear map
        if arch in ROTATES_PAIRS and name.endswith("q_proj.weight"):
            w = permute_pairs(w, c.n_head)
        elif arch in ROTATES_PAIRS and name.endswith("k_proj.weight"):
            w = permute_pairs(w, c.n_kv_head)
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise GGUFError(f"no llama.cpp name for {name} in the {arch.lower()} architecture")
        out[mapped] = w.contiguous()
    return out


def encoded(w, name, ftype):
    """(numpy data, its GGML type) for one tensor: 1-D ones (norms, biases) stay f32, as llama.cpp's converter keeps them."""
    gguf = gguf_package()
    T = gguf.GGMLQuantizationType
    if w.dim() == 1 or ftype == "f32":
        return w.numpy().astype(np.float32), T.F32
    if ftype == "f16":
        return w.numpy().astype(np.float16), T.F16
    if ftype == "bf16":
        return gguf.quants.quantize(w.numpy(), T.BF16), T.BF16
    if w.shape[-1] % 32:  # Q8_0 packs rows in blocks of 32
        return w.numpy().astype(np.float16), T.F16
    return gguf.quants.quantize(w.numpy(), T.Q8_0), T.Q8_0


def write_gguf(model, tokenizer_meta, path, ftype="f32"):
    """Writes model and its tokenizer (a meta dict, as checkpoints record it) to path as one GGUF file."""
    gguf = gguf_package()
    if ftype not in FTYPES:
        raise GGUFError(f"gguf_type={ftype!r}: use one of {', '.join(FTYPES)}")
    c = model.config
    arch = arch_of(c)
    tokens, types, merges, special = gguf_vocab(tokenizer_meta, c.vocab_size)
    tensors = gguf_tensors(model, arch)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch)])
    try:
        writer.add_name("smallgpt")
        writer.add_context_length(c.block_size)
        writer.add_embedding_length(c.n_embd)
        writer.add_block_count(c.n_layer)
        writer.add_feed_forward_length(c.mlp_hidden)
        writer.add_head_count(c.n_head)
        if arch == "GPT2":
            writer.add_layer_norm_eps(c.norm_eps)
        else:
            writer.add_head_count_kv(c.n_kv_head)
            writer.add_layer_norm_rms_eps(c.norm_eps)
            writer.add_rope_freq_base(c.rope_theta)
            writer.add_rope_dimension_count(c.n_embd // c.n_head)
            writer.add_key_length(c.n_embd // c.n_head)  # (Qwen3's head size need not be n_embd / n_head: say it)
            writer.add_value_length(c.n_embd // c.n_head)
            writer.add_vocab_size(c.vocab_size)
            if c.rope_scaling != "none":
                writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if c.rope_scaling == "linear" else gguf.RopeScalingType.YARN)
                writer.add_rope_scaling_factor(c.rope_factor)
                writer.add_rope_scaling_orig_ctx_len(c.trained_block_size or c.block_size)
        file_types = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                      "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
        writer.add_file_type(file_types[ftype])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_add_bos_token(False)
        for key, value in special.items():
            getattr(writer, f"add_{key}_token_id")(value)
        if tokenizer_meta.get("kind") == "chat":
            writer.add_chat_template(CHAT_TEMPLATE)
        for name, w in tensors.items():
            data, kind = encoded(w, name, ftype)
            writer.add_tensor(name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return arch.lower()


# ----------------------------------------------------------------------------------------------------
# The tokenizer, as GPT-2's byte-level BPE


@functools.cache
def byte_chars():
    """GPT-2's map of the 256 bytes to printable characters (the byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def as_byte_level(data):
    table = byte_chars()
    return "".join(table[b] for b in data)


def tiktoken_merges(enc):
    """The merges of a tiktoken encoding in byte-level form, one per multi-byte token in rank order: the pair its
    bytes come to when merged by rank up to its own (how tiktoken's training made it)."""
    ranks = enc._mergeable_ranks
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            best, i = min(pairs)
            if best >= rank:
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        if len(parts) == 2:
            merges.append(f"{as_byte_level(parts[0])} {as_byte_level(parts[1])}")
    return merges


def gguf_vocab(meta, vocab_size):
    """(tokens, token types, merges, special ids) for a tokenizer meta: GPT-2's byte-level BPE form, padded with
    unused tokens up to the model's vocab_size."""
    gguf = gguf_package()
    NORMAL, CONTROL, UNUSED = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.UNUSED
    kind = meta.get("kind")
    base = meta["base"] if kind == "chat" else meta
    special = {}
    if base.get("kind") == "char":
        tokens = [as_byte_level(ch.encode("utf-8")) for ch in base["chars"]]
        types = [NORMAL] * len(tokens)
        merges = []
        for ch in base["chars"]:
            data = ch.encode("utf-8")
            for i in range(1, len(data)):  # the bytes of one character, joined left to right
                merges.append(f"{as_byte_level(data[:i])} {as_byte_level(data[i:i + 1])}")
        if not merges:  # llama.cpp refuses a BPE without merges and GGUF an empty list: one that never fires
            used = {b for ch in base["chars"] for b in ch.encode("utf-8")}
            idle = as_byte_level(bytes([next(b for b in range(256) if b not in used)]))
            merges = [f"{idle} {idle}"]
    elif base.get("kind") == "tiktoken":
        import tiktoken

        enc = tiktoken.get_encoding(base["encoding"])
        if base["encoding"] != "gpt2":
            raise GGUFError(f"tokenizer {base['encoding']!r}: GGUF export carries tiktoken's gpt2, our bpe:N and "
                            "character vocabularies")
        tokens = [as_byte_level(enc.decode_single_token_bytes(i)) if i != enc.eot_token else EOT for i in range(enc.n_vocab)]
        types = [CONTROL if i == enc.eot_token else NORMAL for i in range(enc.n_vocab)]
        merges = tiktoken_merges(enc)
        special = {"bos": enc.eot_token, "eos": enc.eot_token}
    elif base.get("kind") == "bpe":
        import json

        model = json.loads(base["json"])["model"]
        vocab = model["vocab"]
        tokens = [None] * len(vocab)
        for token, i in vocab.items():
            tokens[i] = token
        types = [CONTROL if t == EOT else NORMAL for t in tokens]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
        special = {"bos": vocab[EOT], "eos": vocab[EOT]}
    else:
        raise GGUFError(f"tokenizer {meta!r}: GGUF export carries tiktoken's gpt2, our bpe:N and character vocabularies")
    if kind == "chat":
        first = len(tokens)
        tokens += list(CHAT_TOKENS)
        types += [CONTROL] * len(CHAT_TOKENS)
        special["eos"] = first + CHAT_TOKENS.index("<|end|>")
    if len(tokens) > vocab_size:
        raise GGUFError(f"the tokenizer has {len(tokens)} tokens, more than the model's vocab_size={vocab_size}")
    pad = vocab_size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(pad)]  # rows no text reaches (a vocabulary rounded up for speed)
    types += [UNUSED] * pad
    return tokens, types, merges, special
