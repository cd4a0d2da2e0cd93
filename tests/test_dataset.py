"""dataset.py and the data/ prepare scripts: token files, batches, real corpora, sharded corpora (tokenizers:
test_tokenizer.py)."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from conftest import ROOT, SHARED_DATA, TINY_RUN, gpt2_or_skip, make_text, run_main, run_script
from configurator import DataError
from dataset import BatchSampler, HEADER, TokenFile, open_split, read_meta, split_files, write_tokens
from tokenizer import CharTokenizer


def gpt2_tokenizer():
    from tokenizer import TiktokenTokenizer

    try:
        return TiktokenTokenizer("gpt2")
    except Exception as e:  # no ../shared tiktoken cache and no network
        pytest.skip(f"tiktoken gpt2 files unavailable: {e}")


needs_corpus = pytest.mark.skipif(not (SHARED_DATA / "tinyshakespeare").is_dir(),
                                  reason="needs the real corpora in ../shared/data")

# ---------------------------------------------------------------------------------------------------
# Token files


@pytest.mark.parametrize("vocab, dtype", [(65, np.uint16), (65536, np.uint16), (65537, np.uint32), (100277, np.uint32)])
def test_token_file_round_trip(tmp_path, vocab, dtype):
    tokens = np.random.default_rng(0).integers(0, vocab, 1000)
    write_tokens(tmp_path / "t.bin", tokens, vocab)
    f = TokenFile(str(tmp_path / "t.bin"))
    assert (f.vocab_size, f.n_tokens, f.dtype) == (vocab, 1000, np.dtype(dtype))
    assert np.array_equal(f.tokens, tokens) and np.array_equal(f.window(10, 5), tokens[10:15])
    assert os.path.getsize(tmp_path / "t.bin") == HEADER.itemsize + 1000 * np.dtype(dtype).itemsize


def test_write_refuses_out_of_range_tokens(tmp_path):
    with pytest.raises(DataError, match=r"token ids must be in \[0, 65\)"):
        write_tokens(tmp_path / "t.bin", np.array([1, 65]), 65)
    assert not list(tmp_path.iterdir())  # no partial file left behind


def test_bad_header_and_truncation_are_named(tmp_path):
    (tmp_path / "garbage.bin").write_bytes(b"\x00" * 200)
    with pytest.raises(DataError, match="garbage.bin: not a token file"):
        TokenFile(str(tmp_path / "garbage.bin"))
    write_tokens(tmp_path / "t.bin", np.arange(100), 65536)
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-1])  # an odd byte length
    with pytest.raises(DataError, match="t.bin: 263 bytes, but its header promises 100 tokens .* truncated"):
        TokenFile(str(tmp_path / "t.bin"))


def test_tokens_beyond_vocabulary_are_refused(tmp_path):
    write_tokens(tmp_path / "train.bin", np.array([1, 2, 70, 3]), 100)
    header = np.frombuffer((tmp_path / "train.bin").read_bytes()[:64], HEADER).copy()
    header["vocab_size"] = 65  # a header that lies about its vocabulary
    (tmp_path / "train.bin").write_bytes(header.tobytes() + (tmp_path / "train.bin").read_bytes()[64:])
    with pytest.raises(DataError, match="token id 70 >= vocabulary size 65"):
        open_split(str(tmp_path), "train", 65)
    with pytest.raises(DataError, match="written for a vocabulary of 65, meta.json says 100"):
        open_split(str(tmp_path), "train", 100)


def test_missing_split_and_meta(tmp_path):
    with pytest.raises(DataError, match="no train.bin or train_\\*.bin; run the dataset's prepare script"):
        open_split(str(tmp_path), "train", 65)
    with pytest.raises(DataError, match="no meta.json"):
        read_meta(str(tmp_path))


# ---------------------------------------------------------------------------------------------------
# Sampling batches


def test_sampler_is_seeded_and_spans_shards(tmp_path):
    for i, start in enumerate((0, 1000, 2000)):
        write_tokens(tmp_path / f"train_{i:06d}.bin", np.arange(start, start + 100), 5000)
    files = [TokenFile(p) for p in split_files(str(tmp_path), "train")]
    a, b = BatchSampler(files, 8, seed=1), BatchSampler(files, 8, seed=1)
    xa, ya = a.sample(300)
    xb, yb = b.sample(300)
    assert torch.equal(xa, xb) and torch.equal(ya[:, :-1], xa[:, 1:])
    assert xa.is_contiguous() and ya.is_contiguous()  # so pin_memory's copy to a GPU can be asynchronous
    assert (xa[:, 1:] - xa[:, :-1] == 1).all()  # every window lies inside one shard
    assert {int(x) // 1000 for x in xa[:, 0]} == {0, 1, 2}
    state = a.state_dict()
    after = a.sample(5)[0]
    b.load_state_dict(state)
    assert torch.equal(b.sample(5)[0], after)
    # a torchrun process reads only its own rows of a step's windows; together they are one process's
    ranks = [BatchSampler(files, 8, seed=2) for _ in range(3)]
    whole = BatchSampler(files, 8, seed=2).sample(12)
    shares = [r.sample(12, slice(4 * i, 4 * (i + 1))) for i, r in enumerate(ranks)]
    assert all(x.shape == (4, 8) for x, _ in shares)
    assert torch.equal(torch.cat([x for x, _ in shares]), whole[0]) and torch.equal(torch.cat([y for _, y in shares]), whole[1])
    assert all(torch.equal(r.state_dict(), ranks[0].state_dict()) for r in ranks)  # the same stream in each


# ---------------------------------------------------------------------------------------------------
# Real corpora (skipped where ../shared/data is absent)


@needs_corpus
def test_shakespeare_gpt2_counts(tmp_path):
    gpt2_tokenizer()
    result = run_main("data/shakespeare/prepare.py", f"--input={SHARED_DATA / 'tinyshakespeare' / 'input.txt'}",
                        f"--out_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "train has 301,966 tokens, val has 36,059 tokens" in result.stdout
    meta = read_meta(str(tmp_path))
    assert meta["tokens"] == {"train": 301966, "val": 36059} and meta["tokenizer"]["encoding"] == "gpt2"


@needs_corpus
@pytest.mark.slow
def test_war_and_peace_counts_and_training(tmp_path):
    tok = gpt2_tokenizer()
    result = run_main("data/prepare.py", str(SHARED_DATA / "warpeace" / "input.txt"), "--tokenizer=gpt2",
                        f"--out={tmp_path / 'warpeace'}")
    assert result.returncode == 0, result.stderr
    assert "train has 715,543 tokens, val has 75,027 tokens" in result.stdout
    text = (SHARED_DATA / "warpeace" / "input.txt").read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    assert tok.decode(TokenFile(str(tmp_path / "warpeace" / "train.bin")).tokens.tolist()) == text[:cut]
    assert tok.decode(TokenFile(str(tmp_path / "warpeace" / "val.bin")).tokens.tolist()) == text[cut:]
    train.main([*TINY_RUN, f"--dataset={tmp_path / 'warpeace'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=3"])
    state = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert state["model_config"]["vocab_size"] == 50257 and state["tokenizer"]["encoding"] == "gpt2"


def test_prepare_tool_on_a_folder(tmp_path):
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text(make_text(3000, seed=1))
    (tmp_path / "src" / "sub" / "b.md").write_text(make_text(3000, seed=2))
    (tmp_path / "src" / "__pycache__").mkdir()  # passed over, as hidden entries are
    (tmp_path / "src" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0binary")
    (tmp_path / "src" / "sub" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")  # not text: skipped, counted
    result = run_main("data/prepare.py", str(tmp_path / "src"), f"--out={tmp_path / 'mine'}", "--val_fraction=0.2")
    assert result.returncode == 0, result.stderr
    assert f"skipped 1 file(s) that are not UTF-8 text, e.g. {tmp_path / 'src' / 'sub' / 'logo.png'}" in result.stdout
    meta = read_meta(str(tmp_path / "mine"))
    joined = make_text(3000, seed=1) + "\n" + make_text(3000, seed=2)
    tok = CharTokenizer(meta["tokenizer"]["chars"])
    assert meta["tokens"] == {"train": 4800, "val": 1201}
    train_tokens = TokenFile(str(tmp_path / "mine" / "train.bin")).tokens.tolist()
    assert tok.decode(train_tokens) == joined[:4800]
    missing = run_main("data/prepare.py", str(tmp_path / "nothing*.txt"), f"--out={tmp_path / 'x'}")
    assert missing.returncode != 0 and "no such file, folder or matching files" in missing.stderr
    unknown = run_main("data/prepare.py", str(tmp_path / "src" / "a.txt"), "--tokenizer=gpt3", f"--out={tmp_path / 'y'}")
    lines = unknown.stderr.strip().splitlines()  # one line with the valid names (it was tiktoken's plugin text)
    assert unknown.returncode != 0 and len(lines) == 1, unknown.stderr
    assert lines[0].startswith("error: unknown tiktoken encoding 'gpt3'; use one of ") and ", gpt2, " in lines[0]


# ---------------------------------------------------------------------------------------------------
# Sharded corpora through datasets


def documents(n=120, seed=0):
    return [make_text(200 + 37 * (i % 9), seed=seed + i) for i in range(n)]


def write_corpus(tmp_path, kind, docs):
    if kind == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
        return [str(path)]
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": docs}), path)
        return [str(path)]
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i:04d}.txt").write_text(d)
    return [str(folder / "*.txt")]


def run_shards(out, files, *extra):
    return run_main("data/fineweb/prepare.py", "--data_files", *files, f"--out_dir={out}", "--shard_size=4000",
                      "--val_docs=10", "--num_proc=1", f"--cache_dir={out}.cache", *extra)


def shard_tokens(out, split):
    files = [TokenFile(p) for p in split_files(str(out), split)]
    return files, np.concatenate([f.tokens for f in files])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_shards_round_trip(tmp_path, kind):
    tok = gpt2_tokenizer()
    docs = documents()
    files = write_corpus(tmp_path, kind, docs)
    result = run_shards(tmp_path / "out", files)
    assert result.returncode == 0, result.stderr
    order = sorted(range(len(docs)), key=lambda i: f"{i:04d}.txt") if kind == "txt" else range(len(docs))
    ordered = [docs[i] for i in order]
    expected = {"val": ordered[:10], "train": ordered[10:]}
    meta = read_meta(str(tmp_path / "out"))
    for split, split_docs in expected.items():
        shard_files, tokens = shard_tokens(tmp_path / "out", split)
        assert all(f.vocab_size == 50257 and f.dtype == np.uint16 for f in shard_files)
        assert all(f.n_tokens == 4000 for f in shard_files[:-1]) and 0 < shard_files[-1].n_tokens <= 4000
        assert meta["tokens"][split] == len(tokens)
        text = tok.decode(tokens.tolist())
        assert text == "<|endoftext|>".join(split_docs) + "<|endoftext|>"
    assert meta["complete"] is True and (tmp_path / "out" / "README.md").exists()


@pytest.mark.slow
def test_interrupted_shard_run_resumes_without_duplicates(tmp_path):
    gpt2_tokenizer()
    files = write_corpus(tmp_path, "jsonl", documents(200))
    assert run_shards(tmp_path / "whole", files).returncode == 0
    first = run_shards(tmp_path / "parts", files, "--max_shards=2")  # stops like an interruption would
    assert first.returncode == 0 and "partial" in first.stdout
    assert len(split_files(str(tmp_path / "parts"), "train")) == 2
    assert read_meta(str(tmp_path / "parts"))["complete"] is False
    # a crash while writing the third shard leaves a corrupt file that was never recorded: rewritten
    (tmp_path / "parts" / "train_000002.bin").write_bytes(b"partial")
    second = run_shards(tmp_path / "parts", files)
    assert second.returncode == 0, second.stderr
    assert "wrote train_000000.bin" not in second.stdout and "wrote train_000002.bin" in second.stdout
    for split in ("train", "val"):
        whole = [p for p in split_files(str(tmp_path / "whole"), split)]
        parts = [p for p in split_files(str(tmp_path / "parts"), split)]
        assert [os.path.basename(p) for p in whole] == [os.path.basename(p) for p in parts]
        assert all(open(a, "rb").read() == open(b, "rb").read() for a, b in zip(whole, parts))
    assert read_meta(str(tmp_path / "parts"))["complete"] is True


def test_hub_names_fail_fast_offline(tmp_path):
    gpt2_tokenizer()  # the script loads its tokenizer before the source, so a missing one would fail first
    started = time.monotonic()
    result = run_script("data/fineweb/prepare.py", f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'c'}",
                        env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}, timeout=120)
    assert result.returncode != 0
    assert "cannot read HuggingFaceFW/fineweb from the Hugging Face Hub (offline" in result.stderr
    assert "--data_files" in result.stderr
    assert time.monotonic() - started < 60


def test_shards_need_the_text_column(tmp_path):
    gpt2_tokenizer()
    path = tmp_path / "docs.jsonl"
    path.write_text('{"content": "hello"}\n')
    result = run_shards(tmp_path / "out", [str(path)])
    assert result.returncode != 0 and "no column 'text' in the data" in result.stderr and "--text_column" in result.stderr


def prepare_fineweb(tmp_path, *args, env=None):
    return run_script("data/fineweb/prepare.py", f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}",
                      "--num_proc=1", *args, env=env, timeout=300)


@pytest.mark.slow
def test_one_text_file_is_split_into_documents(tmp_path):
    gpt2_or_skip()
    text = tmp_path / "one.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the king spoke to the queen.\nA second line." for i in range(30)))
    result = prepare_fineweb(tmp_path, "--data_files", str(text), "--val_docs=3")
    assert result.returncode == 0, result.stderr
    counts = [int(s.replace(",", "")) for s in result.stdout.split("train ")[1].split(" tokens")[0:1]]
    assert counts[0] > 0 and "val 0 tokens" not in result.stdout and "complete" in result.stdout
    # all of it held out: refused, with the way out, and no meta.json claiming a dataset
    result = prepare_fineweb(tmp_path / "again", "--data_files", str(text))
    assert result.returncode != 0
    assert "30 documents and --val_docs=2000 would hold out all of them" in result.stderr
    assert not (tmp_path / "again" / "out" / "meta.json").exists()


def test_hub_prepare_without_network_fails_at_once_naming_data_files(tmp_path):
    gpt2_or_skip()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") or k == "HF_HOME"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "data/fineweb/prepare.py", f"--out_dir={tmp_path / 'out'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**env, "HF_HOME": str(tmp_path / "hf")})
    if result.returncode == 0:
        pytest.skip("this machine reaches the Hugging Face Hub")
    assert time.perf_counter() - started < 30
    assert "--data_files" in result.stderr and "Traceback" not in result.stderr


def test_mqar_sequences_recall_their_pairs_and_train_only_the_queried_values(tmp_path):
    import numpy as np

    from conftest import TINY_RUN, run_main
    from dataset import ConversationSampler, TokenFile, read_meta

    out = tmp_path / "mqar"
    result = run_main("data/mqar/prepare.py", "--pairs=4", "--keys=8", "--values=8", "--train=60", "--val=20", f"--out_dir={out}")
    assert result.returncode == 0 and "60 train and 20 val sequences of 16 tokens" in result.stdout, result.stderr
    tokens, mask = TokenFile(str(out / "val.bin")).tokens, TokenFile(str(out / "val_mask.bin")).tokens
    starts = np.load(out / "val_starts.npy")
    for a, b in zip(starts[:-1], starts[1:]):
        ids, trained = tokens[a:b].tolist(), mask[a:b].tolist()
        pairs = dict(zip(ids[0:8:2], ids[1:8:2]))
        assert len(pairs) == 4 and all(k < 8 <= v for k, v in pairs.items())  # keys, then values, no repeats
        assert trained[:9] == [0] * 9 and trained[9::2] == [1] * 4 and sum(trained) == 4  # the queried values only
        assert {ids[i]: ids[i + 1] for i in range(8, 16, 2)} == pairs  # every key asked once, its value after it
    bad = run_main("data/mqar/prepare.py", "--pairs=9", "--keys=8", f"--out_dir={tmp_path / 'bad'}")
    assert bad.returncode == 2 and "--pairs=9 must be in [1, min(--keys, --values) = 8]" in bad.stderr
    run = tmp_path / "run"
    trained_run = run_main("train.py", *TINY_RUN, f"--dataset={out}", f"--out_dir={run}", "--max_iters=3", "--attn_pattern=N")
    assert trained_run.returncode == 0, trained_run.stderr
    scored = run_main("eval.py", f"--out_dir={run}", "--device=cpu")
    from checkpoint import load_model

    model = load_model(str(run))[0].eval()
    sampler = ConversationSampler(str(out), "val", 32, 0, read_meta(str(out))["vocab_size"])
    right = n = 0
    with torch.no_grad():
        for start, length in sampler.convs:
            ids = torch.from_numpy(sampler.tokens.window(start, length))
            keep = torch.from_numpy(sampler.mask.window(start, length))[1:].bool()
            right += int((model(ids[None, :-1])[0][0].argmax(-1)[keep] == ids[1:][keep]).sum())
            n += int(keep.sum())
    assert n == 80 and f"accuracy {right / n:.4f}" in scored.stdout, scored.stdout


# ---------------------------------------------------------------------------------------------------
# Progress of a large corpus's preparation


TRICKY = ("The king's men,  said: \"no!\"\n\nIt's 12,345.67 -- ünïcödé\r\nEmoji 🙂 and\ttabs\n   \n"
          "  indented line\n.\n/path/to\n.\nWord 1999 and 'quoted'\n\n\n42 is a number\nend \nWord.\n\nB\n"
          "a.\n\nB a\n\n\n\nB x:\nY  \nWord\tok\n9\n")


@pytest.mark.parametrize("kind", ["char", "bpe:300", "gpt2", "cl100k_base", "o200k_base"])
def test_a_corpus_encoded_in_pieces_has_the_ids_of_one_piece_and_shows_progress(kind, monkeypatch, capsys):
    """prepare_text encodes a large text in pieces, with progress lines between them (a log's), cut where
    every tokenizer we write data with starts a new piece anyway: at every point LINE_START allows, the two
    sides' ids are the whole text's (a cut before B in "a\n\nB" was not: GPT-2 merges the two line ends)."""
    import configurator
    import dataset

    text = TRICKY * 20
    try:
        tokenizer = dataset.tokenizer_for(kind, text, 0.1)
    except DataError as e:  # tiktoken's files unavailable (no cache, no network)
        pytest.skip(str(e))
    whole = tokenizer.encode(TRICKY)
    cuts = [m.end() for m in dataset.LINE_START.finditer(TRICKY)]
    assert len(cuts) >= 5
    for cut in cuts:
        assert tokenizer.encode(TRICKY[:cut]) + tokenizer.encode(TRICKY[cut:]) == whole, repr(TRICKY[cut - 5 : cut + 5])
    monkeypatch.setattr(dataset, "PIECE_CHARS", 50)
    monkeypatch.setattr(configurator, "PROGRESS_SECONDS", 0.0)
    assert dataset.encode_in_pieces(tokenizer, text, "tokenizing train") == tokenizer.encode(text)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) > 20 and lines[0].startswith("tokenizing train: ") and f" of {len(text):,} characters, " in lines[0]
    assert lines[0].endswith(" left")
