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

Labelled examples: .jsonl files of {"text": ..., "label": ...} (a classifier: an encoder with head=classify)
or of {"source": ..., "target": ...} (an encoder-decoder) per line, with BERT's [CLS] [SEP] [MASK] [PAD]
after the base vocabulary; --tokenizer_from=RUN takes an encoder run's tokenizer (a classifier fine-tuned
from BERT's masked-token run), else --tokenizer as for text. The last val_fraction of the examples are val.

Conversations: .jsonl files of {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}
per line (OpenAI's and Hugging Face's shape). They are rendered with the chat template
(<|role|>content<|end|> per turn, four special tokens after the base vocabulary) and written with a loss
mask: only the assistants' content and the <|end|> that closes each of their turns are trained. The last
val_fraction of the conversations are val. --tokenizer_from=RUN takes a base run's tokenizer (the model you
will fine-tune: python train.py --init_from=RUN --dataset=NAME); otherwise --tokenizer as for text.
--hf_dataset=NAME reads them from a Hugging Face dataset's messages column instead (online, or a local
dataset folder): python data/prepare.py --hf_dataset=HuggingFaceH4/no_robots --out=no_robots ...
"""

import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from checkpoint import run_tokenizer  # noqa: E402
from configurator import DataError, UserError, fail  # noqa: E402
from dataset import (fetch_text, hub_offline, hub_reachable, prepare_conversations, prepare_text,
                     read_conversations, summary, tokenizer_for)
from labeled import is_labeled_file, prepare_labeled, read_labeled  # noqa: E402
from tokenizer import ChatTokenizer, check_messages


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
    parser.add_argument("inputs", nargs="*", help="files, folders or globs")
    parser.add_argument("--hf_dataset", help="conversations from a Hugging Face dataset (a Hub name when online, or a local dataset folder) with a messages column")
    parser.add_argument("--hf_split", default="train", help="--hf_dataset's split")
    parser.add_argument("--messages_column", default="messages", help="--hf_dataset's column of conversations")
    parser.add_argument("--out", required=True, help="dataset name (written to data/NAME) or a directory path")
    parser.add_argument("--tokenizer", default="char", help="char, bpe:N (learn N tokens from your text), or a tiktoken encoding such as gpt2")
    parser.add_argument("--tokenizer_from", help="conversations and labelled examples: the tokenizer of this training run (its out_dir), the model you will fine-tune")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of the characters (conversations: of the conversations) kept for val")
    args = parser.parse_args()
    out_dir = args.out if os.sep in args.out else os.path.join(HERE, args.out)
    try:
        if args.hf_dataset:
            if args.inputs:
                raise DataError("give files or --hf_dataset, not both")
            return prepare_chats([], [], args, out_dir, hub_conversations(args))
        if not args.inputs:
            raise DataError("nothing to prepare: give files, folders or globs (or --hf_dataset=NAME for conversations)")
        files, skipped = input_files(args.inputs)
        chats = [f for f in files if f.endswith(".jsonl")]
        if chats and all(is_labeled_file(f) for f in chats):  # {"text", "label"} or {"source", "target"} per line
            return prepare_examples(files, chats, args, out_dir)
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
        fail(e)
    print(f"{len(files)} file(s), {summary(text, tokenizer, counts, out_dir)}")


def hub_conversations(args):
    """The conversations of a Hugging Face dataset's messages column (OpenAI's shape, as HuggingFaceH4's
    and most chat datasets have it), checked one by one."""
    try:
        import datasets
    except ImportError:
        raise DataError("--hf_dataset needs the datasets package: pip install datasets") from None
    name = args.hf_dataset
    if not os.path.isdir(name) and (hub_offline() or not hub_reachable()):
        raise DataError(f"cannot read {name} from the Hugging Face Hub (offline: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE, "
                        "or no network); save its conversations as .jsonl where there is network and pass the file")
    try:
        data = datasets.load_dataset(name, split=args.hf_split)
    except Exception as e:
        raise DataError(f"cannot load {name} ({type(e).__name__}: {str(e)[:200]})") from None
    if args.messages_column not in data.column_names:
        raise DataError(f"{name}: no column {args.messages_column!r} (columns: {data.column_names}); pass --messages_column")
    return [check_messages(m, f"{name}[{i}].{args.messages_column}") for i, m in enumerate(data[args.messages_column])]


def prepare_examples(files, chats, args, out_dir):
    """Labelled texts (a classifier's) or source/target pairs (an encoder-decoder's), with BERT's four
    special tokens after the base vocabulary (labeled.prepare_labeled)."""
    if len(chats) != len(files):
        raise DataError(f"labelled examples (.jsonl) and text cannot go into one dataset: {sorted(set(files) - set(chats))[0]}")
    read = [read_labeled(f) for f in chats]
    kinds = {kind for kind, _ in read}
    if len(kinds) > 1:
        raise DataError("these files mix texts with labels and source/target pairs: prepare them as two datasets")
    records = [r for _, part in read for r in part]
    if args.tokenizer_from:
        base = run_tokenizer(args.tokenizer_from)
    else:
        fields = ("text",) if kinds == {"labels"} else ("source", "target")
        base = tokenizer_for(args.tokenizer, "\n".join(r[f] for r in records for f in fields), args.val_fraction)
    meta = prepare_labeled(kinds.pop(), records, base, out_dir, args.val_fraction)
    labeled = meta["labeled"]
    what = f"{len(labeled['classes'])} labels ({', '.join(labeled['classes'][:8])})" if "classes" in labeled else "source/target pairs"
    print(f"{len(chats)} file(s), {len(records):,} examples, {what}, vocabulary of {meta['vocab_size']} (with "
          f"[CLS] [SEP] [MASK] [PAD]): train has {labeled['examples']['train']:,}, val {labeled['examples']['val']:,} -> {out_dir}")


def prepare_chats(files, chats, args, out_dir, conversations=None):
    if len(chats) != len(files):
        raise DataError(f"conversations (.jsonl) and text cannot go into one dataset: {sorted(set(files) - set(chats))[0]}")
    if conversations is None:
        conversations = [c for f in chats for c in read_conversations(f)]
    if args.tokenizer_from:
        base = run_tokenizer(args.tokenizer_from)
    else:
        text = "\n".join(m["content"] for c in conversations for m in c)
        base = tokenizer_for(args.tokenizer, text, args.val_fraction)
    stats = prepare_conversations(conversations, base, out_dir, args.val_fraction)
    tokenizer = ChatTokenizer(base)
    print(f"{f'{len(chats)} file(s)' if chats else args.hf_dataset}, {len(conversations):,} conversations, vocabulary of {tokenizer.vocab_size} "
          f"({base.vocab_size} + {tokenizer.vocab_size - base.vocab_size} chat tokens): "
          + "; ".join(f"{s} has {v['conversations']:,} ({v['trained_tokens']:,} trained tokens, longest "
                      f"{v['longest']:,}, median {v['median_length']:,})" for s, v in stats.items()) + f" -> {out_dir}")


if __name__ == "__main__":
    main()
