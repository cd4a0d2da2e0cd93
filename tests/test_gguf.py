"""gguf_file.py and export.py --gguf: the GGUF holds what llama.cpp reads (keys, tensors in its names and layouts,
the tokenizer as GPT-2's byte-level BPE), transformers' own GGUF loader gives our logits, and what llama.cpp
cannot run is refused in one line with nothing written. (Against llama.cpp itself: tools/llamacpp.py.)"""

import os

import pytest
import torch
from conftest import build, make_text, one_error_line, run_main

gguf = pytest.importorskip("gguf", reason="GGUF export needs the gguf package (requirements-dev.txt)")

import gguf_file  # noqa: E402

LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)
SHAPES = {"llama": dict(LLAMA, n_kv_head=2, tie_embeddings=False), "qwen3": dict(LLAMA, qk_norm=True, n_kv_head=2),
          "gpt2": dict(pos_emb="learned", norm="layernorm", mlp="gelu", bias=True), "arcee": dict(LLAMA, mlp="relu2")}  # fmt: skip
CHARS = "".join(sorted(set(make_text(3000) + "é…")))


def model_of(shape):
    torch.manual_seed(0)
    model = build(**SHAPES[shape], vocab_size=len(CHARS), block_size=32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_file_holds_the_keys_and_tensors_llama_cpp_reads(shape, tmp_path):
    model = model_of(shape)
    path = str(tmp_path / "m.gguf")
    assert gguf_file.write_gguf(model, {"kind": "char", "chars": CHARS}, path) == shape
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    c = model.config
    assert field("general.architecture") == shape and field(f"{shape}.block_count") == c.n_layer
    assert field(f"{shape}.context_length") == c.block_size and field(f"{shape}.embedding_length") == c.n_embd
    assert field("tokenizer.ggml.model") == "gpt2" and len(field("tokenizer.ggml.tokens")) == c.vocab_size
    assert field("tokenizer.ggml.add_bos_token") is False
    names = {t.name for t in reader.tensors}
    per_layer = {"attn_norm", "attn_output", "ffn_norm", "ffn_up", "ffn_down"} | (
        {"attn_qkv"} if shape == "gpt2" else {"attn_q", "attn_k", "attn_v"}) | ({"ffn_gate"} if shape in ("llama", "qwen3") else set()) | (
        {"attn_q_norm", "attn_k_norm"} if shape == "qwen3" else set())  # fmt: skip
    assert {n.split(".")[2] for n in names if n.startswith("blk.1.")} == per_layer
    assert ("output.weight" in names) == (not c.tie_embeddings) and "token_embd.weight" in names


@pytest.mark.parametrize("shape", ["llama", "qwen3", "gpt2"])
def test_transformers_reads_our_gguf_with_our_logits(shape, tmp_path):
    """transformers' GGUF loader (its own reading of llama.cpp's names and its un-permuting of q and k) gives
    our logits within 1e-4 in f32. Two keys its mapping drops are given back by hand: GPT-2's n_positions
    (it reads context_length as n_ctx) and Qwen3's head_dim (it ignores key_length)."""
    transformers = pytest.importorskip("transformers")
    model = model_of(shape)
    gguf_file.write_gguf(model, {"kind": "char", "chars": CHARS}, str(tmp_path / "m.gguf"))
    fixes = {"gpt2": {"n_positions": 32}, "qwen3": {"head_dim": model.config.n_embd // model.config.n_head}}.get(shape, {})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32,
                                                               **fixes).eval()
    idx = torch.randint(0, len(CHARS), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(idx)[0] - theirs(idx).logits).abs().max().item() <= 1e-4


def bpe_of(tokens, merges):
    """A Hugging Face tokenizer from a GGUF's vocabulary as llama.cpp's gpt2 model reads it: GPT-2's pre-tokenizer,
    byte-level, these merges."""
    tk = pytest.importorskip("tokenizers")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    for left, right in pairs:  # llama.cpp merges by rank alone; Hugging Face's BPE wants each result in its vocab
        for piece in (left, right, left + right):
            vocab.setdefault(piece, len(vocab))
    tok = tk.Tokenizer(tk.models.BPE(vocab, pairs))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tok


MIXED = make_text(4000) + "\n\tTabs, digits 1234567 and 3.14, naïve café, emoji 🙂, 日本語.\n"


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_the_vocabulary_encodes_text_as_ours_does(kind, tmp_path):
    """The tokens and merges written, run as a byte-level BPE, give our ids on a mixed text (characters: on the
    text's own characters)."""
    from tokenizer import BPETokenizer, TiktokenTokenizer, char_tokenizer_for

    if kind == "char":
        ours = char_tokenizer_for(MIXED)
    elif kind == "bpe":
        ours = BPETokenizer.train(make_text(20000), 400)
    else:
        try:
            ours = TiktokenTokenizer("gpt2")
        except Exception as e:  # no tiktoken cache and no network
            pytest.skip(f"tiktoken gpt2 files unavailable: {e}")
    tokens, types, merges, special = gguf_file.gguf_vocab(ours.meta(), ours.vocab_size)
    assert len(tokens) == len(types) == ours.vocab_size
    ids = bpe_of(tokens, merges).encode(MIXED).ids
    assert ids == ours.encode(MIXED) and len(ids) > 1000


@pytest.mark.parametrize("keys, message", [
    (dict(pos_emb="alibi"), "needs pos_emb='learned'"),
    (dict(LLAMA, attn_pattern="S", attn_window=8), "attn_window=8 is shorter than block_size=32"),
    (dict(LLAMA, attn_pattern="R"), "attn_pattern="),
    (dict(LLAMA, norm_placement="post"), "norm_placement='pre'"),
])  # fmt: skip
def test_what_llama_cpp_cannot_run_is_one_line_and_no_file(keys, message, tmp_path):
    model = build(**keys, vocab_size=len(CHARS), block_size=32)
    with pytest.raises(gguf_file.GGUFError, match=message.replace("(", r"\(").replace("[", r"\[")):
        gguf_file.write_gguf(model, {"kind": "char", "chars": CHARS}, str(tmp_path / "m.gguf"))
    assert not os.listdir(tmp_path)


def test_export_writes_a_gguf_and_refuses_to_overwrite_it(tmp_path, trained_run):
    path = tmp_path / "run.gguf"
    done = run_main("export.py", f"--out_dir={trained_run}", f"--gguf={path}", "--gguf_type=q8_0")
    assert done.returncode == 0 and path.exists() and "q8_0" in done.stdout, done.stderr
    again = run_main("export.py", f"--out_dir={trained_run}", f"--gguf={path}")
    assert again.returncode == 2 and "--overwrite=True replaces it" in one_error_line(again)
    bad = run_main("export.py", f"--out_dir={trained_run}", f"--gguf={tmp_path / 'x.gguf'}", "--gguf_type=q4")
    assert bad.returncode == 2 and "gguf_type='q4'" in one_error_line(bad) and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("shape", list(SHAPES))
def test_our_reader_gives_back_what_we_wrote(shape, tmp_path):
    """f32: the same config and weights bit for bit, and the same tokenizer; q8_0: weights within Q8_0's bound
    (a step of the largest block scale, max|w| / 127: half a step of rounding, and the scale's own in f16)."""
    from checkpoint import load_any

    model = model_of(shape)
    meta = {"kind": "chat", "base": {"kind": "char", "chars": CHARS[:-4]}} if shape == "arcee" else {"kind": "char", "chars": CHARS}
    for ftype in ("f32", "q8_0"):
        path = str(tmp_path / f"{ftype}.gguf")
        gguf_file.write_gguf(model, meta, path, ftype)
        back, tokenizer, state = load_any(path)
        assert back.config == model.config and state is None and tokenizer.meta() == meta
        for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
            bound = 0 if ftype == "f32" or a.dim() == 1 else a.abs().max().item() / 127
            assert (a - b).abs().max().item() <= bound, (ftype, name)


def test_a_window_that_covers_the_context_goes_as_llama(tmp_path):
    model = build(**LLAMA, attn_pattern="S", attn_window=32, vocab_size=len(CHARS), block_size=32)
    assert gguf_file.write_gguf(model, {"kind": "char", "chars": CHARS}, str(tmp_path / "m.gguf")) == "llama"


def test_a_gguf_fine_tunes_on_a_dataset_of_its_vocabulary_only(tmp_path, trained_run, char_dataset, bpe_run):
    """train.py --init_from=FILE.gguf starts from the file's weights (its first evaluation is the run's own, to
    float rounding); a dataset of another vocabulary is refused in one line."""
    from checkpoint import load_checkpoint, read_metrics

    path = tmp_path / "run.gguf"
    assert run_main("export.py", f"--out_dir={trained_run}", f"--gguf={path}").returncode == 0
    keys = [f"--dataset={char_dataset}", "--max_iters=2", "--eval_interval=2", "--eval_iters=2", "--batch_size=4",
            "--device=cpu", "--dtype=float32", "--log_interval=1"]
    done = run_main("train.py", f"--init_from={path}", *keys, f"--out_dir={tmp_path / 'tuned'}")
    assert done.returncode == 0, done.stderr
    again = run_main("train.py", f"--init_from={trained_run}", *keys, f"--out_dir={tmp_path / 'plain'}")
    assert again.returncode == 0, again.stderr
    first = [next(r["val_loss"] for r in read_metrics(str(tmp_path / d)) if "val_loss" in r) for d in ("tuned", "plain")]
    assert abs(first[0] - first[1]) < 1e-5, first
    assert load_checkpoint(str(tmp_path / "tuned" / "ckpt.pt"))["tokenizer"] == load_checkpoint(f"{trained_run}/ckpt.pt")["tokenizer"]
    other = tmp_path / "bpe.gguf"
    assert run_main("export.py", f"--out_dir={bpe_run[1]}", f"--gguf={other}").returncode == 0
    refused = run_main("train.py", f"--init_from={other}", *keys, f"--out_dir={tmp_path / 'x'}")
    assert refused.returncode == 2 and "holds another vocabulary" in one_error_line(refused)
    missing = run_main("train.py", f"--init_from={tmp_path / 'none.gguf'}", *keys, f"--out_dir={tmp_path / 'y'}")
    assert missing.returncode == 2 and "no such GGUF file" in one_error_line(missing)


@pytest.mark.parametrize("source", ["gpt2 run", "llama file", "qwen3 file"])
def test_llama_cpp_gives_our_greedy_tokens_or_the_tool_says_how_to_get_it(source, tmp_path, trained_run):
    """tools/llamacpp.py: with llama.cpp, the prompt's ids, the greedy tokens (up to the 32-token context) and the
    teacher-forced logits (within 1e-4) are ours; without it, one line saying how to get it, and exit status 2.
    For a file, ours is our reading of it; test_our_reader_gives_back_what_we_wrote closes the loop to the model
    the file was written from (together: llama.cpp runs what we trained)."""
    import subprocess
    import sys

    from conftest import ROOT

    from configurator import UserError

    sys.path.insert(0, str(ROOT / "tools"))
    import llamacpp

    try:
        python = llamacpp.llama_python()
    except UserError:
        python = None
    where = f"--out_dir={trained_run}"  # the suite's character run: GPT-2's shape
    if source.endswith("file"):  # RoPE shapes (llama permutes q and k, qwen3 does not), read back by us from the file
        where = f"--init_from={tmp_path / 'm.gguf'}"
        gguf_file.write_gguf(model_of(source.split()[0]), {"kind": "char", "chars": CHARS}, str(tmp_path / "m.gguf"))
    args = [sys.executable, str(ROOT / "tools" / "llamacpp.py"), where, "--start=The king", "--new_tokens=32"]
    if python is None:
        missing = subprocess.run(args, capture_output=True, text=True)
        assert missing.returncode == 2 and "pip install llama-cpp-python" in missing.stderr
        pytest.skip("llama.cpp is not installed here (pip install llama-cpp-python, or ../shared/build-llamacpp.sh)")
    import re

    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    equal, total = map(int, re.search(r"greedy: (\d+)/(\d+) tokens equal", done.stdout).groups())
    diff = float(re.search(r"logits: max difference (\S+)", done.stdout).group(1))
    assert done.returncode == 0 and "ids equal" in done.stdout and equal == total >= 20 and diff <= 1e-4, done.stdout


def test_f16_and_bf16_read_back_within_their_rounding_and_other_files_get_one_line(tmp_path):
    from checkpoint import load_any

    model = model_of("llama")
    for ftype, relative in (("f16", 2**-11), ("bf16", 2**-8)):
        gguf_file.write_gguf(model, {"kind": "char", "chars": CHARS}, str(tmp_path / f"{ftype}.gguf"), ftype)
        back = load_any(str(tmp_path / f"{ftype}.gguf"))[0]
        for a, b in zip(model.state_dict().values(), back.state_dict().values()):
            assert (a - b).abs().max().item() <= relative * a.abs().max().item() + 1e-12
    other = gguf.GGUFWriter(str(tmp_path / "phi3.gguf"), "phi3")
    other.add_token_list(["a", "b"])
    gguf_file.write_out(other)
    other.close()
    with pytest.raises(gguf_file.GGUFError, match="architecture 'phi3' is not supported; supported: gpt2, llama, qwen3, arcee"):
        load_any(str(tmp_path / "phi3.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(gguf_file.GGUFError, match="not a GGUF file"):
        load_any(str(tmp_path / "text.gguf"))


def test_the_end_token_of_a_character_vocabulary_is_a_padding_row_and_foreign_vocabularies_are_refused(tmp_path):
    """A character model has no end-of-text token: a padding row stands in (llama.cpp's default, id 11, would be a
    character); a hole of unused tokens inside a vocabulary keeps the later ids; a SentencePiece file is refused."""
    vocab = gguf_file.gguf_vocab({"kind": "char", "chars": CHARS}, len(CHARS) + 2)
    assert vocab[3] == {"eos": len(CHARS)} and gguf_file.gguf_vocab({"kind": "char", "chars": CHARS}, len(CHARS))[3] == {}
    T = gguf.TokenType
    holed = gguf_file.tokenizer_of((["a", "[PAD1]", "b", "ab", "[PAD4]"], [T.NORMAL, T.UNUSED, T.NORMAL, T.NORMAL, T.UNUSED],
                                    ["a b"], {}))
    assert holed.vocab_size == 4 and holed.encode("ab") == [3] and holed.encode("b") == [2]
    path = str(tmp_path / "sp.gguf")
    gguf_file.write_gguf(model_of("llama"), {"kind": "char", "chars": CHARS}, path)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "llama-sp.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith(("llama.", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type")):
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    writer.add_tokenizer_model("llama")
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    gguf_file.write_out(writer)
    writer.close()
    from checkpoint import load_any

    with pytest.raises(gguf_file.GGUFError, match="its tokenizer is 'llama'.*GPT-2's byte-level BPE"):
        load_any(str(tmp_path / "llama-sp.gguf"))


def test_a_chat_gguf_fine_tunes_on_its_conversations(tmp_path, sft_run, chat_data):
    path = tmp_path / "chat.gguf"
    assert run_main("export.py", f"--out_dir={sft_run}", f"--gguf={path}").returncode == 0
    done = run_main("train.py", f"--init_from={path}", f"--dataset={chat_data[1]}", "--max_iters=2", "--eval_interval=2",
                    "--eval_iters=1", "--batch_size=2", "--device=cpu", f"--out_dir={tmp_path / 'tuned'}")
    assert done.returncode == 0, done.stderr
