"""FineWeb's sample-10BT (about 10B GPT-2 tokens of filtered Common Crawl) into token shards.

  python data/fineweb/prepare.py --streaming --max_shards=10   # the first 1B tokens, no full download
  python data/fineweb/prepare.py --data_files 'fineweb/*.parquet'
  python data/fineweb/prepare.py --help

2,000 documents are held out for validation.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shards  # noqa: E402

if __name__ == "__main__":
    shards.main(__doc__, "fineweb", "HuggingFaceFW/fineweb", hub_config="sample-10BT")
