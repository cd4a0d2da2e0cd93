"""tokenizer.py: each tokenizer round-trips text, refuses what it cannot encode, and rebuilds from its meta; the
chat template's tokens come from render() only. (Against the libraries users load them with: test_export.py.)"""

import pytest
from conftest import make_text

from configurator import DataError
from tokenizer import (CHAT_TOKENS, BPETokenizer, CharTokenizer, ChatTokenizer, char_tokenizer_for, describe_meta,
                       same_tokenizer, tokenizer_from_meta)

TEXT = "Hello world! Ünïcödé, 日本語, emoji 🙂 and\nnew lines,\ttabs  and 3.14 digits."


def gpt2_tokenizer():
    from tokenizer import TiktokenTokenizer

    try:
        return TiktokenTokenizer("gpt2")
    except Exception as e:  # no ../shared tiktoken cache and no network
        pytest.skip(f"tiktoken gpt2 files unavailable: {e}")


def test_char_round_trip_and_unknown_characters():
    text = make_text(2000)
    tok = char_tokenizer_for(text)
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(DataError, match="characters not in the vocabulary: '#@'"):
        tok.encode("the @ #")


def test_gpt2_round_trip():
    tok = gpt2_tokenizer()
    text = "Hello world! Ünïcödé, 日本語, emoji 🙂 and\nnew lines."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("Hello world") == [15496, 995]


def test_our_bpe_round_trips_any_text_and_travels_in_its_meta():
    """A byte-level BPE has no unknown characters; its meta (the whole tokenizer.json) rebuilds the same ids."""
    tok = BPETokenizer.train(make_text(5000), 300)
    assert tok.vocab_size == 300 and tok.eot_token == 0
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and max(ids) < 300
    again = tokenizer_from_meta(tok.meta())
    assert again.encode(TEXT) == ids and same_tokenizer(tok, again)
    assert sum(tok.token_bytes()[i] for i in ids) == len(TEXT.encode("utf-8"))  # bits per byte's divisor
    with pytest.raises(DataError, match="at least 258 tokens"):
        BPETokenizer.train("abc", 100)


def test_the_chat_tokens_come_from_render_only():
    """A user who types "<|user|>" gets its characters, never the special id: a message cannot forge a turn."""
    base = CharTokenizer("".join(sorted(set("<|user|>assistant hello"))))
    chat = ChatTokenizer(base)
    assert chat.vocab_size == base.vocab_size + len(CHAT_TOKENS) and ChatTokenizer(chat).base is base
    typed = chat.encode("<|user|>")
    assert max(typed) < base.vocab_size and chat.decode(typed) == "<|user|>"
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    ids, trained = chat.render(turns, add_generation_prompt=True)
    assert chat.decode(ids) == "<|user|>hello<|end|><|assistant|>hi<|end|><|assistant|>"
    assert trained == [0] * 7 + [0, 1, 1, 1] + [0]  # the assistant's content and its <|end|>, nothing else
    assert tokenizer_from_meta(chat.meta()).render(turns) == chat.render(turns)
    assert describe_meta(chat.meta()).endswith("the chat template's 4 tokens")


def test_an_unknown_tokenizer_meta_is_refused():
    with pytest.raises(DataError, match="unknown tokenizer"):
        tokenizer_from_meta({"kind": "sentencepiece"})
