"""OpenWebText (8M web documents, ~9B GPT-2 tokens) into token shards.

  python data/openwebtext/prepare.py                      # from the Hub's parquet export
  python data/openwebtext/prepare.py --data_files 'owt/*.parquet'   # from local files
  python data/openwebtext/prepare.py --help

The Hub repository still carries a dataset loading script, which datasets 4+ refuses, so this reads its
parquet export (revision refs/convert/parquet). 2,000 documents are held out for validation.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shards  # noqa: E402

if __name__ == "__main__":
    shards.main(__doc__, "openwebtext", "Skylion007/openwebtext", hub_config="plain_text",
                hub_revision="refs/convert/parquet")
