"""TinyStories (2.1M short stories by GPT-3.5/4, ~470M GPT-2 tokens) into token shards.

  python data/tinystories/prepare.py
  python data/tinystories/prepare.py --data_files train.parquet --val_files validation.parquet
  python data/tinystories/prepare.py --help

Its own validation split is used for validation.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shards  # noqa: E402

if __name__ == "__main__":
    shards.main(__doc__, "tinystories", "roneneldan/TinyStories", hub_val_split="validation")
