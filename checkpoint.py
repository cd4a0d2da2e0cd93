"""
Checkpoints, shared by train.py, sample.py, bench.py and export.

A checkpoint holds only tensors, numbers, strings, lists and dicts, so it loads with
torch.load(weights_only=True): a file that needs arbitrary unpickling (code execution) is refused.
Writes are atomic (temporary file, fsync, rename, fsync of the directory): a crash, a kill or a full
disk leaves the previous checkpoint intact.
"""

import io
import os
import pickle
import zipfile

import torch

from dataset import atomic_write
from model import GPT, GPTConfig

FORMAT = 1


class CheckpointError(ValueError):
    pass


def save_checkpoint(path, state):
    buffer = io.BytesIO()
    torch.save(state, buffer)  # serialise fully before touching the disk
    atomic_write(path, lambda f: f.write(buffer.getbuffer()))
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def load_checkpoint(path, map_location="cpu"):
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint; train one first, or check out_dir")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise CheckpointError(f"{path}: refused: it contains pickled Python objects beyond tensors and "
                                  "plain data, and loading it could run arbitrary code") from None
        raise CheckpointError(f"{path}: corrupt checkpoint ({e})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise CheckpointError(f"{path}: not a checkpoint written by train.py (format {FORMAT})")
    return state


def model_from_checkpoint(state, path):
    """Rebuilds the model a checkpoint holds; a weight that does not fit its config is a clear error."""
    try:
        config = GPTConfig(**state["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model config: {e}") from None
    model = GPT(config)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not match its model config: {str(e).splitlines()[0]}") from None
    return model
