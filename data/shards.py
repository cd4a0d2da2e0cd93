"""
Large corpora through Hugging Face `datasets`, into header-checked token shards; shared by the
openwebtext, fineweb and tinystories prepare scripts.

Documents come from the Hub (parquet files or streaming; never a dataset loading script, which datasets
4 and later refuse) or from local --data_files (parquet, jsonl/json, txt). They are tokenized in parallel
(--num_proc), each followed by the end-of-text token, and packed into shards of --shard_size tokens:
{split}_000000.bin, {split}_000001.bin, ... After every shard, progress_{split}.json records where the
next shard starts, so an interrupted run, started again with the same arguments, continues after the last
finished shard and writes exactly the tokens an uninterrupted run would have.
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from configurator import DataError, UserError, fail  # noqa: E402
from dataset import TokenFile, atomic_write, hub_offline, hub_reachable, token_dtype, write_meta, write_tokens
from tokenizer import TiktokenTokenizer

BATCH = 1000  # documents per tokenization batch


def parse_args(description, default_out, default_val_docs, default_revision):
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_files", nargs="+", help="local parquet/jsonl/txt files (globs allowed) instead of the Hub")
    p.add_argument("--val_files", nargs="+", help="local files for the validation split (default: the first "
                   "--val_docs documents of --data_files)")
    p.add_argument("--text_column", default="text", help="the column that holds each document's text")
    p.add_argument("--revision", default=default_revision, help="Hub revision (branch, tag or commit) to read")
    p.add_argument("--streaming", action="store_true", help="stream from the Hub instead of downloading first")
    p.add_argument("--encoding", default="gpt2", help="tiktoken encoding (gpt2, cl100k_base, o200k_base, ...)")
    p.add_argument("--num_proc", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="tokenizer processes")
    p.add_argument("--shard_size", type=int, default=100_000_000, help="tokens per shard")
    p.add_argument("--val_docs", type=int, default=default_val_docs,
                   help="documents held out for validation when the source has no validation split")
    p.add_argument("--max_shards", type=int, default=None, help="stop after this many train shards (a subset; "
                   "run again without it to continue)")
    p.add_argument("--out_dir", default=default_out, help="where shards, meta.json and README.md go")
    p.add_argument("--cache_dir", default=None, help="datasets' cache directory")
    return p.parse_args()


def load_source(args, hub_id, hub_config, hub_val_split):
    """{split: datasets.Dataset or IterableDataset, and the document range of it that belongs to the split}"""
    import datasets

    common = dict(cache_dir=args.cache_dir)
    if args.data_files:
        def local(files):
            kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}.get(
                os.path.splitext(files[0])[1])
            if kind is None:
                raise DataError(f"{files[0]}: unsupported file type; use .parquet, .jsonl, .json or .txt")
            extra = {"sample_by": "paragraph"} if kind == "text" else {}  # documents: blank-line separated
            return datasets.load_dataset(kind, data_files=files, split="train", **extra, **common)

        train = local(args.data_files)
        val = local(args.val_files) if args.val_files else None
    else:
        if hub_offline() or not hub_reachable():
            raise DataError(f"cannot read {hub_id} from the Hugging Face Hub (offline: HF_DATASETS_OFFLINE/"
                            "HF_HUB_OFFLINE, or no network); download its parquet files elsewhere and pass "
                            "them with --data_files") from None
        try:
            load = lambda split: datasets.load_dataset(  # noqa: E731
                hub_id, hub_config, split=split, revision=args.revision, streaming=args.streaming, **common)
            train = load("train")
            val = load(hub_val_split) if hub_val_split else None
        except Exception as e:
            raise DataError(f"cannot load {hub_id} from the Hub ({type(e).__name__}: {str(e)[:200]}); download its "
                            "parquet files where there is network and pass them with --data_files") from None
    if args.text_column not in train.column_names:
        raise DataError(f"no column {args.text_column!r} in the data (columns: {train.column_names}); "
                        "pass --text_column")
    if val is not None:
        return {"val": (val, 0, None), "train": (train, 0, None)}
    if hasattr(train, "__len__") and len(train) <= args.val_docs:
        raise DataError(f"the data has {len(train):,} documents and --val_docs={args.val_docs} would hold out all of "
                        "them; lower --val_docs, add files, or give --val_files (a .txt file is split into documents "
                        "at blank lines)")
    return {"val": (train, 0, args.val_docs), "train": (train, args.val_docs, None)}


def encode_column(batch, encoding, column):
    import tiktoken

    return {"ids": tiktoken.get_encoding(encoding).encode_ordinary_batch(batch[column], num_threads=1)}


def token_batches(source, resume_doc, tokenizer, args):
    """Yields lists of token lists, one per document from resume_doc on (each with EOT appended)."""
    ds, start, end = source
    eot = [tokenizer.eot_token]
    if hasattr(ds, "__len__"):
        end = len(ds) if end is None else min(end, len(ds))
        # the whole split is tokenized once, in parallel, and cached by datasets: a rerun reuses it
        ds = ds.select(range(start, end)).map(
            encode_column, fn_kwargs={"encoding": args.encoding, "column": args.text_column}, batched=True,
            batch_size=BATCH, num_proc=args.num_proc if end - start >= 2 * BATCH else None,
            remove_columns=ds.column_names, desc=f"tokenizing {end - start:,} documents")
        for batch in ds.select(range(resume_doc - start, len(ds))).iter(batch_size=BATCH):
            yield [ids + eot for ids in batch["ids"]]
        return
    ds = ds.skip(resume_doc)  # streaming: documents before resume_doc are skipped, not tokenized
    if end is not None:
        ds = ds.take(end - resume_doc)
    texts = []
    for row in ds:
        texts.append(row[args.text_column])
        if len(texts) == BATCH:
            yield [ids + eot for ids in tokenizer.encode_batch(texts, num_threads=args.num_proc)]
            texts = []
    if texts:
        yield [ids + eot for ids in tokenizer.encode_batch(texts, num_threads=args.num_proc)]


def write_split(split, source, tokenizer, args, settings, max_shards=None):
    """Packs the split's documents into shards, continuing from progress_{split}.json. Returns
    (tokens written in all, finished?)."""
    out, size = args.out_dir, args.shard_size
    progress_path = os.path.join(out, f"progress_{split}.json")
    progress = {"settings": settings, "shards": [], "done": False}
    if os.path.exists(progress_path):
        with open(progress_path) as f:
            saved = json.load(f)
        if saved["settings"] != settings:
            raise DataError(f"{out} was prepared with other settings ({saved['settings']}); use another --out_dir "
                            "or delete it")
        progress = saved
        for i, shard in enumerate(progress["shards"]):  # keep the prefix of shards that are intact
            path = os.path.join(out, shard["file"])
            try:
                ok = TokenFile(path).n_tokens == shard["tokens"]
            except (DataError, OSError):
                ok = False
            if not ok:
                progress["shards"], progress["done"] = progress["shards"][:i], False
                break
    if progress["done"]:
        return sum(s["tokens"] for s in progress["shards"]), True

    doc, offset = source[1], 0
    if progress["shards"]:
        doc, offset = progress["shards"][-1]["next_doc"], progress["shards"][-1]["next_offset"]
    buffer = np.empty(size, dtype=token_dtype(tokenizer.vocab_size))
    fill = 0

    def flush(next_doc, next_offset):
        name = f"{split}_{len(progress['shards']):06d}.bin"
        write_tokens(os.path.join(out, name), buffer[:fill], tokenizer.vocab_size)
        progress["shards"].append({"file": name, "tokens": int(fill), "next_doc": next_doc, "next_offset": next_offset})
        atomic_write(progress_path, lambda f: f.write(json.dumps(progress, indent=1).encode()))
        print(f"{split}: wrote {name} ({fill:,} tokens)", flush=True)

    train_shards_left = lambda: max_shards is None or len(progress["shards"]) < max_shards  # noqa: E731
    if not train_shards_left():
        return sum(s["tokens"] for s in progress["shards"]), False
    for batch in token_batches(source, doc, tokenizer, args):
        for ids in batch:
            ids, consumed = ids[offset:], offset
            offset = 0
            while ids:
                take = min(len(ids), size - fill)
                buffer[fill : fill + take] = ids[:take]
                fill, consumed, ids = fill + take, consumed + take, ids[take:]
                if fill == size:
                    flush(doc if ids else doc + 1, consumed if ids else 0)
                    fill = 0
                    if not train_shards_left():
                        return sum(s["tokens"] for s in progress["shards"]), False
            doc += 1
    if fill:
        flush(doc, 0)
    progress["done"] = True
    atomic_write(progress_path, lambda f: f.write(json.dumps(progress, indent=1).encode()))
    return sum(s["tokens"] for s in progress["shards"]), True


def main(description, name, hub_id, hub_config=None, hub_val_split=None, hub_revision=None, default_val_docs=2000):
    args = parse_args(description, os.path.join(os.path.dirname(os.path.abspath(__file__)), name), default_val_docs,
                      hub_revision)
    try:
        tokenizer = TiktokenTokenizer(args.encoding)
        if args.shard_size < 1:
            raise DataError(f"--shard_size={args.shard_size} must be >= 1")
        os.makedirs(args.out_dir, exist_ok=True)
        sources = load_source(args, hub_id, hub_config, hub_val_split)
        origin = sorted(args.data_files) if args.data_files else f"{hub_id}/{hub_config}@{args.revision}"
        settings = {"source": origin, "val_files": sorted(args.val_files or []), "encoding": args.encoding,
                    "shard_size": args.shard_size, "val_docs": args.val_docs, "text_column": args.text_column}
        counts, complete = {}, True
        for split in ("val", "train"):
            counts[split], finished = write_split(split, sources[split], tokenizer, args, settings,
                                                  args.max_shards if split == "train" else None)
            complete &= finished
        empty = [split for split in ("train", "val") if counts[split] == 0]
        if empty:
            raise DataError(f"the {' and '.join(empty)} split would be empty (train {counts['train']:,} tokens, val "
                            f"{counts['val']:,}); give more documents or other --val_docs / --val_files")
    except UserError as e:
        fail(e)
    write_meta(args.out_dir, tokenizer, counts, complete=complete, source=origin)
    state = "complete" if complete else f"partial (--max_shards={args.max_shards}; run again without it to continue)"
    readme = (f"# {name}\n\nSource: {origin}\nTokenizer: tiktoken {args.encoding} (vocabulary {tokenizer.vocab_size}), "
              f"end-of-text after each document\n\n| split | tokens |\n| --- | --- |\n"
              + "".join(f"| {s} | {n:,} |\n" for s, n in counts.items()) + f"\nState: {state}\n")
    atomic_write(os.path.join(args.out_dir, "README.md"), lambda f: f.write(readme.encode()))
    print(f"{name}: train {counts['train']:,} tokens, val {counts['val']:,} tokens, {state} -> {args.out_dir}")
