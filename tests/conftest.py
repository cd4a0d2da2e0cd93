import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# Offline by construction: no test may reach the Hugging Face Hub or wandb's servers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED_DATA / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_DATA / "tiktoken_cache")
sys.path.insert(0, str(ROOT))
