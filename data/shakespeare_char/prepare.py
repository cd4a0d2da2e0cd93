"""Tiny Shakespeare as characters: a 65-symbol vocabulary, 90% train / 10% val.

python data/shakespeare_char/prepare.py [--input PATH] [--out_dir DIR]

Without --input, the text is downloaded once to input.txt beside this script.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from dataset import prepare_corpus_main  # noqa: E402
from tokenizer import char_tokenizer_for  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

if __name__ == "__main__":
    prepare_corpus_main(__doc__, URL, HERE, char_tokenizer_for)
