"""A text classification task: who wrote this snippet, Shakespeare or Tolstoy (in the Maudes' English)?

  python data/authors/prepare.py [--shakespeare PATH] [--tolstoy PATH] [--length=62] [--train=20000] [--val=2000]

Snippets of --length characters cut at random from Tiny Shakespeare and War and Peace (downloaded beside
this script unless given), half from each, with War and Peace written in Tiny Shakespeare's 65 characters
(any other is dropped), so the classifier reads the characters a shakespeare_char run knows. Training
snippets come from the first 90% of each text, held-out ones from the last 10%: the split shakespeare_char
uses, so an encoder pretrained there (config/train_mlm_shakespeare_char_cpu.py) never saw a held-out
snippet. Writes authors.jsonl ({"text", "label"} per line, val last) and prepares it as data/prepare.py
does, with Tiny Shakespeare's character vocabulary and BERT's four special tokens.
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from configurator import DataError, cli_main  # noqa: E402
from dataset import fetch_text  # noqa: E402
from labeled import prepare_labeled  # noqa: E402
from tokenizer import char_tokenizer_for  # noqa: E402

SHAKESPEARE = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TOLSTOY = ("https://raw.githubusercontent.com/MrHereward/machine_learning_sandbox/"
           "2d0fdf30f4afbcf01c1b8c7b408e738a0161d613/warpeace_input.txt")


def snippets(text, n, length, rng):
    return [text[i : i + length] for i in (rng.randrange(len(text) - length) for _ in range(n))]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shakespeare", help="Tiny Shakespeare's input.txt (default: downloaded here)")
    parser.add_argument("--tolstoy", help="War and Peace as text (default: downloaded here)")
    parser.add_argument("--length", type=int, default=62, help="characters per snippet ([CLS] snippet [SEP]: 64 tokens)")
    parser.add_argument("--train", type=int, default=20000, help="training snippets (half per author)")
    parser.add_argument("--val", type=int, default=2000, help="held-out snippets (half per author)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args(argv)
    if args.length < 1 or args.train < 2 or args.val < 2:
        raise DataError(f"--length={args.length} must be >= 1, --train={args.train} and --val={args.val} >= 2")
    shakespeare = fetch_text(args.shakespeare, SHAKESPEARE, os.path.join(HERE, "shakespeare.txt"), "--shakespeare")
    tokenizer = char_tokenizer_for(shakespeare)  # shakespeare_char's vocabulary
    known = set(tokenizer.chars)
    tolstoy = "".join(ch for ch in fetch_text(args.tolstoy, TOLSTOY, os.path.join(HERE, "warpeace.txt"), "--tolstoy") if ch in known)
    rng = random.Random(args.seed)
    splits = {}
    for split, n in (("train", args.train), ("val", args.val)):
        examples = []
        for label, text in (("shakespeare", shakespeare), ("tolstoy", tolstoy)):
            cut = int(len(text) * 0.9)
            part = text[:cut] if split == "train" else text[cut:]
            examples += [{"text": s, "label": label} for s in snippets(part, n // 2, args.length, rng)]
        rng.shuffle(examples)
        splits[split] = examples
    records = splits["train"] + splits["val"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "authors.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    meta = prepare_labeled("labels", records, tokenizer, args.out, len(splits["val"]) / len(records))
    print(f"{args.out}: {meta['labeled']['examples']['train']:,} train and {meta['labeled']['examples']['val']:,} val "
          f"snippets of {args.length} characters, labels {', '.join(meta['labeled']['classes'])}")


if __name__ == "__main__":
    cli_main(main)
