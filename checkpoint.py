"""
Checkpoints, shared by train.py, rl.py, sample.py, bench.py and export.py, and load_any: the one way every
script loads a model (a training run, a Hugging Face directory, a pretrained name). And what else a run
keeps beside its checkpoint: its lock, its log (Logger: metrics.jsonl), how it stops (StopRequest).

A checkpoint holds only tensors, numbers, strings, lists and dicts, so it loads with
torch.load(weights_only=True): a file that needs arbitrary unpickling (code execution) is refused.
Writes are atomic (temporary file, fsync, rename, fsync of the directory): a crash, a kill or a full
disk leaves the previous checkpoint intact.
"""

import glob
import io
import json
import os
import pickle
import signal
import socket
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

import gguf_file
import lora
from configurator import ConfigError, UserError, checked
from dataset import atomic_write
from hf import GPT2_HUB_NAMES, pretrained_tokenizer
from model import GPT, GPTConfig
from tokenizer import tokenizer_from_meta

FORMAT = 1
CHECKPOINT = "ckpt.pt"  # in out_dir
METRICS = "metrics.jsonl"  # in out_dir: one JSON line per log and evaluation


class CheckpointError(UserError):
    pass


def save_checkpoint(path, state):
    buffer = io.BytesIO()
    torch.save(state, buffer)  # serialise fully before touching the disk
    try:
        atomic_write(path, lambda f: f.write(buffer.getbuffer()))
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)
    except OSError as e:
        raise OSError(e.errno, f"could not write {path} ({e.strerror}); the previous checkpoint is untouched") from None


def load_checkpoint(path, map_location="cpu", mmap=False):
    """The checkpoint's state, checked. mmap=True maps the tensors instead of reading them: for callers
    that want its configs only."""
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        if os.path.basename(parent) == CHECKPOINT:  # --out_dir=run/ckpt.pt: the file itself was given
            raise CheckpointError(f"{parent} is the checkpoint file; out_dir takes its folder: --out_dir={os.path.dirname(parent) or '.'}")
        raise CheckpointError(f"{path}: no such checkpoint; train one first, or check out_dir")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive: anything else is damage, not a threat
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint (not the zip archive torch.save writes; "
                              f"{os.path.getsize(path):,} bytes)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
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


class RunState:
    """Where a training run stands, and its checkpoint: save() writes and restore() reads the keys side by
    side, once. Beside the weights, the optimizers' and loss scaler's state, both configs (the model's and
    the training's, as they ran) and the tokenizer: the step, the best val loss, the step last evaluated,
    the batch sampler's position, every process's RNG, how much of metrics.jsonl belongs to the checkpoint
    and the wall time so far; and the precision it computes in (autocast's dtype, Muon's Newton-Schulz dtype),
    which a resume keeps. run: train.py's Run (its model, optimizers, scaler, sampler, process group)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.iter_num, self.best_val, self.evaluated_at = 0, float("inf"), -1
        self.metrics_bytes, self.elapsed_before, self.rng_processes = None, 0.0, None

    def elapsed(self):
        return self.elapsed_before + time.perf_counter() - self.started

    def restore(self, ckpt, run):
        # imported here, as in save(): 0.65 s that --help and a refused configuration need not wait for
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(run.raw_model, run.optimizers, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
        if ckpt["scaler"]:
            run.scaler.load_state_dict(ckpt["scaler"])
        run.train_batches.load_state_dict(ckpt["sampler"])
        rng = ckpt["rng"]
        self.rng_processes = len(rng["cpu"])
        if self.rng_processes == run.world.size:
            torch.set_rng_state(rng["cpu"][run.world.rank])
            if run.device_type == "cuda" and rng["cuda"][run.world.rank] is not None:
                torch.cuda.set_rng_state(rng["cuda"][run.world.rank])
            if run.device_type == "mps" and (rng.get("mps") or [None] * self.rng_processes)[run.world.rank] is not None:
                torch.mps.set_rng_state(rng["mps"][run.world.rank])  # dropout's masks, as the run would have drawn
        self.iter_num, self.best_val, self.evaluated_at = ckpt["iter_num"], ckpt["best_val_loss"], ckpt["evaluated_at"]
        self.metrics_bytes, self.elapsed_before = ckpt["metrics_bytes"], ckpt["elapsed"]

    def save(self, run, path, logger):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(run.raw_model, run.optimizers, options=options)
        cuda = run.device_type == "cuda"
        mps = run.device_type == "mps"
        rng = run.world.gather((torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None,
                                torch.mps.get_rng_state() if mps else None))
        if not run.world.master:
            return
        if run.lora:  # the adapters (and the new tokens' rows) alone; the base is on disk, named and hashed
            model_state = {k: v for k, v in model_state.items() if k in lora.trainable(run.raw_model)}
        state = {
            "format": FORMAT, "model": model_state, "optimizer": optim_state, "lora": run.lora,
            "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
            "model_config": asdict(run.model_config),
            "train_config": run.train_config if isinstance(run.train_config, dict) else asdict(run.train_config),  # (rl.py's: a dict)
            "tokenizer": run.data_meta["tokenizer"], "iter_num": self.iter_num, "best_val_loss": self.best_val,
            "evaluated_at": self.evaluated_at, "sampler": run.train_batches.state_dict(),
            "rng": {"cpu": [r[0] for r in rng], "cuda": [r[1] for r in rng], "mps": [r[2] for r in rng]},
            "metrics_bytes": logger.durable_size(), "elapsed": self.elapsed(),
            "precision": {"dtype": run.dtype, "newton_schulz": str(run.newton_schulz).removeprefix("torch."),
                          "device_type": run.device_type},
            **getattr(run, "extra_state", {}),  # rl.py's: its own config and the model it started from
        }  # fmt: skip
        save_checkpoint(path, state)


def lora_model(state, path, merged=True, dropout=0.0):
    """A LoRA run's model: its base (checked against the sha256 recorded when the run began), the chat
    tokens' rows if it added them, and the adapters; merged into plain weights unless merged=False (a
    resumed run trains on)."""
    record = state["lora"]
    base_path = os.path.join(record["base"], CHECKPOINT)
    if not os.path.exists(base_path):
        raise CheckpointError(f"{path}: a LoRA run's adapters need their base, {base_path}, which is gone; restore it "
                              "(the adapters fit only the weights they were trained on)")
    if lora.file_sha256(base_path) != record["base_sha256"]:
        raise CheckpointError(f"{path}: its base {base_path} changed since the LoRA run began (sha256 differs); "
                              "the adapters fit only the weights they were trained on: restore that checkpoint")
    model = with_dropout(model_from_checkpoint(load_checkpoint(base_path), base_path), dropout)  # a resumed run's
    first = record["new_rows_from"]
    if first is not None:
        model.add_tokens(first, list(range(first, state["model_config"]["vocab_size"])))
    lora.apply(model, record["rank"], record["alpha"], record["dropout"], lora.parse_targets(record["targets"]), first)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    trained = set(lora.trainable(model))
    if unexpected or trained - set(state["model"]):
        raise CheckpointError(f"{path}: its adapters do not fit the base's model ({(unexpected or sorted(trained - set(state['model'])))[0]})")
    return lora.merge(model) if merged else model


def model_from_checkpoint(state, path):
    """Rebuilds the model a checkpoint holds; a weight that does not fit its config is a clear error. A
    LoRA run's: its base with the adapters merged (lora_model)."""
    if state.get("lora"):
        return lora_model(state, path)
    try:
        config = GPTConfig(**state["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model config: {e}") from None
    model = GPT(config)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:  # the first line is a title; the second names the first problem
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else lines[0]
        raise CheckpointError(f"{path}: weights do not match its model config ({detail[:300]})") from None
    return model


def with_dropout(model, dropout):
    """The model rebuilt with another dropout (the modules carry their own rate), or itself for 0."""
    return at_dropout(model, dropout) if dropout else model


def at_dropout(model, dropout):
    """The model at this dropout rate: rebuilt with it (the modules carry their own rate), or itself if it has it."""
    if dropout == model.config.dropout:
        return model
    tuned = GPT(replace(model.config, dropout=dropout))
    tuned.load_state_dict(model.state_dict())
    return tuned


def with_head(model, keys):
    """An encoder rebuilt with another head (head, n_classes, pooler: a classifier fine-tuned from BERT's
    masked-token run): the blocks and embeddings kept, the new head's weights at their initialisation."""
    head = keys.get("head", model.config.head)
    if model.config.family != "encoder" or head == "lm" or (model.config.image_size and head != "classify"):
        raise ValueError(f"a new head ({', '.join(keys)}) goes on an encoder's text model; this model is "
                         f"family={model.config.family!r}" + (" (a vision transformer)" if model.config.image_size else ""))
    tuned = GPT(replace(model.config, **keys))
    kept = {k: v for k, v in model.state_dict().items() if k in tuned.state_dict() and v.shape == tuned.state_dict()[k].shape}
    tuned.load_state_dict(kept, strict=False)
    return tuned


def load_model(out_dir, dropout=0.0):
    """(model, checkpoint state) from out_dir/ckpt.pt: what sample.py, bench.py and export.py load.

    dropout: the model rebuilt with this rate (a fine-tune starting from the run).
    """
    path = os.path.join(out_dir, CHECKPOINT)
    state = load_checkpoint(path)
    return with_dropout(model_from_checkpoint(state, path), dropout), state


def run_tokenizer(run):
    """The tokenizer a training run's checkpoint records (a chat model's: its base): what data/prepare.py
    --tokenizer_from=RUN prepares conversations with."""
    path = os.path.join(run, CHECKPOINT)
    if not os.path.exists(path):
        raise CheckpointError(f"--tokenizer_from={run}: no {CHECKPOINT} there; give the out_dir of the run to fine-tune")
    return tokenizer_from_meta(load_checkpoint(path, mmap=True)["tokenizer"])


def load_any(spec, with_tokenizer=True):
    """(model, tokenizer, checkpoint state or None) for spec: a training run's out_dir (it holds ckpt.pt),
    a Hugging Face model directory (config.json), a pretrained name (gpt2 ... gpt2-xl) or a GGUF file. Anything else
    is read as a run, whose error says what is missing. with_tokenizer=False: None for the tokenizer,
    for callers that need none (loading one can need the tiktoken cache or a tokenizer.json)."""
    if spec.endswith(".gguf"):  # llama.cpp's format: ours exported, or downloaded
        if not os.path.isfile(spec):
            raise CheckpointError(f"{spec}: no such GGUF file")
        model, tokenizer = gguf_file.load_gguf(spec, lambda keys: GPT(GPTConfig(**keys)))
        return model, tokenizer if with_tokenizer else None, None
    is_run = os.path.exists(os.path.join(spec, CHECKPOINT))
    if not is_run and (spec in GPT2_HUB_NAMES or os.path.exists(os.path.join(spec, "config.json"))):
        model = GPT.from_pretrained(spec)
        return model, pretrained_tokenizer(spec, model) if with_tokenizer else None, None
    model, state = load_model(spec)
    return model, tokenizer_from_meta(state["tokenizer"]) if with_tokenizer else None, state


@dataclass
class ContextKeys:
    """Keys of eval.py and sample.py: run the model at another context than the one it was trained at."""

    CHOICES = {"rope_scaling": ("", "none", "linear", "yarn")}

    block_size: int = 0  # context in tokens; past the trained one for rope, alibi, t5, none, sinusoidal (not learned); 0 = the model's
    rope_scaling: str = ""  # none | linear | yarn: RoPE's scaling for this run; "" = the model's
    rope_factor: Optional[float] = None  # rope_scaling's factor; None = the model's


def load_for(c):
    """load_any for sample.py's and eval.py's configs: init_from (resume means out_dir's run), then the
    model set to the context c's ContextKeys ask for (a ConfigError where it cannot run so)."""
    model, tokenizer, state = load_any(c.out_dir if c.init_from == "resume" else c.init_from)
    if c.block_size or c.rope_scaling or c.rope_factor is not None:
        checked(model.set_context, c.block_size or None, c.rope_scaling or None, c.rope_factor)
    return model, tokenizer, state


def tokens_per_step(c):
    """Tokens one optimizer step trains on, over all processes: from a training config (or a saved one)."""
    return c.batch_size * c.block_size * c.gradient_accumulation_steps


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl, in order (evaluations have val_loss, steps have loss)."""
    path = os.path.join(out_dir, METRICS)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class RunLock:
    """Keeps two runs from writing the same out_dir. An OS file lock (flock) on out_dir/lock: the kernel
    releases it when its process dies however it dies, so the lock a killed run leaves behind is stale
    by construction and the next run takes it over; the file only says who holds it."""

    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, "lock")
        self.fd = None

    def acquire(self):
        self.took_over = None  # what a run that died without releasing the lock had written
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks; run without one
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            return self
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointError(f"cannot write to out_dir {os.path.dirname(self.path)}: {e.strerror}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace")
            os.close(self.fd)
            self.fd = None
            raise CheckpointError(f"{os.path.dirname(self.path)} is in use by another run ({holder or 'unknown'}); "
                                  "wait for it to finish or use another out_dir") from None
        stale = os.pread(self.fd, 4096, 0).decode(errors="replace")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self.took_over = stale or None
        # temporary files of checkpoint writes that a killed run left half-done
        for tmp in glob.glob(os.path.join(os.path.dirname(self.path), "*.tmp.*")):
            os.remove(tmp)
        return self

    def release(self):
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing releases the flock
            self.fd = None


# ----------------------------------------------------------------------------------------------------
# Logging


class Logger:
    """Plain lines (or a tqdm bar on a terminal), metrics.jsonl with every value, wandb when asked.

    Only rank 0 logs."""

    def __init__(self, c, out_dir, start_iter, metrics_bytes, active):
        self.active = active
        self.bar = self.wandb = self.file = None
        if not active:
            return
        if c.wandb_log:  # first: a wandb that cannot start must not cost the run its metrics file
            import wandb

            try:
                self.wandb = wandb.init(project=c.wandb_project, name=c.wandb_run_name, config=asdict(c),
                                        resume="allow")
            except Exception as e:  # not logged in, no network, a bad project: wandb's own exception types
                reason = (str(e).strip().splitlines() or [""])[0]
                raise ConfigError(f"wandb_log=True but wandb could not start ({type(e).__name__}: {reason}); run "
                                  "`wandb login`, or set WANDB_MODE=offline to log locally (wandb sync later)") from None
        path = os.path.join(out_dir, METRICS)
        if metrics_bytes is not None and os.path.exists(path):
            with open(path, "r+b") as f:  # drop what the interrupted run logged after its checkpoint
                f.truncate(metrics_bytes)
        elif metrics_bytes is None and os.path.exists(path):
            os.remove(path)
        self.file = open(path, "a", buffering=1)  # line-buffered: `tail -f metrics.jsonl` follows the run
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=c.max_iters, initial=start_iter, dynamic_ncols=True)

    def print(self, text):
        if self.active:
            (self.bar.write if self.bar else print)(text, flush=True)

    def log(self, record, line):
        if not self.active:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.bar:
            self.bar.set_postfix_str(line, refresh=False)
        else:
            print(line, flush=True)
        if self.wandb:
            self.wandb.log({k: v for k, v in record.items() if k != "iter"}, step=record["iter"])

    def tick(self):
        """One step done: the progress bar moves."""
        if self.bar:
            self.bar.update(1)

    def durable_size(self):
        """Flushes metrics.jsonl to disk and returns its size, which the checkpoint records."""
        if not self.active:
            return None
        self.file.flush()
        os.fsync(self.file.fileno())
        return self.file.tell()

    def close(self):
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


# ----------------------------------------------------------------------------------------------------
# Stopping a run: signals, and the second Ctrl-C's way out (train.py and rl.py)


class StopRequest:
    """SIGINT/SIGTERM/SIGUSR1: the first stops the loop after this step, the second aborts at once.

    SIGUSR1 is SLURM's warning before a job's time runs out (sbatch --signal=USR1@120). Installed
    while the loop runs; the old handlers come back on close()."""

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1") if hasattr(signal, name))

    def __init__(self, logger, exit_out_dir=None):
        """Installs the handlers.

        exit_out_dir: set by train.py's and rl.py's own command lines. After a stop request, a second signal even
        during the exit (logs closing, threads joined, atexit callbacks, where Python can only print
        "Exception ignored in ...") then ends the process with the documented line; None (a run inside
        another program): the old handlers come back on close()."""
        self.logger, self.exit_out_dir, self.signum = logger, exit_out_dir, None
        self.previous = {s: signal.signal(s, self.on_signal) for s in self.SIGNALS}

    def on_signal(self, signum, frame):
        if self.signum is not None:  # a second Ctrl-C: the user wants out now
            raise KeyboardInterrupt
        self.signum = signum
        self.logger.print(f"{signal.Signals(signum).name}: stopping after this step or evaluation batch (again to abort at once)")

    def close(self):
        if self.signum is not None and self.exit_out_dir is not None:
            for s in self.SIGNALS:
                signal.signal(s, lambda signum, frame: exit_now(self.exit_out_dir))
            return
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def exit_now(out_dir):
    """The second Ctrl-C's way out: the documented line, and no interpreter teardown to interrupt."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError, RuntimeError):  # a closed pipe, or a write this signal interrupted
        pass
    print(interrupted_again(out_dir), file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGINT)


def interrupted_again(out_dir):
    return (f"error: interrupted again; stopped at once: {os.path.join(out_dir, CHECKPOINT)} holds the last saved "
            "state (continue with --init_from=resume)")
