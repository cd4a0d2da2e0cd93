"""A generated seq2seq task: a number's digits -> its English words (an encoder-decoder's first task).

  python data/numbers/prepare.py [--train=20000] [--val=500] [--out=data/numbers]

"40213" -> "forty thousand two hundred thirteen", numbers drawn from 0-99,999 with a fixed seed; the val
numbers never occur in train. Writes numbers.jsonl ({"source", "target"} per line, val last) and prepares
it as data/prepare.py does (characters, BERT's special tokens after them).
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from configurator import DataError, cli_main  # noqa: E402
from labeled import prepare_labeled  # noqa: E402
from tokenizer import char_tokenizer_for  # noqa: E402

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def words(n):
    """English words for 0 <= n < 1,000,000 (no "and": forty thousand two hundred thirteen)."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + words(n % 100))
    return words(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + words(n % 1000))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=20000, help="training pairs")
    parser.add_argument("--val", type=int, default=500, help="held-out pairs (numbers not in train)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=HERE)
    args = parser.parse_args(argv)
    if args.train < 1 or args.val < 1 or args.train + args.val > 100_000:
        raise DataError(f"--train={args.train} and --val={args.val} must be >= 1 and together at most 100,000")
    numbers = random.Random(args.seed).sample(range(100_000), args.train + args.val)
    records = [{"source": str(n), "target": words(n)} for n in numbers]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "numbers.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    text = "".join(r["source"] + r["target"] for r in records)
    meta = prepare_labeled("pairs", records, char_tokenizer_for(text), args.out, args.val / len(records))
    print(f"{args.out}: {meta['labeled']['examples']['train']:,} train and {meta['labeled']['examples']['val']:,} val pairs, "
          f"e.g. {records[0]['source']} -> {records[0]['target']!r}")


if __name__ == "__main__":
    cli_main(main)
