"""
Token files, chat datasets and the training batch sampler, shared by the prepare scripts, train.py,
sample.py and bench.py (the tokenizers and the chat template are tokenizer.py's).

A dataset is a directory: meta.json (tokenizer, vocabulary size, token counts) and, per split, one
token file `{split}.bin` or shards `{split}_000000.bin`, `{split}_000001.bin`, ... Each token file is a
64-byte header (magic, format version, bytes per token, vocabulary size, token count) followed by the
tokens, uint16 when the vocabulary fits and uint32 otherwise.
"""

import glob
import json
import mmap
import os
import re

import numpy as np
import torch

from configurator import DataError, Progress, UserError, fail
from tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, TiktokenTokenizer, char_tokenizer_for, check_messages

MAGIC = b"GPTTOKEN"
VERSION = 1
HEADER = np.dtype(
    [("magic", "S8"), ("version", "<u4"), ("token_bytes", "<u4"), ("vocab_size", "<u8"), ("n_tokens", "<u8"),
     ("reserved", "V32")]
)  # fmt: skip
assert HEADER.itemsize == 64

ROOT = os.path.dirname(os.path.abspath(__file__))  # the project: data/NAME are its prepared datasets


def token_dtype(vocab_size):
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def atomic_write(path, write):
    """write(f) into a temporary file beside path, fsync, then rename over path: a crash leaves either
    the old file or the new one, never a partial one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    """obj as indented JSON, atomically (eval.py's and bench.py's --json): nothing half-written."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, default=str).encode()))


def write_tokens(path, tokens, vocab_size):
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DataError(f"{path}: token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
    dtype = token_dtype(vocab_size)
    header = np.zeros((), dtype=HEADER)
    header["magic"], header["version"], header["token_bytes"] = MAGIC, VERSION, dtype.itemsize
    header["vocab_size"], header["n_tokens"] = vocab_size, tokens.size

    def write(f):
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())

    atomic_write(path, write)


class TokenFile:
    """A token file, validated and memory-mapped. Windows are copied out, and the pages they touched are
    released from this process right away (madvise), so a long run's resident memory does not grow with
    the data it has read: nanoGPT re-opened its memmap every batch for the same reason."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(HEADER.itemsize)
        if len(raw) < HEADER.itemsize or np.frombuffer(raw, HEADER)[0]["magic"] != MAGIC:
            raise DataError(f"{path}: not a token file (bad header); prepare the dataset again")
        header = np.frombuffer(raw, HEADER)[0]
        if header["version"] != VERSION or header["token_bytes"] not in (2, 4):
            raise DataError(f"{path}: unsupported token file (version {header['version']}, "
                            f"{header['token_bytes']} bytes per token); prepare the dataset again")
        self.vocab_size, self.n_tokens = int(header["vocab_size"]), int(header["n_tokens"])
        self.dtype = np.dtype(np.uint16 if header["token_bytes"] == 2 else np.uint32)
        expected = HEADER.itemsize + self.n_tokens * self.dtype.itemsize
        if size != expected:
            raise DataError(f"{path}: {size} bytes, but its header promises {self.n_tokens} tokens "
                            f"({expected} bytes): truncated or corrupt; prepare the dataset again")
        with open(path, "rb") as f:
            self.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.n_tokens else None
        self.tokens = (np.frombuffer(self.mmap, self.dtype, self.n_tokens, HEADER.itemsize) if self.n_tokens
                       else np.zeros(0, self.dtype))

    def window(self, start, length):
        out = self.tokens[start : start + length].astype(np.int64)
        if hasattr(self.mmap, "madvise"):
            begin = (HEADER.itemsize + start * self.dtype.itemsize) // mmap.PAGESIZE * mmap.PAGESIZE
            end = HEADER.itemsize + (start + length) * self.dtype.itemsize
            self.mmap.madvise(mmap.MADV_DONTNEED, begin, end - begin)
        return out

    def max_token(self, chunk=1 << 24):
        return max((int(self.tokens[i : i + chunk].max()) for i in range(0, self.n_tokens, chunk)), default=-1)


def split_files(data_dir, split):
    single = os.path.join(data_dir, f"{split}.bin")
    shards = sorted(glob.glob(os.path.join(data_dir, f"{split}_[0-9]*.bin")))
    return [single] if os.path.exists(single) else shards


def open_split(data_dir, split, vocab_size):
    """The split's token files, checked: present, consistent with meta.json, every token < vocab_size."""
    paths = split_files(data_dir, split)
    if not paths:
        raise DataError(f"{data_dir}: no {split}.bin or {split}_*.bin; run the dataset's prepare script first")
    files = [TokenFile(p) for p in paths]
    for f in files:
        if f.vocab_size != vocab_size:
            raise DataError(f"{f.path}: written for a vocabulary of {f.vocab_size}, meta.json says {vocab_size}")
        top = f.max_token()
        if top >= vocab_size:
            raise DataError(f"{f.path}: token id {top} >= vocabulary size {vocab_size}; prepare the dataset again")
    return files


def prepare_hint(data_dir):
    """The command that prepares data_dir: its own prepare script, or data/prepare.py for your text."""
    script = os.path.join(data_dir, "prepare.py")
    if os.path.exists(script):
        return f"python {os.path.relpath(script)}"
    return f"python data/prepare.py YOUR_FILES --out={os.path.basename(os.path.normpath(data_dir))}"


def resolve_dataset(name):
    for candidate in (os.path.join(ROOT, "data", name), name):
        if os.path.isdir(candidate):
            return candidate
    raise DataError(f"dataset {name!r} not found (looked for data/{name} and {name}); prepare it first: "
                    f"{prepare_hint(os.path.join(ROOT, 'data', name))}")


def hub_offline():
    """Whether HF_HUB_OFFLINE or HF_DATASETS_OFFLINE asks Hugging Face's libraries not to use the network."""
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout=5):
    """A TCP connection to the Hub's endpoint: seconds, where datasets' own retries take half a minute."""
    import socket
    import urllib.parse

    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def read_meta(data_dir):
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise DataError(f"{data_dir}: no meta.json; prepare the dataset first: {prepare_hint(data_dir)}")
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------
# Chat datasets (data/prepare.py chats.jsonl ...): conversations rendered by tokenizer.ChatTokenizer

def read_records(path):
    """[(record, messages)] of a JSON-lines file, one {"messages": [...], ...} per line (blank lines
    skipped; the record's other keys, such as eval.py's "task", kept); a DataError names the line and field."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(record, dict) or "messages" not in record:
                    raise DataError(f"{path}:{n}: expected an object with a 'messages' list")
                records.append((record, check_messages(record["messages"], f"{path}:{n}: messages")))
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return records


def read_conversations(path):
    """The conversations (lists of messages) of a JSON-lines file: read_records' messages."""
    return [messages for _, messages in read_records(path)]


def prepare_conversations(conversations, tokenizer, out_dir, val_fraction=0.1, val=None):
    """Writes a chat dataset: per split, {split}.bin (the rendered conversations back to back),
    {split}_mask.bin (1 where a token is trained) and {split}_starts.npy (where each conversation begins,
    then the end); meta.json's "sequences" says how many and how long (a masked dataset's mark). The last val_fraction of the
    conversations (at least one) are val, or val's when given. A conversation without an assistant turn
    trains nothing: refused."""
    tokenizer = ChatTokenizer(tokenizer)
    if val is None:
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"val_fraction={val_fraction} must be in (0, 1)")
        if len(conversations) < 2:
            raise DataError(f"{len(conversations)} conversation(s): a chat dataset needs at least 2 (train and val)")
        n_val = max(1, round(len(conversations) * val_fraction))
        conversations, val = conversations[:-n_val], conversations[-n_val:]
    for n, messages in enumerate(conversations + val):
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"conversation {n}: no assistant turn, so nothing in it would be trained")
    return write_masked(out_dir, tokenizer, {split: [tokenizer.render(m) for m in part]
                                            for split, part in (("train", conversations), ("val", val))})


def write_masked(out_dir, tokenizer, splits):
    """Writes a masked dataset (whole sequences, each trained where its mask says: ConversationSampler's)
    from {split: [(ids, trained)]}: {split}.bin, {split}_mask.bin and {split}_starts.npy, and meta.json
    with the "sequences" statistics. Returns them."""
    os.makedirs(out_dir, exist_ok=True)
    counts, stats = {}, {}
    for split, rendered in splits.items():
        lengths = np.array([len(ids) for ids, _ in rendered], dtype=np.int64)
        ids = np.concatenate([np.array(i, dtype=np.int64) for i, _ in rendered])
        trained = np.concatenate([np.array(t, dtype=np.int64) for _, t in rendered])
        write_tokens(os.path.join(out_dir, f"{split}.bin"), ids, tokenizer.vocab_size)
        write_tokens(os.path.join(out_dir, f"{split}_mask.bin"), trained, 2)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        atomic_write(os.path.join(out_dir, f"{split}_starts.npy"), lambda f: np.save(f, starts))
        counts[split] = int(ids.size)
        stats[split] = {"conversations": len(rendered), "trained_tokens": int(trained.sum()), "longest": int(lengths.max()),
                        "median_length": int(np.median(lengths))}
    write_meta(out_dir, tokenizer, counts, sequences=stats)
    return stats


class ConversationSampler:
    """A chat dataset's batches: whole conversations, one per row, drawn uniformly from a seeded generator
    (its state goes into checkpoints, as BatchSampler's). Rows are padded (not packed) to the batch's
    longest conversation, rounded up to a multiple of 64 so a compiled model meets few shapes: each row
    starts at position 0 as a chat does at inference, and no row attends to another conversation. Targets
    are -1 where nothing is trained (system and user turns, the role tokens, the padding). A conversation
    longer than block_size + 1 tokens is cut there (train.py says how many are); one with nothing left to
    train after the cut is never drawn."""

    PAD_TO = 64

    def __init__(self, data_dir, split, block_size, seed, vocab_size):
        paths = [os.path.join(data_dir, f"{split}{end}") for end in (".bin", "_mask.bin", "_starts.npy")]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise DataError(f"{missing[0]}: missing; prepare the chat dataset again (python data/prepare.py CHATS.jsonl ...)")
        self.tokens, self.mask = open_split(data_dir, split, vocab_size)[0], TokenFile(paths[1])
        starts = np.load(paths[2])
        if starts[-1] != self.tokens.n_tokens or self.mask.n_tokens != self.tokens.n_tokens:
            raise DataError(f"{data_dir}: {split}'s tokens, mask and starts disagree; prepare the chat dataset again")
        self.block_size = block_size
        lengths = np.diff(starts)
        self.longer = int((lengths > block_size + 1).sum())  # conversations cut at block_size + 1 tokens
        kept = [(int(s), int(min(n, block_size + 1))) for s, n in zip(starts[:-1], lengths)]
        self.convs = [(s, n) for s, n in kept if self.mask.tokens[s + 1 : s + n].any()]
        self.dropped = len(kept) - len(self.convs)  # nothing trained within block_size + 1 tokens
        if not self.convs:
            raise DataError(f"{data_dir}: no {split} conversation has a trained token within block_size + 1 = "
                            f"{block_size + 1} tokens; use a larger block_size")
        self.n_conversations = len(kept)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, n, rows=slice(None)):
        """n conversations -> (x, y), each (n', width) int64 for the rows asked for (as BatchSampler.sample:
        every process draws all n and reads its own)."""
        picks = torch.randint(len(self.convs), (n,), generator=self.generator).numpy()[rows]
        convs = [self.convs[p] for p in picks]
        width = min(self.block_size, -(-max(length - 1 for _, length in convs) // self.PAD_TO) * self.PAD_TO)
        x = torch.zeros(len(convs), width, dtype=torch.long)
        y = torch.full((len(convs), width), -1, dtype=torch.long)
        for r, (start, length) in enumerate(convs):
            ids = torch.from_numpy(self.tokens.window(start, length))
            trained = torch.from_numpy(self.mask.window(start, length)).bool()
            x[r, : length - 1] = ids[:-1]
            y[r, : length - 1] = ids[1:].masked_fill(~trained[1:], -1)
        return x, y

    def state_dict(self):
        return self.generator.get_state()

    def load_state_dict(self, state):
        self.generator.set_state(state)


def is_masked_dataset(meta):
    """Whether a dataset is whole sequences with a loss mask (conversations, data/mqar): ConversationSampler's."""
    return "sequences" in meta


def tokenizer_for(spec, text, val_fraction):
    """The tokenizer a prepare command asks for: `char` (the characters of all of text), `bpe:N` (a BPE
    of N tokens learned from the train split only, so val stays unseen) or a tiktoken encoding's name."""
    if spec == "char":
        return char_tokenizer_for(text)
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not size.isdigit():
            raise DataError(f"tokenizer={spec}: give the vocabulary size as a number, e.g. bpe:8192")
        return BPETokenizer.train(split_text(text, val_fraction)[0], int(size))
    return TiktokenTokenizer(spec)


def split_text(text, val_fraction):
    """(train, val): the first (1 - val_fraction) of the characters and the rest, as nanoGPT splits."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 1)")
    cut = int(len(text) * (1 - val_fraction))
    return text[:cut], text[cut:]


def fetch_text(path, url, cache_path, flag="--input"):
    """The corpus text: from path when given; else from cache_path, downloading url there first (flag: the
    script's option for a local copy, named when the download fails)."""
    import urllib.request

    if path is None:
        path = cache_path
        if not os.path.exists(path):
            print(f"downloading {url}")
            try:
                urllib.request.urlretrieve(url, path + ".part")
            except OSError as e:
                raise DataError(f"download of {url} failed ({e}); without network, pass {flag} PATH to a "
                                "local copy") from None
            os.replace(path + ".part", path)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def prepare_text(text, tokenizer, out_dir, val_fraction=0.1, source=None):
    """Splits text at the first (1 - val_fraction) of its characters (as nanoGPT does), tokenizes each
    part and writes train.bin, val.bin and meta.json (with source, the text's path, where given: a later
    script that needs the same text finds it there). Returns the token counts."""
    if not text:
        raise DataError("the input text is empty")
    parts = split_text(text, val_fraction)
    os.makedirs(out_dir, exist_ok=True)
    counts = {}
    for split, part in zip(("train", "val"), parts):
        ids = encode_in_pieces(tokenizer, part, f"tokenizing {split}")
        write_tokens(os.path.join(out_dir, f"{split}.bin"), np.array(ids, dtype=np.int64), tokenizer.vocab_size)
        counts[split] = len(ids)
    write_meta(out_dir, tokenizer, counts, **({"source": source} if source else {}))
    if isinstance(tokenizer, BPETokenizer):  # for tools that read tokenizer.json (transformers, tokenizers)
        atomic_write(os.path.join(out_dir, "tokenizer.json"), lambda f: f.write(tokenizer.json.encode()))
    return counts


PIECE_CHARS = 4_000_000  # encode_in_pieces' piece: about a second of tokenizing, so its progress moves
# where a piece may end: after a line end that follows a non-space character and precedes a letter or
# digit. Every pre-tokenizer we write data with starts a piece at such a letter and takes a lone line end (or
# punctuation and its line ends) as the piece before it; a longer whitespace run is not cut ("a\n\nB" is
# 64 198 198 33 in GPT-2's regex as a whole, 64 628 33 cut before B).
LINE_START = re.compile(r"(?<=\S)\n(?=[^\W_])")


def encode_in_pieces(tokenizer, text, what):
    """tokenizer.encode(text), in pieces of about PIECE_CHARS cut at LINE_START, with a Progress between
    them (a large corpus takes minutes). The ids are the same: the characters' encoding is per character,
    and a byte-level BPE's merges (GPT-2's regex, ours; tiktoken's cl100k and o200k) stay within the pieces
    their pre-tokenizers make, which always end at such a point."""
    if len(text) <= PIECE_CHARS or not isinstance(tokenizer, (CharTokenizer, TiktokenTokenizer, BPETokenizer)):
        return tokenizer.encode(text)
    cuts = [0]
    while cuts[-1] + PIECE_CHARS < len(text):
        found = LINE_START.search(text, cuts[-1] + PIECE_CHARS)
        if found is None:
            break
        cuts.append(found.end())
    cuts.append(len(text))
    ids = []
    with Progress(len(text), "characters", what) as progress:
        for start, end in zip(cuts, cuts[1:]):
            ids += tokenizer.encode(text[start:end])
            progress.update(end - start)
    return ids


def prepare_corpus_main(description, url, here, make_tokenizer):
    """The command line of a single-text corpus's prepare script (data/shakespeare*/prepare.py)."""
    import argparse

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="a local copy of the text (skips the download)")
    parser.add_argument("--out_dir", default=here, help="where train.bin, val.bin and meta.json go")
    args = parser.parse_args()
    path = args.input or os.path.join(here, "input.txt")
    try:
        text = fetch_text(args.input, url, path)
        tokenizer = make_tokenizer(text)
        counts = prepare_text(text, tokenizer, args.out_dir, source=os.path.abspath(path))
    except UserError as e:
        fail(e)
    print(summary(text, tokenizer, counts, args.out_dir))


def summary(text, tokenizer, counts, out_dir):
    meta = tokenizer.meta()
    name = {"char": "character", "bpe": "BPE (learned from train)"}.get(meta["kind"]) or meta.get("encoding")
    return (f"{len(text):,} characters, {name} vocabulary of {tokenizer.vocab_size}: train has {counts['train']:,} "
            f"tokens, val has {counts['val']:,} tokens -> {out_dir}")


def write_meta(out_dir, tokenizer, counts, **extra):
    meta = {"format": VERSION, "tokenizer": tokenizer.meta(), "vocab_size": tokenizer.vocab_size,
            "tokens": counts, **extra}
    atomic_write(os.path.join(out_dir, "meta.json"), lambda f: f.write(json.dumps(meta, indent=2).encode()))


# ----------------------------------------------------------------------------------------------------
# Batches


class BatchSampler:
    """Uniformly random windows of block_size + 1 tokens over all of a split's files, drawn from its own
    seeded generator, whose state goes into checkpoints so a resumed run sees the same batches."""

    def __init__(self, files, block_size, seed):
        self.files, self.block_size = files, block_size
        self.starts_per_file = np.array([max(0, f.n_tokens - block_size) for f in files])
        self.total = int(self.starts_per_file.sum())
        if self.total == 0:
            longest = max(f.n_tokens for f in files)
            raise DataError(f"{files[0].path}: {longest} tokens, fewer than block_size + 1 = {block_size + 1}; "
                            "use a smaller block_size or more data")
        self.offsets = np.cumsum(self.starts_per_file) - self.starts_per_file
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, n, rows=slice(None)):
        """n windows -> (x, y), each (n, block_size) int64, y shifted by one. rows: which of the n to read
        (a process's share under torchrun): every process draws all n, so the random stream stays the same
        in each, and reads only its own."""
        picks = torch.randint(self.total, (n,), generator=self.generator).numpy()[rows]
        file_idx = np.searchsorted(self.offsets, picks, side="right") - 1
        rows = [self.files[i].window(int(p - self.offsets[i]), self.block_size + 1) for i, p in zip(file_idx, picks)]
        batch = torch.from_numpy(np.stack(rows))
        # contiguous: a pinned copy keeps a view's strides, and a non-contiguous host tensor's copy to a GPU
        # goes through a pageable temporary (no overlap, a possible stream sync) every micro-step
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self):
        return self.generator.get_state()

    def load_state_dict(self, state):
        self.generator.set_state(state)
