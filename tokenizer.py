"""
Tokenizers and the chat template. meta.json (and every checkpoint) names a tokenizer as a small dict, its
meta(); tokenizer_from_meta rebuilds it.

  CharTokenizer       a character vocabulary (the Quick start's)
  TiktokenTokenizer   a tiktoken encoding (gpt2, ...)
  HFTokenizer         a Hugging Face tokenizer.json (pretrained weights' own)
  BPETokenizer        a byte-level BPE learned from your text (data/prepare.py --tokenizer=bpe:N)
  ChatTokenizer       any of those plus the chat template's four special tokens

Every tokenizer has vocab_size, eot_token, encode(text), decode(ids), token_bytes() (bits per byte's
divisor) and, ours, meta().
"""

from configurator import DataError


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

    char_unk = None  # a character model's export: the id other characters read as (UNK), if it has one

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
    if meta.get("kind") == "encoder":
        return f"{describe_meta(meta['base'])} + BERT's {len(ENCODER_TOKENS)} tokens ({', '.join(ENCODER_TOKENS)})"
    if meta.get("kind") == "images":
        return f"images ({meta['channels']} x {meta['image_size']} x {meta['image_size']}, {len(meta['classes'])} classes)"
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


def same_vocabulary(a, b):
    """Whether two tokenizers have the same tokens at the same ids and encode text alike, whatever their meta says
    (a GGUF's byte-level BPE read back against the bpe:N it was written from)."""
    def ids(tokenizer, text):
        try:
            return tokenizer.encode(text)
        except DataError:  # a character vocabulary without some of the probe's characters: both should refuse
            return None

    return (a.vocab_size == b.vocab_size and all(a.decode([i]) == b.decode([i]) for i in range(a.vocab_size))
            and all(ids(a, t) == ids(b, t) for t in PROBES))


def tokenizer_from_meta(meta):
    """The tokenizer a dataset's or checkpoint's meta names; None for images (a vision transformer reads pixels)."""
    if meta.get("kind") == "images":
        return None
    if meta.get("kind") == "encoder":
        return EncoderTokenizer(tokenizer_from_meta(meta["base"]))
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
# The chat template and its tokenizer

ROLES = ("system", "user", "assistant")
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # a turn: <|role|>content<|end|>
# The same template in Jinja, as transformers' apply_chat_template renders it (export.py writes it)
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


class SpecialTokens:
    """A base tokenizer (characters, our BPE, a tiktoken encoding) plus special tokens (TOKENS) at ids
    base.vocab_size + 0, 1, ... Text never encodes to them (a user who types one gets its characters):
    only the code that frames a text places them."""

    TOKENS = ()

    def __init__(self, base):
        if isinstance(base, SpecialTokens):
            base = base.base
        self.base = base
        self.special = {t: base.vocab_size + i for i, t in enumerate(self.TOKENS)}
        self.names = {i: t for t, i in self.special.items()}
        self.vocab_size = base.vocab_size + len(self.TOKENS)
        self.eot_token = base.eot_token

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
        return self.base.token_bytes() + [0] * len(self.TOKENS)


class ChatTokenizer(SpecialTokens):
    """A base tokenizer plus the chat template's four special tokens; only render() places them, so a
    message cannot forge a turn."""

    TOKENS = CHAT_TOKENS

    def __init__(self, base):
        super().__init__(base)
        self.end_token = self.special["<|end|>"]  # where a reply ends: generation stops there

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


ENCODER_TOKENS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")  # BERT's: first, end (a decoder's start and end too), masked, padding


class EncoderTokenizer(SpecialTokens):
    """A base tokenizer plus BERT's four special tokens: [CLS] opens an encoder's input (a classifier reads
    its final state), [SEP] ends it, [MASK] stands for a masked token, [PAD] fills a short row. An
    encoder-decoder's decoder starts at [CLS] and stops at [SEP]."""

    TOKENS = ENCODER_TOKENS

    def __init__(self, base):
        if isinstance(base, ChatTokenizer):
            raise DataError("a chat model's tokenizer cannot take BERT's tokens too: an encoder starts from a base "
                            "tokenizer (prepare from a base run, or with --tokenizer)")
        super().__init__(base)
        self.eot_token = self.end_token = self.special["[SEP]"]

    @classmethod
    def from_meta(cls, meta):
        return cls(tokenizer_from_meta(meta["base"] if meta.get("kind") == "encoder" else meta))

    def meta(self):
        return {"kind": "encoder", "base": self.base.meta()}

    def wrap(self, text):
        """[CLS] text [SEP]: a classifier's input."""
        return [self.special["[CLS]"], *self.encode(text), self.special["[SEP]"]]


def source_end(tokenizer):
    """Where an encoder-decoder's source and output end: [SEP] here; T5's </s>, its eos."""
    end = tokenizer.end_token if isinstance(tokenizer, EncoderTokenizer) else tokenizer.eot_token
    if end is None:
        raise DataError(f"{describe_tokenizer(tokenizer)} has no end token to close an encoder-decoder's source")
    return end


def source_ids(tokenizer, text):
    """An encoder-decoder's source: the text's ids, then its end."""
    return [*tokenizer.encode(text), source_end(tokenizer)]


def decoder_start(tokenizer):
    """The token an encoder-decoder's decoder starts from: [CLS] here; a Hugging Face model's
    decoder_start_token_id (T5's: its pad, 0)."""
    if isinstance(tokenizer, EncoderTokenizer):
        return tokenizer.special["[CLS]"]
    start = getattr(tokenizer, "decoder_start", None)
    return 0 if start is None else start


def encoder_tokenizer(tokenizer):
    return tokenizer if isinstance(tokenizer, EncoderTokenizer) else EncoderTokenizer(tokenizer)


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


def char_tokenizer_for(text):
    return CharTokenizer("".join(sorted(set(text))))
