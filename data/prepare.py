"""Any text into a dataset train.py can use: a file, a folder of files, or a glob.

  python data/prepare.py mybook.txt --out=mybook                       # characters, data/mybook
  python data/prepare.py 'notes/**/*.md' --tokenizer=gpt2 --out=notes  # GPT-2 BPE
  python data/prepare.py corpus/ --tokenizer=cl100k_base --val_fraction=0.05 --out=/data/corpus
  python train.py --dataset=mybook ...

Files are read as UTF-8 in sorted order and joined with a newline; the first (1 - val_fraction) of the
characters become train, the rest val. --tokenizer is `char` (a vocabulary of the characters that occur)
or any tiktoken encoding (gpt2, r50k_base, p50k_base, cl100k_base, o200k_base).
"""

import argparse
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from dataset import DataError, TiktokenTokenizer, char_tokenizer_for, fetch_text, prepare_text, summary  # noqa: E402


def input_files(inputs):
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = [os.path.join(d, f) for d, _, names in os.walk(item) for f in names if not f.startswith(".")]
        else:
            found = glob.glob(item, recursive=True) or ([item] if os.path.exists(item) else [])
        if not found:
            raise DataError(f"{item}: no such file, folder or matching files")
        files += found
    return sorted(set(files))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="files, folders or globs")
    parser.add_argument("--out", required=True, help="dataset name (written to data/NAME) or a directory path")
    parser.add_argument("--tokenizer", default="char", help="char, or a tiktoken encoding such as gpt2")
    parser.add_argument("--val_fraction", type=float, default=0.1, help="share of the characters kept for val")
    args = parser.parse_args()
    out_dir = args.out if os.sep in args.out else os.path.join(HERE, args.out)
    try:
        files = input_files(args.inputs)
        text = "\n".join(fetch_text(f, None, None) for f in files)
        tokenizer = char_tokenizer_for(text) if args.tokenizer == "char" else TiktokenTokenizer(args.tokenizer)
        counts = prepare_text(text, tokenizer, out_dir, args.val_fraction)
    except DataError as e:
        sys.exit(f"error: {e}")
    print(f"{len(files)} file(s), {summary(text, tokenizer, counts, out_dir)}")


if __name__ == "__main__":
    main()
