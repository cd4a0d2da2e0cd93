"""Multi-query associative recall (MQAR, Arora et al. 2023, Zoology): the test of what a linear or
recurrent layer can recall that softmax attention reads off directly.

  python data/mqar/prepare.py --pairs=16 --out_dir=data/mqar16
  python train.py --dataset=mqar16 --attn_pattern=N ...            (config/ablations/mqar.py: every kind)
  python eval.py --out_dir=RUN                                     the queried values' accuracy

Each sequence gives `pairs` key-value pairs (keys and values drawn without repeats from their own
vocabularies), then asks for every key again in a random order, each query followed by its value:

  k3 v3 k7 v7 k1 v1 ... | k7 v7 k1 v1 k3 v3 ...

Only the values after a query are trained and scored (a loss mask, as a chat dataset's), so the loss and
eval.py's accuracy measure recall alone. Tokens are characters of a synthetic alphabet (keys, then
values), so every tool that reads a character dataset reads these.
"""

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from configurator import DataError, UserError, fail  # noqa: E402
from dataset import write_masked  # noqa: E402
from tokenizer import CharTokenizer  # noqa: E402

FIRST = 0x100  # the alphabet's first code point: keys then values, clear of ASCII


def sequence(rng, pairs, keys, values):
    """(ids, trained) of one MQAR sequence: the pairs, then each key queried once with its value trained."""
    ks = rng.sample(range(keys), pairs)
    vs = rng.sample(range(values), pairs)
    ids = [t for k, v in zip(ks, vs) for t in (k, keys + v)]
    order = rng.sample(range(pairs), pairs)
    trained = [0] * len(ids)
    for i in order:
        ids += [ks[i], keys + vs[i]]
        trained += [0, 1]
    return ids, trained


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=16, help="key-value pairs per sequence (sequence length 4 x pairs)")
    parser.add_argument("--keys", type=int, default=64, help="the key vocabulary")
    parser.add_argument("--values", type=int, default=64, help="the value vocabulary")
    parser.add_argument("--train", type=int, default=20_000, help="training sequences")
    parser.add_argument("--val", type=int, default=1_000, help="held-out sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out_dir", default=os.path.join(HERE, "..", "mqar"), help="where the dataset goes")
    args = parser.parse_args()
    try:
        if not 1 <= args.pairs <= min(args.keys, args.values):
            raise DataError(f"--pairs={args.pairs} must be in [1, min(--keys, --values) = {min(args.keys, args.values)}]: "
                            "keys and values do not repeat within a sequence")
        rng = random.Random(args.seed)
        tokenizer = CharTokenizer("".join(chr(FIRST + i) for i in range(args.keys + args.values)))
        splits = {split: [sequence(rng, args.pairs, args.keys, args.values) for _ in range(n)]
                  for split, n in (("train", args.train), ("val", args.val))}
        stats = write_masked(args.out_dir, tokenizer, splits)
    except UserError as e:
        fail(e)
    print(f"MQAR, {args.pairs} pairs of {args.keys} keys and {args.values} values: {stats['train']['conversations']:,} train "
          f"and {stats['val']['conversations']:,} val sequences of {4 * args.pairs} tokens -> {args.out_dir}")


if __name__ == "__main__":
    main()
