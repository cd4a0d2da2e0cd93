"""
Token files, tokenizers and the training batch sampler, shared by the prepare scripts, train.py,
sample.py and bench.py.

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

from configurator import Progress, UserError, fail

MAGIC = b"GPTTOKEN"
VERSION = 1
HEADER = np.dtype(
    [("magic", "S8"), ("version", "<u4"), ("token_bytes", "<u4"), ("vocab_size", "<u8"), ("n_tokens", "<u8"),
     ("reserved", "V32")]
)  # fmt: skip
assert HEADER.itemsize == 64

ROOT = os.path.dirname(os.path.abspath(__file__))  # the project: data/NAME are its prepared datasets


class DataError(UserError):
    pass


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
# Tokenizers. meta.json (and every checkpoint) names one as a small dict; tokenizer_from_meta rebuilds it.


class CharTokenizer:
    def __init__(self, chars):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self.eot_token = None

    def encode(self, text):
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise DataError(f"characters not in the vocabulary: {''.join(unknown)!r}; a character-level model "
                            f"knows only the {self.vocab_size} characters of its training text")
        return [self.stoi[c] for c in text]

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self):
        return [len(c.encode("utf-8")) for c in self.chars]

    def meta(self):
        return {"kind": "char", "chars": self.chars}


class TiktokenTokenizer:
    def __init__(self, encoding):
        import tiktoken

        try:
            self.enc = tiktoken.get_encoding(encoding)
        except ValueError:
            raise DataError(f"unknown tiktoken encoding {encoding!r}; use one of "
                            f"{', '.join(sorted(tiktoken.list_encoding_names()))} (or char)") from None
        except Exception as e:  # its files are neither cached nor downloadable
            raise DataError(f"cannot load tiktoken encoding {encoding!r} ({type(e).__name__}): without network, set "
                            "TIKTOKEN_CACHE_DIR to a folder holding its files (docs/guide.md: Offline use)") from None
        self.encoding = encoding
        self.vocab_size = self.enc.n_vocab
        self.eot_token = self.enc.eot_token

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts, num_threads=8):
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def token_bytes(self):
        """UTF-8 bytes each id stands for (special tokens, which are no text, 0): bits per byte's divisor."""
        special = {self.enc.encode_single_token(s) for s in self.enc.special_tokens_set}
        return [0 if i in special else len(self.enc.decode_single_token_bytes(i)) for i in range(self.vocab_size)]

    def meta(self):
        return {"kind": "tiktoken", "encoding": self.encoding}


def tokenizers_package(what):
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"{what} needs the tokenizers package: pip install tokenizers") from None
    return tokenizers


class HFTokenizer:
    """A Hugging Face tokenizer.json (Llama-architecture models), through the `tokenizers` package."""

    char_unk = None  # a character model's export: the id other characters read as (dataset.UNK), if it has one

    def __init__(self, path, eot_token=None):
        self.tok = tokenizers_package(path).Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size()
        self.eot_token = eot_token
        self.char_unk = self.tok.token_to_id(UNK) if self.chars() is not None else None

    def encode(self, text):
        try:
            ids = self.tok.encode(text, add_special_tokens=False).ids
        except Exception as e:  # a word-level vocabulary without an unknown token (a character model's export)
            if "Missing [UNK] token" not in str(e) or not self.unknown_chars(text):
                raise
            ids = None
        if ids is None or (self.char_unk is not None and self.char_unk in ids):  # ours stay strict, as the run's
            known = len(self.chars() or "") or self.vocab_size
            raise DataError(f"characters not in the vocabulary: {''.join(self.unknown_chars(text))!r}; a character-level "
                            f"model knows only the {known} characters of its training text")
        return ids

    def chars(self):
        """A character vocabulary in id order (one of ours exported, its [UNK] left out), else None."""
        if type(self.tok.model).__name__ != "WordLevel":
            return None
        vocab = self.tok.get_vocab(with_added_tokens=True)
        chars = sorted(vocab, key=vocab.get)
        if chars and chars[-1] == UNK:  # what our export adds for the characters outside the vocabulary
            chars.pop()
        return "".join(chars) if all(len(c) == 1 for c in chars) else None

    def unknown_chars(self, text):
        return sorted({ch for ch in text if self.tok.token_to_id(ch) is None})

    def decode(self, ids):
        return self.tok.decode(list(ids))

    def token_bytes(self):
        """UTF-8 bytes of each token id, for bits per byte: a byte-level BPE token has one character per
        byte (GPT-2's alphabet), any other token the bytes of its own decoded text, a special token 0 (as
        tiktoken's). Checked on a probe text, since a decoder may add or strip spaces between tokens."""
        special = {t.content for t in self.tok.get_added_tokens_decoder().values() if t.special}
        byte_level = type(self.tok.decoder).__name__ == "ByteLevel"
        sizes = [0] * self.vocab_size
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            if token not in special and i < self.vocab_size:
                sizes[i] = len(token) if byte_level else len(self.tok.decode([i]).encode("utf-8"))
        own = [i for i in range(min(256, self.vocab_size)) if i != self.char_unk]
        for probe in (*PROBES, self.decode(own)):  # the last: its own tokens
            try:
                ids = self.encode(probe)
            except DataError:  # a character vocabulary without some of the probe's characters
                continue
            if sum(sizes[i] for i in ids) == len(probe.encode("utf-8")):
                return sizes
            break
        raise DataError("this tokenizer.json's tokens do not add up to the text's bytes (a decoder that adds or "
                            "strips spaces), so bits per byte cannot be counted per token; score it with --tasks")

    def meta(self):
        """Our tokenizer description when this tokenizer.json is one of ours exported (a character
        vocabulary in id order, or GPT-2's BPE), so a dataset prepared with ours can be scored; else a
        description that matches no dataset of ours."""
        if self.chars() is not None:
            return {"kind": "char", "chars": self.chars()}
        vocab = self.tok.get_vocab(with_added_tokens=True)
        if type(self.tok.model).__name__ == "BPE" and vocab.get(EOT) == 0:  # an export of our own BPE
            return BPETokenizer(self.tok.to_str()).meta()
        if self.vocab_size == 50257 and vocab.get(EOT) == 50256:
            try:
                gpt2 = TiktokenTokenizer("gpt2")
                if all(self.encode(t) == gpt2.encode(t) for t in PROBES):
                    return {"kind": "tiktoken", "encoding": "gpt2"}
            except DataError:  # tiktoken's files unavailable: cannot tell
                pass
        return {"kind": "tokenizer.json", "vocab_size": self.vocab_size}


EOT = "<|endoftext|>"
UNK = "[UNK]"  # a character model's export reads characters outside its vocabulary as this (hf.save_tokenizer)


class BPETokenizer(HFTokenizer):
    """A byte-level BPE trained on your own text (data/prepare.py --tokenizer=bpe:N), GPT-2's kind:
    GPT-2's pre-tokenizer, any text encodes (there are no unknown characters), id 0 is <|endoftext|>.
    Its whole tokenizer.json travels in meta.json and in every checkpoint, so a run needs no other file."""

    def __init__(self, json_text):
        self.tok = tokenizers_package("a BPE tokenizer").Tokenizer.from_str(json_text)
        self.json = json_text
        self.vocab_size = self.tok.get_vocab_size()
        self.eot_token = self.tok.token_to_id(EOT)

    @classmethod
    def train(cls, text, vocab_size):
        """Learns vocab_size - 257 merges over text's bytes (fewer where the text runs out of pairs)."""
        if vocab_size < 258:
            raise DataError(f"bpe:{vocab_size}: a byte-level BPE needs at least 258 tokens (256 bytes, "
                            "<|endoftext|> and one merge); try bpe:4096 or bpe:8192")
        tk = tokenizers_package("--tokenizer=bpe:N")
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        # one piece: split into lines, a run of whitespace across a line end would pre-tokenize differently
        tok.train_from_iterator([text], trainer)
        return cls(tok.to_str())

    def meta(self):
        return {"kind": "bpe", "vocab_size": self.vocab_size, "json": self.json}


PROBES = ("the king spoke, and the queen said: \"no!\"\n", "Hello world, 12 ünïcödé tokens\tand 3.5 spaces  here.\n")


def continuation(tokenizer, prompt_ids, ids):
    """The text ids add after the prompt. Decoded together with the prompt, because tokenizers that
    mark word starts (SentencePiece's "▁", word-level ones) drop the space a continuation starts with."""
    prefix, full = tokenizer.decode(prompt_ids), tokenizer.decode(prompt_ids + ids)
    return full[len(prefix) :] if full.startswith(prefix) else tokenizer.decode(ids)


def describe_tokenizer(tokenizer):
    return describe_meta(tokenizer.meta() if hasattr(tokenizer, "meta") else {"vocab_size": tokenizer.vocab_size})


def describe_meta(meta):
    """A tokenizer's description in a few words (its meta dict can hold a whole tokenizer.json)."""
    import hashlib

    if meta.get("kind") == "chat":
        return f"{describe_meta(meta['base'])} + the chat template's {len(CHAT_TOKENS)} tokens"
    if meta.get("kind") == "char":
        chars = meta["chars"]
        return f"{len(chars)} characters {chars[:40]!r}" + ("..." if len(chars) > 40 else "")
    if meta.get("kind") == "bpe":
        return f"a BPE of {meta['vocab_size']} tokens trained here ({hashlib.sha256(meta['json'].encode()).hexdigest()[:8]})"
    return meta.get("encoding") or f"a tokenizer.json of {meta.get('vocab_size')} tokens"


def same_tokenizer(a, b):
    """Whether two tokenizers map text to the same ids: equal descriptions where both have one (ours),
    else the same vocabulary size and the same ids for a probe text."""
    if hasattr(a, "meta") and hasattr(b, "meta"):
        return a.meta() == b.meta()
    probe = "The quick brown fox, 1234!\n  It said: 'naïve café, déjà vu?'\tEnd."
    try:
        return a.vocab_size == b.vocab_size and a.encode(probe) == b.encode(probe)
    except DataError:  # a character vocabulary without some of the probe's characters
        return False


def tokenizer_from_meta(meta):
    if meta.get("kind") == "chat":
        return ChatTokenizer(tokenizer_from_meta(meta["base"]))
    if meta.get("kind") == "char":
        return CharTokenizer(meta["chars"])
    if meta.get("kind") == "tiktoken":
        return TiktokenTokenizer(meta["encoding"])
    if meta.get("kind") == "bpe":
        return BPETokenizer(meta["json"])
    raise DataError(f"unknown tokenizer {meta!r}")


# ----------------------------------------------------------------------------------------------------
# Conversations: the chat template, its tokenizer, and chat datasets (data/prepare.py chats.jsonl ...)

ROLES = ("system", "user", "assistant")
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # a turn: <|role|>content<|end|>
# The same template in Jinja, as transformers' apply_chat_template renders it (export.py writes it)
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


class ChatTokenizer:
    """A base tokenizer (characters, our BPE, a tiktoken encoding) plus the chat template's four special
    tokens, at ids base.vocab_size + 0..3. Text never encodes to them (a user who types "<|user|>" gets
    its characters): only render() places them, so a message cannot forge a turn."""

    def __init__(self, base):
        if isinstance(base, ChatTokenizer):
            base = base.base
        self.base = base
        self.special = {t: base.vocab_size + i for i, t in enumerate(CHAT_TOKENS)}
        self.names = {i: t for t, i in self.special.items()}
        self.vocab_size = base.vocab_size + len(CHAT_TOKENS)
        self.eot_token = base.eot_token
        self.end_token = self.special["<|end|>"]  # where a reply ends: generation stops there

    def encode(self, text):
        return self.base.encode(text)

    def decode(self, ids):
        """Base ids decoded in runs (a multi-byte character may span tokens); special ids as their names."""
        out, run = [], []
        for i in ids:
            if i in self.names:
                out += [self.base.decode(run), self.names[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self.base.decode(run)

    def token_bytes(self):
        return self.base.token_bytes() + [0] * len(CHAT_TOKENS)

    def meta(self):
        return {"kind": "chat", "base": self.base.meta()}

    def render(self, messages, add_generation_prompt=False):
        """(ids, trained) for a checked conversation: trained[i] is 1 where ids[i] is an assistant's content
        or the <|end|> closing its turn (what supervised fine-tuning learns), 0 for everything else (system
        and user turns, the role tokens). add_generation_prompt: <|assistant|> after it, a reply's start."""
        ids, trained = [], []
        for m in messages:
            content = self.encode(m["content"])
            learn = int(m["role"] == "assistant")
            ids += [self.special[f"<|{m['role']}|>"], *content, self.end_token]
            trained += [0] + [learn] * (len(content) + 1)
        if add_generation_prompt:
            ids.append(self.special["<|assistant|>"])
            trained.append(0)
        return ids, trained


def chat_tokenizer(tokenizer):
    """The tokenizer as a ChatTokenizer, or a DataError: a base model's tokenizer has no chat template."""
    if isinstance(tokenizer, ChatTokenizer):
        return tokenizer
    raise DataError(f"this model's tokenizer ({describe_tokenizer(tokenizer)}) has no chat template: it is a base "
                    "model; fine-tune it on conversations first (docs/guide.md: Chat)")


def check_messages(messages, where="messages"):
    """The conversation as a list of {"role", "content"} dicts, checked; a DataError names the first bad
    field (messages[2].role, ...). Extra keys (name, ...) are ignored."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: expected a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(messages):
        field = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{field}: expected an object with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise DataError(f"{field}.role: {m.get('role')!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise DataError(f"{field}.content: expected a string, got {type(m.get('content')).__name__}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


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


def char_tokenizer_for(text):
    return CharTokenizer("".join(sorted(set(text))))


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


def fetch_text(path, url, cache_path):
    """The corpus text: from path when given; else from cache_path, downloading url there first."""
    import urllib.request

    if path is None:
        path = cache_path
        if not os.path.exists(path):
            print(f"downloading {url}")
            try:
                urllib.request.urlretrieve(url, path + ".part")
            except OSError as e:
                raise DataError(f"download of {url} failed ({e}); without network, pass --input PATH to a "
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
