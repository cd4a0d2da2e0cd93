"""Tiny Shakespeare with GPT-2's BPE (tiktoken gpt2): 90% of the characters train, 10% val.

python data/shakespeare/prepare.py [--input PATH] [--out_dir DIR]

Without --input, the text is downloaded once to input.txt beside this script. Gives 301,966 train and
36,059 val tokens, as nanoGPT's readme reports.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from dataset import prepare_corpus_main  # noqa: E402
from tokenizer import TiktokenTokenizer  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

if __name__ == "__main__":
    prepare_corpus_main(__doc__, URL, HERE, lambda text: TiktokenTokenizer("gpt2"))
