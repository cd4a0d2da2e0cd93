"""
Trains a GPT.

  python train.py [config_file ...] [--key=value ...]       one process (CPU, one GPU, Apple GPU)
  torchrun --standalone --nproc_per_node=8 train.py ...      DDP, or FSDP2 with --fsdp=True
  python train.py --help                                     every key, its default and type

Config files are Python files that assign keys; --key=value overrides them. Every GPTConfig field is a
key too. Unknown keys and wrong types exit with status 2 before anything runs.
"""

import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

import model as model_module
from checkpoint import CHECKPOINT, METRICS, CheckpointError, RunLock, load_checkpoint, save_checkpoint
from configurator import ConfigError, fail, keys_of, parse_or_exit
from dataset import BatchSampler, DataError, open_split, read_meta
from device import autocast as autocast_for
from device import pick_device, pick_dtype, precision
from model import GPT, GPTConfig, lm_loss, recording_max_attention_logit

ROOT = os.path.dirname(os.path.abspath(__file__))


@dataclass
class TrainConfig:
    # input and output
    out_dir: str = "out"  # ckpt.pt and metrics.jsonl go here
    init_from: str = "scratch"  # scratch | resume | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face model directory
    overwrite: bool = False  # init_from=scratch into an out_dir that holds a checkpoint: False refuses, True starts over
    dataset: str = "shakespeare_char"  # a prepared dataset: a name under data/, or a directory
    # schedule, evaluation, checkpoints
    max_iters: int = 5000  # optimizer steps in the whole run
    eval_interval: int = 250  # evaluate (and checkpoint) every this many steps, and at the end
    eval_iters: int = 200  # batches per split per evaluation
    log_interval: int = 10  # steps between log lines
    always_save_checkpoint: bool = True  # False: write ckpt.pt only when val loss improves (keeps the best)
    log_stability: bool = False  # each evaluation also logs the largest attention logit and the mean log Z of the output
    # batches
    batch_size: int = 12  # sequences per micro-step, per process
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step, over all processes together
    # optimizer and its schedule
    optimizer: str = "adamw"  # adamw | muon (Muon for the blocks' matrices, AdamW for embeddings, head, norms, biases)
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    learning_rate: float = 6e-4  # peak learning rate, reached after warmup (Muon's is scaled to match AdamW's update size)
    min_lr: float = 6e-5  # the cosine decays to this
    warmup_iters: int = 100  # linear warmup steps (step 0 already has a non-zero rate)
    lr_decay_iters: Optional[int] = None  # step where the cosine reaches min_lr; None = max_iters
    weight_decay: float = 0.1  # on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping (the norm is still logged)
    # system
    device: str = "auto"  # auto: cuda, else mps, else cpu; under torchrun each process takes cuda:LOCAL_RANK
    dtype: str = "auto"  # auto: bf16 where it runs faster than fp32 (CUDA with bf16, AMX CPUs; see device.py), fp16 on older CUDA, else float32
    compile: bool = False  # torch.compile the model (about 30 s of compiling on a 2-core CPU)
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP
    seed: int = 1337
    skip_nonfinite: bool = False  # a non-finite loss or gradient norm: False stops the run, True skips that step
    # logging
    wandb_log: bool = False  # also log to Weights & Biases (honours WANDB_MODE=offline)
    wandb_project: str = "smallgpt"
    wandb_run_name: str = "run"


CHOICES = {"device": ("auto", "cpu", "cuda", "mps"), "dtype": ("auto", "float32", "bfloat16", "float16"),
           "optimizer": ("adamw", "muon"),
           **model_module.CHOICES}  # fmt: skip
TRAIN_KEYS = [f.name for f in fields(TrainConfig)]
MODEL_KEYS = [f.name for f in fields(GPTConfig)]
VOCAB_HELP = "vocabulary size; default: the dataset's (pad it, e.g. to 50304, for faster GPU matmuls)"


def config_keys():
    return keys_of(TrainConfig, CHOICES) + keys_of(GPTConfig, CHOICES, helps={"vocab_size": VOCAB_HELP})


def check_config(c):
    """Values that parse but cannot work; each a ConfigError naming the key."""
    positive = ["max_iters", "eval_interval", "eval_iters", "log_interval", "batch_size", "gradient_accumulation_steps"]
    for key in positive:
        if c[key] < 1:
            raise ConfigError(f"{key}={c[key]} must be >= 1")
    if c["learning_rate"] <= 0:
        raise ConfigError(f"learning_rate={c['learning_rate']} must be > 0")
    if not 0 <= c["min_lr"] <= c["learning_rate"]:
        raise ConfigError(f"min_lr={c['min_lr']} must be in [0, learning_rate={c['learning_rate']}]")
    if not 0 <= c["warmup_iters"] <= c["max_iters"]:
        raise ConfigError(f"warmup_iters={c['warmup_iters']} must be in [0, max_iters={c['max_iters']}]: "
                          "a warmup longer than the run never reaches the learning rate")
    decay = c["lr_decay_iters"]
    if decay is not None and decay < c["warmup_iters"]:
        raise ConfigError(f"lr_decay_iters={decay} must be >= warmup_iters={c['warmup_iters']}")
    if c["grad_clip"] < 0 or c["weight_decay"] < 0:
        raise ConfigError("grad_clip and weight_decay must be >= 0")
    if not (0 <= c["beta1"] < 1 and 0 <= c["beta2"] < 1):
        raise ConfigError(f"beta1={c['beta1']} and beta2={c['beta2']} must be in [0, 1)")


def get_lr(it, c):
    """Linear warmup from lr/(warmup+1) (never 0: step 0 must learn too), then a cosine down to min_lr
    at lr_decay_iters, then min_lr."""
    decay_iters = c["lr_decay_iters"] if c["lr_decay_iters"] is not None else c["max_iters"]
    if it < c["warmup_iters"]:
        return c["learning_rate"] * (it + 1) / (c["warmup_iters"] + 1)
    if it >= decay_iters:
        return c["min_lr"]
    progress = (it - c["warmup_iters"]) / max(1, decay_iters - c["warmup_iters"])
    return c["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c["learning_rate"] - c["min_lr"])


def resolve_dataset(name):
    for candidate in (os.path.join(ROOT, "data", name), name):
        if os.path.isdir(candidate):
            return candidate
    raise DataError(f"dataset {name!r} not found (looked for data/{name} and {name}); prepare it first, "
                    "e.g. python data/shakespeare_char/prepare.py")


def clip_gradients(parameters, max_norm):
    """Scales the gradients so their global norm is at most max_norm (0 = leave them) and returns the norm
    before clipping, which is what gets logged."""
    parameters = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor


class NonFinite(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------------
# Distributed


class Dist:
    """Rank, world size and the collectives this script needs; a no-op world of one without torchrun."""

    def __init__(self, device_type):
        self.enabled = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        if self.enabled:
            dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        self.master = self.rank == 0

    def mean(self, tensor):
        if self.enabled:
            tensor = tensor.clone()
            dist.all_reduce(tensor)
            tensor /= self.world
        return tensor

    def any(self, flag, device):
        if not self.enabled:
            return flag
        t = torch.tensor([int(flag)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, obj):
        if not self.enabled:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def close(self):
        if self.enabled:
            dist.destroy_process_group()


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
        path = os.path.join(out_dir, METRICS)
        if metrics_bytes is not None and os.path.exists(path):
            with open(path, "r+b") as f:  # drop what the interrupted run logged after its checkpoint
                f.truncate(metrics_bytes)
        elif metrics_bytes is None and os.path.exists(path):
            os.remove(path)
        self.file = open(path, "a", buffering=1)  # line-buffered: `tail -f metrics.jsonl` follows the run
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=c["max_iters"], initial=start_iter, dynamic_ncols=True)
        if c["wandb_log"]:
            import wandb

            self.wandb = wandb.init(project=c["wandb_project"], name=c["wandb_run_name"], config=c,
                                    resume="allow")

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

    def step(self):
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


def build_model(c, explicit, data_meta, ckpt, out_dir):
    """The model for init_from, checked against the dataset's tokenizer."""
    tokenizer = data_meta["tokenizer"]
    if ckpt is not None:
        changed = [k for k in explicit if k in MODEL_KEYS and k != "dropout" and c[k] != ckpt["model_config"][k]]
        if changed:
            saved = ckpt["model_config"]
            raise ConfigError("init_from=resume: " + ", ".join(f"{k}={c[k]!r}" for k in changed) + " differs from "
                              "the checkpoint (" + ", ".join(f"{k}={saved[k]!r}" for k in changed) + "); a resumed "
                              "run keeps its architecture")
        if ckpt["tokenizer"] != tokenizer:
            raise DataError(f"dataset {c['dataset']!r} uses tokenizer {tokenizer}, but {out_dir}/{CHECKPOINT} was "
                            f"trained with {ckpt['tokenizer']}; resume with the dataset it was trained on")
        config = GPTConfig(**{**ckpt["model_config"], "dropout": c["dropout"]})
        model = GPT(config)
        return model
    if c["init_from"] == "scratch":
        model_values = {k: c[k] for k in MODEL_KEYS}
        if "vocab_size" not in explicit:
            model_values["vocab_size"] = data_meta["vocab_size"]
        try:
            return GPT(GPTConfig(**model_values))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    overridden = [k for k in explicit if k in MODEL_KEYS and k != "dropout"]
    if overridden:
        raise ConfigError(f"init_from={c['init_from']}: the pretrained model fixes {', '.join(overridden)}; "
                          "drop those keys (only dropout can change)")
    model = GPT.from_pretrained(c["init_from"], dropout=c["dropout"])
    is_gpt2 = isinstance(model.positions, model_module.LearnedPositions)
    if is_gpt2 and tokenizer != {"kind": "tiktoken", "encoding": "gpt2"}:
        raise DataError(f"GPT-2 weights need a dataset tokenized with tiktoken gpt2; {c['dataset']!r} uses {tokenizer}")
    return model


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    values, explicit = parse_or_exit(config_keys(), argv, "python train.py [config_file ...] [--key=value ...]",
                                     __doc__.strip().splitlines()[0])
    try:
        result = train(values, explicit)
    except (ConfigError, DataError, CheckpointError) as e:
        fail(e)
    except (NonFinite, OSError) as e:  # not bad input: a diverged run, a full disk
        print(f"error: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
        sys.exit(1)
    if result["signal"] is not None:
        sys.exit(128 + result["signal"])  # the shell's convention for "ended by this signal"
    return result


def train(c, explicit):
    started = time.perf_counter()

    def elapsed():
        return elapsed_before + time.perf_counter() - started

    out_dir = c["out_dir"]
    ckpt_path = os.path.join(out_dir, CHECKPOINT)
    ckpt = None
    if c["init_from"] == "resume":
        ckpt = load_checkpoint(ckpt_path)
        c = {**ckpt["train_config"], **{k: c[k] for k in explicit}, "init_from": "resume"}
    elif os.path.exists(ckpt_path) and not c["overwrite"]:
        raise ConfigError(f"{ckpt_path} exists: continue it with --init_from=resume, or start over with "
                          "--overwrite=True (or another --out_dir)")
    check_config(c)

    device_type = pick_device(c["device"])
    world = Dist(device_type)
    device = f"cuda:{world.local_rank}" if device_type == "cuda" else device_type
    if device_type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dtype = pick_dtype(c["dtype"], device_type)
    if c["gradient_accumulation_steps"] % world.world:
        raise ConfigError(f"gradient_accumulation_steps={c['gradient_accumulation_steps']} must be divisible by "
                          f"the number of processes ({world.world})")
    if c["eval_iters"] % world.world:
        raise ConfigError(f"eval_iters={c['eval_iters']} must be divisible by the number of processes ({world.world})")
    if c["fsdp"] and not world.enabled:
        raise ConfigError("fsdp=True needs torchrun (several processes); without it, leave fsdp=False")
    if c["fsdp"] and c["optimizer"] == "muon":
        raise ConfigError("optimizer=muon does not support sharded (FSDP2) parameters; use DDP (fsdp=False)")
    micro_steps = c["gradient_accumulation_steps"] // world.world
    torch.manual_seed(c["seed"])  # the same initial weights in every process (FSDP2 does not broadcast them)

    data_dir = resolve_dataset(c["dataset"])
    data_meta = read_meta(data_dir)
    model = build_model(c, explicit, data_meta, ckpt, out_dir)
    config = model.config
    if data_meta["vocab_size"] > config.vocab_size:
        raise DataError(f"dataset {c['dataset']!r} has a vocabulary of {data_meta['vocab_size']}, more than the "
                        f"model's vocab_size={config.vocab_size}")
    c = {**c, **asdict(config)}  # what actually runs, recorded in the checkpoint
    torch.manual_seed(c["seed"] + world.rank)  # then a dropout stream of its own per process
    splits = {s: open_split(data_dir, s, data_meta["vocab_size"]) for s in ("train", "val")}
    train_batches = BatchSampler(splits["train"], config.block_size, seed=c["seed"])
    eval_batches = {s: BatchSampler(files, config.block_size, seed=0) for s, files in splits.items()}

    # Full weights load before sharding; FSDP2 then shards them in place, and the optimizer must see
    # the sharded parameters.
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    model.to(device)
    if c["fsdp"]:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    betas = (c["beta1"], c["beta2"])
    if c["optimizer"] == "muon":
        optimizers = model.configure_muon(c["weight_decay"], c["learning_rate"], betas, device_type, c["muon_momentum"],
                                          precision(device_type).newton_schulz)
    else:
        optimizers = [model.configure_optimizers(c["weight_decay"], c["learning_rate"], betas, device_type)]
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict

    full_state = StateDictOptions(full_state_dict=True, cpu_offload=True)
    start_iter, best_val, evaluated_at, metrics_bytes = 0, float("inf"), -1, None
    elapsed_before = 0.0  # wall seconds of the run before this process (resumes add up)
    ckpt_rng_processes = None
    if ckpt is not None:
        set_optimizer_state_dict(model, optimizers, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
        if ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        train_batches.load_state_dict(ckpt["sampler"])
        rng = ckpt["rng"]
        ckpt_rng_processes = len(rng["cpu"])
        if ckpt_rng_processes == world.world:
            torch.set_rng_state(rng["cpu"][world.rank])
            if device_type == "cuda" and rng["cuda"][world.rank] is not None:
                torch.cuda.set_rng_state(rng["cuda"][world.rank])
        start_iter, best_val, evaluated_at = ckpt["iter_num"], ckpt["best_val_loss"], ckpt["evaluated_at"]
        metrics_bytes, elapsed_before = ckpt["metrics_bytes"], ckpt["elapsed"]
        del ckpt

    raw_model = model
    if c["compile"]:
        model = torch.compile(model)
    if world.enabled and not c["fsdp"]:
        from torch.nn.parallel import DistributedDataParallel

        # buffers (RoPE tables, ALiBi slopes) are constants: no need to sync them every forward
        model = DistributedDataParallel(model, device_ids=[world.local_rank] if device_type == "cuda" else None,
                                        forward_sync_buffers=False)
    autocast = autocast_for(device_type, dtype)
    pin = device_type == "cuda"

    def to_device(t):
        return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)

    def grad_sync(enabled):
        """Gradients are all-reduced only on the last micro-step of an accumulation."""
        if c["fsdp"]:
            model.set_requires_gradient_sync(enabled)
        elif world.enabled and not enabled:
            return model.no_sync()
        return nullcontext()

    @torch.no_grad()
    def evaluate():
        """Mean cross-entropy (no z-loss) over eval_iters batches per split. The batches come from a
        generator seeded the same way at every evaluation: evaluations compare like with like, and
        none of them moves the training RNG, so resuming stays exact."""
        model.eval()
        result = {}
        for i, (split, sampler) in enumerate(eval_batches.items()):
            sampler.generator.manual_seed(c["seed"] + 1 + i)
            total = torch.zeros((), device=device)
            for k in range(c["eval_iters"]):
                x, y = sampler.sample(c["batch_size"])
                if k % world.world != world.rank:
                    continue
                with autocast:
                    logits, _ = model(to_device(x))
                total += lm_loss(logits, to_device(y))[1].float()
            result[split] = (world.mean(total) * world.world / c["eval_iters"]).item()
        if c["log_stability"]:  # on one val batch: the instabilities' two symptoms
            x, _ = eval_batches["val"].sample(c["batch_size"])
            with recording_max_attention_logit(raw_model) as logits_max, autocast:
                logits, _ = raw_model(to_device(x))
            result["max_attn_logit"] = world.mean(torch.stack(logits_max).max()).item()
            result["mean_log_z"] = world.mean(torch.logsumexp(logits.float(), dim=-1).mean()).item()
        model.train()
        return result

    def checkpoint(iter_num):
        model_state, optim_state = get_state_dict(raw_model, optimizers, options=full_state)
        rng = world.gather((torch.get_rng_state(), torch.cuda.get_rng_state() if device_type == "cuda" else None))
        if not world.master:
            return
        state = {
            "format": 1, "model": model_state, "optimizer": optim_state,
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "model_config": asdict(config), "train_config": {k: c[k] for k in TRAIN_KEYS + MODEL_KEYS},
            "tokenizer": data_meta["tokenizer"], "iter_num": iter_num, "best_val_loss": best_val,
            "evaluated_at": evaluated_at, "sampler": train_batches.state_dict(),
            "rng": {"cpu": [r[0] for r in rng], "cuda": [r[1] for r in rng]},
            "metrics_bytes": logger.durable_size(), "elapsed": elapsed(),
        }  # fmt: skip
        save_checkpoint(ckpt_path, state)

    # one run per out_dir; taken only now, so input that fails the checks above leaves nothing behind
    lock = RunLock(out_dir).acquire() if world.master else None
    logger = Logger(c, out_dir, start_iter, metrics_bytes, world.master)
    fast = precision(device_type)
    muon_dtype = f", Muon's Newton-Schulz in {str(fast.newton_schulz).removeprefix('torch.')}" if c["optimizer"] == "muon" else ""
    logger.print(f"precision: {dtype} ({'chosen' if c['dtype'] == 'auto' else 'as set'}){muon_dtype} | {fast.why}")
    if ckpt_rng_processes and ckpt_rng_processes != world.world:
        logger.print(f"note: the checkpoint comes from {ckpt_rng_processes} process(es), this run has {world.world}: "
                     "batches continue exactly, dropout's random streams start afresh")
    if lock is not None and lock.took_over:
        logger.print(f"took over the lock of a run that ended without releasing it: {lock.took_over}")
    tokens_per_iter = c["gradient_accumulation_steps"] * c["batch_size"] * config.block_size
    logger.print(f"{raw_model.get_num_params():,} parameters | {device} {dtype} | {world.world} process(es) | "
                 f"{tokens_per_iter:,} tokens per step | steps {start_iter} -> {c['max_iters']}")

    stop_signal = []

    def on_signal(signum, frame):
        if stop_signal:  # a second Ctrl-C: the user wants out now
            raise KeyboardInterrupt
        stop_signal.append(signum)
        logger.print(f"{signal.Signals(signum).name}: stopping after this iteration (again to abort at once)")

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    first_bad = torch.full((), -1, dtype=torch.long, device=device)  # first non-finite step, kept on the device

    def check_finite():
        bad = int(first_bad.item())
        if bad >= 0:
            raise NonFinite(f"non-finite loss or gradient norm at iteration {bad}; stopped without saving, so "
                            f"{ckpt_path} still holds the last good state (lower learning_rate, or "
                            "skip_nonfinite=True to skip such steps)")

    try:
        raw_model.train()
        iter_num = start_iter
        last_log_time, last_log_iter = time.perf_counter(), start_iter
        while True:
            if (iter_num % c["eval_interval"] == 0 or iter_num == c["max_iters"]) and evaluated_at != iter_num:
                check_finite()
                losses = evaluate()
                evaluated_at = iter_num
                improved = losses["val"] < best_val
                best_val = min(best_val, losses["val"])
                logger.log({"iter": iter_num, **{f"{k}_loss" if k in ("train", "val") else k: v
                                                  for k, v in losses.items()}, "elapsed": elapsed()},
                           f"eval {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                           + (" (best)" if improved else ""))
                if iter_num > start_iter and (improved or c["always_save_checkpoint"]):
                    checkpoint(iter_num)
                last_log_time, last_log_iter = time.perf_counter(), iter_num  # evaluation is not throughput
            if iter_num >= c["max_iters"]:
                break

            lr = get_lr(iter_num, c)
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            x_all, y_all = train_batches.sample(c["gradient_accumulation_steps"] * c["batch_size"])
            loss_sum = torch.zeros((), device=device)
            ce_sum = torch.zeros((), device=device)
            for micro in range(micro_steps):
                rows = slice((world.rank * micro_steps + micro) * c["batch_size"],
                             (world.rank * micro_steps + micro + 1) * c["batch_size"])  # fmt: skip
                x, y = to_device(x_all[rows]), to_device(y_all[rows])
                with grad_sync(micro == micro_steps - 1):
                    with autocast:
                        logits, _ = model(x)
                    loss, ce = lm_loss(logits, y, config.z_loss)
                    scaler.scale(loss / micro_steps).backward()
                loss_sum += loss.detach()
                ce_sum += ce.detach()
            for optimizer in optimizers:
                scaler.unscale_(optimizer)
            grad_norm = clip_gradients(raw_model.parameters(), c["grad_clip"])
            # with fp16 an infinite gradient is the GradScaler's business: it skips the step and rescales
            bad = ~torch.isfinite(loss_sum) if scaler.is_enabled() else ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))
            skipped = False
            if c["skip_nonfinite"]:
                skipped = bool(bad.item())  # deciding needs the value now: one host sync per step
            else:
                first_bad = torch.where(bad & (first_bad < 0), iter_num, first_bad)
            if skipped:
                logger.print(f"iteration {iter_num}: non-finite loss or gradient norm, step skipped")
            else:
                for optimizer in optimizers:
                    scaler.step(optimizer)
            scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            logger.step()

            if iter_num % c["log_interval"] == 0 or iter_num == c["max_iters"] - 1:
                loss_val = world.mean(loss_sum / micro_steps).item()  # the only host sync of a step
                ce_val = world.mean(ce_sum / micro_steps).item()
                check_finite()
                now = time.perf_counter()
                steps = iter_num + 1 - last_log_iter
                tokens_per_sec = steps * tokens_per_iter / max(now - last_log_time, 1e-9)
                mfu = raw_model.estimate_mfu(tokens_per_sec / world.world, config.block_size, device)
                record = {"iter": iter_num, "loss": loss_val, "ce": ce_val, "lr": lr, "grad_norm": grad_norm.item(),
                          "tokens_per_sec": tokens_per_sec, "ms_per_iter": 1000 * (now - last_log_time) / steps,
                          "elapsed": elapsed()}
                if config.z_loss > 0:
                    record["z_loss_term"] = loss_val - ce_val
                if mfu is not None:
                    record["mfu"] = mfu
                if skipped:
                    record["skipped"] = True
                logger.log(record, f"iter {iter_num}: loss {loss_val:.4f}" + (f" (ce {ce_val:.4f})" if config.z_loss else "")
                           + f", lr {lr:.2e}, grad norm {record['grad_norm']:.3f}, {tokens_per_sec:,.0f} tok/s"
                           + (f", mfu {100 * mfu:.1f}%" if mfu is not None else ""))
                last_log_time, last_log_iter = now, iter_num + 1
            iter_num += 1

            # every process must stop after the same step: agree on it (one small all-reduce per step
            # under torchrun; nothing in a single process)
            if world.any(bool(stop_signal), device):
                check_finite()
                signum = stop_signal[0] if stop_signal else signal.SIGTERM
                if c["always_save_checkpoint"]:
                    checkpoint(iter_num)
                    logger.print(f"saved {ckpt_path} at iteration {iter_num}; continue with --init_from=resume")
                else:
                    logger.print(f"always_save_checkpoint=False: {ckpt_path} keeps the best state, not this one")
                return {"iter": iter_num, "signal": int(signum), "best_val_loss": best_val}
        return {"iter": iter_num, "signal": None, "best_val_loss": best_val}
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        logger.close()
        world.close()
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main()
