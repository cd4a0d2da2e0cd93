"""Any text into a dataset train.py can use: a file, a folder of files, or a glob.

  python data/prepare.py mybook.txt --out=mybook                       # characters, data/mybook
  python data/prepare.py 'notes/**/*.md' --tokenizer=gpt2 --out=notes  # GPT-2 BPE
  python data/prepare.py corpus/ --tokenizer=cl100k_base --val_fraction=0.05 --out=/data/corpus
  python data/prepare.py code/ --tokenizer=bpe:8192 --out=code        # a BPE learned from your text
  python data/prepare.py chats.jsonl --out=chats --tokenizer_from=out-base  # conversations, for fine-tuning
  python train.py --dataset=mybook ...

Files are read as UTF-8 in sorted order and joined with a newline; the first (1 - val_fraction) of the
characters become train, the rest val. --tokenizer is `char` (a vocabulary of the characters that occur),
`bpe:N` (a byte-level BPE of N tokens learned from the train split only, in seconds, with the `tokenizers`
package; stored in meta.json and as tokenizer.json) or any tiktoken encoding (gpt2, r50k_base, p50k_base,
cl100k_base, o200k_base).

Conversations: .jsonl files of {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
per line (OpenAI's and Hugging Face's shape). They are rendered with the chat template
(<|role|>content<|end|> per turn, four special tokens after the base vocabulary) and written with a loss
mask: only the assistants' content and the <|end|> that closes each of their turns are trained. The last
val_fraction of the conversations are val. --tokenizer_from=RUN takes a base run's tokenizer (the model you
will fine-tune: python train.py --init_from=RUN --dataset=NAME); otherwise --tokenizer as for text.
"""

import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from configurator import UserError  # noqa: E402
from dataset import (DataError, ChatTokenizer, fetch_text, prepare_conversations, prepare_text, read_conversations,  # noqa: E402
                     summary, tokenizer_for, tokenizer_from_meta)


def looks_like_text(path, probe=1 << 16):
    """Whether a file's first 64 KB decode as UTF-8 without NUL bytes (a .pyc, an image or a zip do not)."""
    import codecs

    with open(path, "rb") as f:
        head = f.read(probe)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def input_files(inputs):
    """(files, skipped): the files named, globbed or found in folders, sorted. In a folder, hidden entries
    and __pycache__ are passed over and files that are not UTF-8 text are skipped (counted); a file named
    or globbed must be text, and says so otherwise."""
    files, skipped = [], []
    for item in inputs:
        if os.path.isdir(item):
            found = []
            for d, dirs, names in os.walk(item):
                dirs[:] = [x for x in dirs if not x.startswith(".") and x != "__pycache__"]
                for name in names:
                    path = os.path.join(d, name)
                    if not name.startswith("."):
                        (found if looks_like_text(path) else skipped).append(path)
        else:
            found = glob.glob(item, recursive=True) or ([item] if os.path.exists(item) else [])
        if not found:
            raise DataError(f"{item}: no such file, folder or matching files" + (" (only files that are not UTF-8 text)" if skipped else ""))
        files += found
    return sorted(set(files)), sorted(set(skipped))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="files, folders or globs")
    parser.add_argument("--out", required=True, help="dataset name (written to data/NAME) or a directory path")
    parser.add_argument("--tokenizer", default="char", help="char, bpe:N (learn N tokens from your text), or a tiktoken encoding such as gpt2")
    parser.add_argument("--tokenizer_from", help="conversations: the tokenizer of this training run (its out_dir), the base model you will fine-tune")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of the characters (conversations: of the conversations) kept for val")
    args = parser.parse_args()
    out_dir = args.out if os.sep in args.out else os.path.join(HERE, args.out)
    try:
        files, skipped = input_files(args.inputs)
        chats = [f for f in files if f.endswith(".jsonl")]
        if chats:
            return prepare_chats(files, chats, args, out_dir)
        if args.tokenizer_from:
            raise DataError("--tokenizer_from is for conversations (.jsonl files); text takes --tokenizer")
        if skipped:
            print(f"skipped {len(skipped)} file(s) that are not UTF-8 text, e.g. {skipped[0]}")
        text = "\n".join(fetch_text(f, None, None) for f in files)
        tokenizer = tokenizer_for(args.tokenizer, text, args.val_fraction)
        counts = prepare_text(text, tokenizer, out_dir, args.val_fraction)
    except UserError as e:  # DataError, or a checkpoint's error for --tokenizer_from
        sys.exit(f"error: {e}")
    print(f"{len(files)} file(s), {summary(text, tokenizer, counts, out_dir)}")


def run_tokenizer(run):
    """The tokenizer a training run's checkpoint records (a chat model's: its base)."""
    from checkpoint import CHECKPOINT, load_checkpoint

    path = os.path.join(run, CHECKPOINT)
    if not os.path.exists(path):
        raise DataError(f"--tokenizer_from={run}: no {CHECKPOINT} there; give the out_dir of the run to fine-tune")
    return tokenizer_from_meta(load_checkpoint(path, mmap=True)["tokenizer"])


def prepare_chats(files, chats, args, out_dir):
    if len(chats) != len(files):
        raise DataError(f"conversations (.jsonl) and text cannot go into one dataset: {sorted(set(files) - set(chats))[0]}")
    conversations = [c for f in chats for c in read_conversations(f)]
    if args.tokenizer_from:
        base = run_tokenizer(args.tokenizer_from)
    else:
        text = "\n".join(m["content"] for c in conversations for m in c)
        base = tokenizer_for(args.tokenizer, text, args.val_fraction)
    stats = prepare_conversations(conversations, base, out_dir, args.val_fraction)
    tokenizer = ChatTokenizer(base)
    print(f"{len(chats)} file(s), {len(conversations):,} conversations, vocabulary of {tokenizer.vocab_size} "
          f"({base.vocab_size} + {tokenizer.vocab_size - base.vocab_size} chat tokens): "
          + "; ".join(f"{s} has {v['conversations']:,} ({v['trained_tokens']:,} trained tokens, longest "
                      f"{v['longest']:,}, median {v['median_length']:,})" for s, v in stats.items()) + f" -> {out_dir}")


if __name__ == "__main__":
    main()
