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
    if config.family != "decoder":
        raise GGUFError(f"this model is family={config.family!r}; the GGUF export writes decoder-only models (llama.cpp's "
                        "text generation): export it for transformers with --hf_dir")
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


def relayout(w, name, arch, config, inverse=False):
    """A Hugging Face-named tensor in llama.cpp's layout (inverse: back): GPT-2's Conv1D matrices stored as linear
    maps, llama's and arcee's q and k rows in interleaved pairs."""
    if arch == "GPT2" and w.dim() == 2 and name not in ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"):
        return w.t()
    if arch in ROTATES_PAIRS and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.n_head if name.endswith("q_proj.weight") else config.n_kv_head
        return (unpermute_pairs if inverse else permute_pairs)(w, heads)
    return w


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
        w = relayout(w, name, arch, c)
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise GGUFError(f"no llama.cpp name for {name} in the {arch.lower()} architecture")
        out[mapped] = w.contiguous()
    return out


def encoded(w, name, ftype):
    """(numpy data, its GGML type) for one tensor: 1-D ones (norms, biases) and GPT-2's position table stay f32, as
    llama.cpp's converter keeps them."""
    gguf = gguf_package()
    T = gguf.GGMLQuantizationType
    if w.dim() == 1 or ftype == "f32" or name == "position_embd.weight":
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
        write_out(writer)
    finally:
        writer.close()
    return arch.lower()


def write_out(writer):
    """A GGUFWriter's keys and tensors, written in the file's order (header, metadata, tensor data)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()


# ----------------------------------------------------------------------------------------------------
# The tokenizer, as GPT-2's byte-level BPE


@functools.cache
def byte_chars():
    """GPT-2's byte-level alphabet (hf.py's table), made once."""
    return hf.byte_to_unicode()


def as_byte_level(data):
    table = byte_chars()
    return "".join(table[b] for b in data)


@functools.cache
def gpt2_tokens():
    """tiktoken's gpt2 in GGUF's form: (50,257 tokens in GPT-2's alphabet, <|endoftext|> last; 50,000 merges)."""
    vocab, merges = hf.gpt2_byte_level()
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens + [EOT], [f"{left} {right}" for left, right in merges]


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
        if base["encoding"] != "gpt2":
            raise GGUFError(f"tokenizer {base['encoding']!r}: GGUF export carries tiktoken's gpt2, our bpe:N and "
                            "character vocabularies")
        tokens, merges = gpt2_tokens()
        types = [CONTROL if t == EOT else NORMAL for t in tokens]
        special = {"bos": len(tokens) - 1, "eos": len(tokens) - 1}
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
    if "eos" not in special and pad:  # a vocabulary without an end token: a padding row, which no text reaches, is
        special = {"eos": len(tokens)}  # one (without any, llama.cpp takes id 11, a character, as its end)
    tokens += [f"[PAD{i}]" for i in range(pad)]  # rows no text reaches (a vocabulary rounded up for speed)
    types += [UNUSED] * pad
    return tokens, types, merges, special


# ----------------------------------------------------------------------------------------------------
# Reading a GGUF back: the architectures written above, from here or elsewhere

FAMILIES = {arch.lower(): family for family, arch in ARCHS.items() if family != "mistral"}  # llama.cpp arch -> hf family


def f32_value(value):
    """A float GGUF stored as float32, as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(f"{np.float32(value):.7g}")


def config_keys(fields, arch, vocab_size):
    """Our GPTConfig keys from a GGUF's hyperparameters; a GGUFError names one that is missing."""
    absent = object()

    def get(key, default=absent):
        if f"{arch}.{key}" in fields:
            return fields[f"{arch}.{key}"].contents()
        if default is absent:
            raise GGUFError(f"the file has no {arch}.{key}, which a {arch} model needs")
        return default

    n_embd, n_head = get("embedding_length"), get("attention.head_count")
    keys = dict(block_size=get("context_length"), vocab_size=vocab_size, n_layer=get("block_count"), n_head=n_head,
                n_embd=n_embd, mlp_hidden=get("feed_forward_length"))
    if get("attention.key_length", n_embd // n_head) != n_embd // n_head:
        raise GGUFError(f"attention.key_length={get('attention.key_length')} is not embedding_length / head_count; "
                        "such heads are not supported")
    if arch == "gpt2":
        return keys | dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=True,
                           norm_eps=f32_value(get("attention.layer_norm_epsilon")))
    keys |= dict(n_kv_head=get("attention.head_count_kv", n_head), pos_emb="rope", norm="rmsnorm", bias=False,
                 norm_eps=f32_value(get("attention.layer_norm_rms_epsilon")), rope_theta=f32_value(get("rope.freq_base", 10000.0)),
                 mlp="relu2" if arch == "arcee" else "swiglu", qk_norm=arch == "qwen3")
    scaling = get("rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise GGUFError(f"rope.scaling.type={scaling!r} is not supported (linear and yarn are)")
        keys |= dict(rope_scaling=scaling, rope_factor=f32_value(get("rope.scaling.factor")),
                     trained_block_size=get("rope.scaling.original_context_length"))
    return keys


def read_gguf(path, build):
    """(the model build(keys) makes with the file's weights, dequantized to fp32; its tokenizer's parts) from a GGUF
    of the architectures write_gguf writes. The parts: tokens, token types, merges, and the special ids."""
    gguf = gguf_package()
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: not a GGUF file llama.cpp's reader can open ({e})") from None
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    if arch not in FAMILIES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.model"):
        if key not in fields:
            raise GGUFError(f"{path}: no {key} in the file; it cannot be read as a model with its tokenizer")
    model_kind = fields["tokenizer.ggml.model"].contents()
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else "default"
    if model_kind != "gpt2" or pre not in ("gpt-2", "default"):
        raise GGUFError(f"{path}: its tokenizer is {model_kind!r} with pre-tokenizer {pre!r}; GPT-2's byte-level BPE "
                        "(model 'gpt2', pre 'gpt-2') is the one read here")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    tied = "output.weight" not in {t.name for t in reader.tensors}  # llama.cpp's head is the embedding then
    model = build(config_keys(fields, arch, len(tokens)) | {"tie_embeddings": tied})
    c = model.config
    # the names write_gguf gives each of our weights, read backwards (a tied head's absent output included)
    ours_to_theirs = {}
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    hf_names = hf.HF_FAMILIES[FAMILIES[arch]][3](state, c)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.n_layer)
    for name in hf_names:
        ours_to_theirs[names.get_name(name, try_suffixes=(".weight", ".bias"))] = name
    hf_state = {}
    for t in reader.tensors:
        if t.name not in ours_to_theirs:
            raise GGUFError(f"{path}: tensor {t.name} has no place in a {arch} model of this shape")
        data = gguf.quants.dequantize(t.data, t.tensor_type) if t.tensor_type not in (
            gguf.GGMLQuantizationType.F32,) else np.asarray(t.data)
        w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(tuple(reversed([int(n) for n in t.shape])))
        name = ours_to_theirs[t.name]
        hf_state[name] = relayout(w, name, arch.upper(), c, inverse=True)
    ours = hf.HF_FAMILIES[FAMILIES[arch]][1](hf_state, c)
    if c.tie_embeddings:
        ours["lm_head.weight"] = ours["tok_emb.weight"]
    missing = set(state) - set(ours)
    if missing:
        raise GGUFError(f"{path}: weights missing for {sorted(missing)[:3]}")
    model.load_state_dict({k: ours[k] for k in state})
    special = {key: fields[f"tokenizer.ggml.{key}_token_id"].contents() for key in ("bos", "eos")
               if f"tokenizer.ggml.{key}_token_id" in fields}
    merges = fields["tokenizer.ggml.merges"].contents() if "tokenizer.ggml.merges" in fields else []
    return model, (tokens, fields["tokenizer.ggml.token_type"].contents(), merges, special)


def unpermute_pairs(w, n_head):
    """permute_pairs undone: llama.cpp's interleaved pairs back to rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_of(parts):
    """Our tokenizer for a GGUF's vocabulary: a character vocabulary, tiktoken's gpt2, or else a byte-level BPE
    (as Hugging Face's tokenizers runs it); with the chat template's four tokens last, a ChatTokenizer over it."""
    from tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, TiktokenTokenizer, tokenizers_package

    gguf = gguf_package()
    tokens, types, merges, special = parts
    while types and types[-1] == gguf.TokenType.UNUSED:  # trailing padding rows (a hole inside keeps its id)
        tokens, types = tokens[:-1], types[:-1]
    chat = tokens[-len(CHAT_TOKENS):] == list(CHAT_TOKENS)
    if chat:
        tokens, types = tokens[: -len(CHAT_TOKENS)], types[: -len(CHAT_TOKENS)]
    unbyte = {ch: b for b, ch in byte_chars().items()}

    def text_of(token):
        try:
            return bytes(unbyte[ch] for ch in token).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            return None

    texts = [text_of(t) for t in tokens]
    if all(text is not None and len(text) == 1 for text in texts) and gguf.TokenType.CONTROL not in types:
        base = CharTokenizer("".join(texts))
    elif len(tokens) == 50257 and tokens[50256] == EOT and gpt2_offline_safe() == tokens:
        base = TiktokenTokenizer("gpt2")
    else:  # built as BPETokenizer.train builds ours: byte-level pre-tokenizer and decoder, control tokens special
        tk = tokenizers_package("a GGUF's byte-level BPE")
        tok = tk.Tokenizer(tk.models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([t for t, kind in zip(tokens, types) if kind == gguf.TokenType.CONTROL])
        base = BPETokenizer(tok.to_str())
    return ChatTokenizer(base) if chat else base


def gpt2_offline_safe():
    """gpt2_tokens()'s tokens, or None where tiktoken's files cannot be had (the vocabulary is then read as a BPE)."""
    from configurator import DataError

    try:
        return gpt2_tokens()[0]
    except DataError:
        return None


def load_gguf(path, build):
    """(model, tokenizer) from a GGUF file: read_gguf and tokenizer_of."""
    model, parts = read_gguf(path, build)
    return model, tokenizer_of(parts)
