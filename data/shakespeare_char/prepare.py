"""Tiny Shakespeare as characters: a 65-symbol vocabulary, 90% train / 10% val.

python data/shakespeare_char/prepare.py [--input PATH] [--out_dir DIR]

Without --input, the text is downloaded once to input.txt beside this script.
"""

import argparse
import os
import sys
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from dataset import char_tokenizer_for, prepare_text  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
HERE = os.path.dirname(os.path.abspath(__file__))


def read_input(path, url):
    """The corpus text: from path when given, else from beside this script, downloading it first."""
    if path is None:
        path = os.path.join(HERE, "input.txt")
        if not os.path.exists(path):
            print(f"downloading {url}")
            try:
                urllib.request.urlretrieve(url, path + ".part")
            except OSError as e:
                sys.exit(f"error: download failed ({e}); without network, pass --input PATH to a local copy")
            os.replace(path + ".part", path)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        sys.exit(f"error: cannot read {path}: {e.strerror}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="a local copy of tinyshakespeare/input.txt (skips the download)")
    parser.add_argument("--out_dir", default=HERE, help="where train.bin, val.bin and meta.json go")
    args = parser.parse_args()
    text = read_input(args.input, URL)
    tokenizer = char_tokenizer_for(text)
    counts = prepare_text(text, tokenizer, args.out_dir)
    print(f"{len(text):,} characters, vocabulary of {tokenizer.vocab_size}: "
          f"train {counts['train']:,} tokens, val {counts['val']:,} tokens -> {args.out_dir}")


if __name__ == "__main__":
    main()
