"""
Trains a GPT.

  python train.py [config_file ...] [--key=value ...]       one process (CPU, one GPU, Apple GPU)
  torchrun --standalone --nproc_per_node=8 train.py ...      DDP, or FSDP2 with --fsdp=True
  python train.py --help                                     every key, its default and type

Config files are Python files that assign keys; --key=value overrides them. Every GPTConfig field is a
key too. Unknown keys and wrong types exit with status 2 before anything runs.
"""

import inspect
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

import torch

from checkpoint import (CHECKPOINT, ContextKeys, Logger, RunLock, RunState, StopRequest, exit_now, load_any, load_checkpoint,
                        load_model, lora_model, tokens_per_step, with_dropout, with_head)
from configurator import ConfigError, DataError, checked, cli_main, keys_of, parse_config
from dataset import BatchSampler, ConversationSampler, is_masked_dataset, open_split, read_meta, resolve_dataset
from device import COMPUTE_DTYPES, DEVICES, Dist, estimate_mfu, pick_device, pick_dtype, precision
from device import autocast as autocast_for
from hf import uses_gpt2_tokenizer
from labeled import ImageSampler, LabeledSampler, MaskedTokens, check_images, check_labeled, is_image_dataset, labeled_kind
import lora
from model import MODEL_CHOICES, MODEL_KEYS, GPT, GPTConfig, ModelKeys, lm_loss, model_config, model_helps
from optim import OPTIMIZERS, build_optimizers, clip_gradients, get_lr
from probes import best, head_scores, recording
from tokenizer import CHAT_TOKENS, EncoderTokenizer, describe_meta, describe_tokenizer, same_vocabulary, tokenizer_from_meta

@dataclass
class TrainConfig(ModelKeys):  # and every model key (model.ModelKeys)
    # input and output
    out_dir: str = "out"  # ckpt.pt and metrics.jsonl go here
    init_from: str = "scratch"  # scratch | resume | auto (resume if out_dir has a checkpoint, else scratch) | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face model directory
    overwrite: bool = False  # init_from=scratch into an out_dir that holds a checkpoint: False refuses, True starts over
    dataset: str = "shakespeare_char"  # a prepared dataset: a name under data/, or a directory
    # fine-tuning with LoRA (init_from: a run's out_dir; docs/guide.md: Chat)
    lora_rank: int = 0  # LoRA adapters of this rank on lora_targets, every other weight frozen; 0 = train every weight
    lora_alpha: float = 16.0  # the adapters' update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapters' input
    lora_targets: str = lora.DEFAULT_TARGETS  # the blocks' matrices that get adapters: a comma list of qkv, attn_proj, mlp_fc, mlp_proj, or all
    # schedule, evaluation, checkpoints
    max_iters: int = 5000  # optimizer steps in the whole run
    eval_interval: int = 250  # evaluate (and checkpoint) every this many steps, and at the end
    eval_iters: int = 200  # batches per split per evaluation
    log_interval: int = 10  # steps between log lines
    always_save_checkpoint: bool = True  # False: write ckpt.pt only when val loss improves (keeps the best)
    log_stability: bool = False  # each evaluation also logs the largest attention logit and the mean log Z of the output
    log_heads: bool = False  # each evaluation also logs the best induction score and the in-context learning score (interpret.py --scores)
    # batches
    batch_size: int = 12  # sequences per micro-step, per process
    gradient_accumulation_steps: int = 1  # micro-steps per optimizer step, over all processes together
    image_shift: int = 0  # images (a vision transformer): shift each drawn training image by up to this many pixels; 0 = off
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
    compile: bool = False  # torch.compile the model and Muon's Newton-Schulz (about 30 s of compiling on a 2-core CPU)
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of DDP
    dist_timeout: int = 600  # under torchrun: seconds a collective waits for a silent peer (a lost node resets no connection) before the job ends
    seed: int = 1337
    skip_nonfinite: bool = False  # a non-finite loss or gradient norm: False stops the run, True skips that step
    # logging
    wandb_log: bool = False  # also log to Weights & Biases (honours WANDB_MODE=offline)
    wandb_project: str = "smallgpt"
    wandb_run_name: str = "run"


TRAIN_CHOICES = {"device": DEVICES, "dtype": COMPUTE_DTYPES, "optimizer": tuple(OPTIMIZERS), **MODEL_CHOICES}
TRAIN_KEYS = [f.name for f in fields(TrainConfig)]  # the model's too
VOCAB_HELP = "vocabulary size; default: the dataset's (pad it, e.g. to 50304, for faster GPU matmuls)"


def config_keys():
    return keys_of(TrainConfig, TRAIN_CHOICES, helps={**model_helps(), "vocab_size": VOCAB_HELP}, base=ModelKeys,
                   shown={"vocab_size": "dataset's"})


def check_config(c):
    """Values that parse but cannot work; each a ConfigError naming the key."""
    if c.image_shift < 0:
        raise ConfigError(f"image_shift={c.image_shift} must be >= 0 (0: no augmentation)")
    positive = ["max_iters", "eval_interval", "eval_iters", "log_interval", "batch_size", "gradient_accumulation_steps",
                "dist_timeout"]
    for key in positive:
        if getattr(c, key) < 1:
            raise ConfigError(f"{key}={getattr(c, key)} must be >= 1")
    if c.learning_rate <= 0:
        raise ConfigError(f"learning_rate={c.learning_rate} must be > 0")
    if not 0 <= c.min_lr <= c.learning_rate:
        raise ConfigError(f"min_lr={c.min_lr} must be in [0, learning_rate={c.learning_rate}]")
    if not 0 <= c.warmup_iters <= c.max_iters:
        raise ConfigError(f"warmup_iters={c.warmup_iters} must be in [0, max_iters={c.max_iters}]: "
                          "a warmup longer than the run never reaches the learning rate")
    decay = c.lr_decay_iters
    if decay is not None and decay < c.warmup_iters:
        raise ConfigError(f"lr_decay_iters={decay} must be >= warmup_iters={c.warmup_iters}")
    if c.grad_clip < 0 or c.weight_decay < 0:
        raise ConfigError("grad_clip and weight_decay must be >= 0")
    if not (0 <= c.beta1 < 1 and 0 <= c.beta2 < 1):
        raise ConfigError(f"beta1={c.beta1} and beta2={c.beta2} must be in [0, 1)")
    if c.lora_rank < 0:
        raise ConfigError(f"lora_rank={c.lora_rank} must be >= 0 (0: no LoRA, every weight trains)")
    if c.lora_rank:
        checked(lora.parse_targets, c.lora_targets)
        if c.lora_alpha <= 0 or not 0 <= c.lora_dropout < 1:
            raise ConfigError(f"lora_alpha={c.lora_alpha} must be > 0 and lora_dropout={c.lora_dropout} in [0, 1)")
        if c.init_from == "scratch":
            raise ConfigError("lora_rank > 0 fine-tunes a trained model: give init_from=OUT_DIR of the base run")
        if c.optimizer != "adamw" or c.fsdp:
            raise ConfigError("lora_rank > 0 trains its adapters with AdamW under DDP or one process: set optimizer=adamw and fsdp=False")


# ----------------------------------------------------------------------------------------------------
# The recipe


def train(c, explicit, script=False, chosen=None):
    """Runs the training c describes (a TrainConfig; explicit: the keys the user set) in this process.

    script: called by train.py's command line, which ends the process after it (see StopRequest).
    chosen: the keys given on the command line itself (None: all of explicit; see fit_defaults)."""
    # the config that runs, the pieces, and where a resumed run stands
    state = RunState()
    settled, ckpt, notes = settle_config(c, explicit, chosen)
    run = Run(settled, explicit, ckpt)
    c, world = run.train_config, run.world
    if world.enabled:
        UNFREED_RUNS.append(run)
    ckpt_path = os.path.join(c.out_dir, CHECKPOINT)
    if ckpt is not None:
        state.restore(ckpt, run)
        del ckpt
    start_iter = state.iter_num
    run.wrap()

    # one run per out_dir; taken only now, so input that fails the checks above leaves nothing behind,
    # and released on every way out (the finally at the end)
    lock = RunLock(c.out_dir).acquire() if world.master else None
    logger = stop = None
    try:
        # the log's first lines: the precision chosen, notes, the run's size
        logger = Logger(c, c.out_dir, state.iter_num, state.metrics_bytes, world.master)
        logger.print(run.precision_line)
        for note in notes + run.notes:
            logger.print(note)
        if state.rng_processes and state.rng_processes != world.size:
            logger.print(f"note: the checkpoint comes from {state.rng_processes} process(es), this run has "
                         f"{world.size}: batches continue exactly, dropout's random streams start afresh")
        if lock is not None and lock.took_over:
            logger.print(f"took over the lock of a run that ended without releasing it: {lock.took_over}")
        if state.iter_num >= c.max_iters and state.evaluated_at == state.iter_num:
            logger.print(f"nothing to do: {ckpt_path} is at iteration {state.iter_num}, evaluated, and max_iters="
                         f"{c.max_iters}; a larger --max_iters trains on")
            return {"iter": state.iter_num, "signal": None, "best_val_loss": state.best_val}
        logger.print(f"{run.raw_model.get_num_params():,} parameters | {run.device} {run.dtype} | {world.size} "
                     f"process(es) | {tokens_per_step(c):,} tokens per step | steps {state.iter_num} -> {c.max_iters}")

        # the step loop
        stop = StopRequest(logger, c.out_dir if script else None)
        first_bad = torch.full((), -1, dtype=torch.long, device=run.device)  # first non-finite step, on the device
        run.raw_model.train()
        last_log_time, last_log_iter = time.perf_counter(), state.iter_num
        while True:
            stopping = False
            # evaluate (and checkpoint) every eval_interval steps and at the end
            it = state.iter_num
            if (it % c.eval_interval == 0 or it == c.max_iters) and state.evaluated_at != it:
                check_finite(first_bad, ckpt_path)
                losses = run.evaluate(stop)
                stopping = losses is None  # a stop request cut it short
                if not stopping:
                    state.evaluated_at = it
                    improved = losses["val"] < state.best_val
                    state.best_val = min(state.best_val, losses["val"])
                    logger.log({"iter": it, **{f"{k}_loss" if k in ("train", "val") else k: v for k, v in losses.items()},
                                "elapsed": state.elapsed()},
                               f"eval {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
                               + (f" ({losses['val_bpb']:.4f} bits per byte)" if "val_bpb" in losses else "")
                               + (f", val accuracy {losses['val_accuracy']:.4f}" if "val_accuracy" in losses else "")
                               + (f", induction {losses['induction_score']:.3f}, in-context {losses['icl_score']:+.3f}"
                                  if losses.get("induction_score") is not None else "")
                               + (" (best)" if improved else ""))
                    if it > start_iter and (improved or c.always_save_checkpoint):
                        state.save(run, ckpt_path, logger)
                last_log_time, last_log_iter = time.perf_counter(), it  # evaluation is not throughput
            if it >= c.max_iters and not stopping:
                break

            # one optimizer step, logged every log_interval steps
            if not stopping:
                lr = get_lr(it, c)
                result = run.train_step(it, lr, first_bad)
                first_bad = result.first_bad
                if result.skipped:
                    logger.print(f"iteration {it}: non-finite loss or gradient norm, step skipped")
                logger.tick()
                if it % c.log_interval == 0 or it == c.max_iters - 1:
                    now = time.perf_counter()
                    record, line = step_record(run, it, lr, result, now - last_log_time, it + 1 - last_log_iter,
                                               state.elapsed())
                    check_finite(first_bad, ckpt_path)
                    logger.log(record, line)
                    last_log_time, last_log_iter = now, it + 1
                state.iter_num = it + 1

            # every process must stop after the same step: agree on it, under torchrun at each log step
            # (an all-reduce and its host sync on every step would stall a GPU's queue; a stop request
            # then waits up to log_interval steps), in a single process at once, with no collective
            agree = not world.enabled or state.iter_num % c.log_interval == 0 or state.iter_num >= c.max_iters
            if stopping or (agree and world.any(stop.signum is not None, run.device)):
                check_finite(first_bad, ckpt_path)
                if c.always_save_checkpoint:
                    state.save(run, ckpt_path, logger)
                    logger.print(f"saved {ckpt_path} at iteration {state.iter_num}; continue with --init_from=resume "
                                 "(or auto)")
                else:
                    logger.print(f"always_save_checkpoint=False: {ckpt_path} keeps the best state, not this one")
                signum = stop.signum if stop.signum is not None else signal.SIGTERM
                return {"iter": state.iter_num, "signal": int(signum), "best_val_loss": state.best_val}
        return {"iter": state.iter_num, "signal": None, "best_val_loss": state.best_val}
    except BaseException:
        world.failed = True  # no closing barrier: a peer may be gone, and the error must reach command() as it is
        raise
    finally:
        for part in (stop, logger):
            if part is not None:
                part.close()
        world.close()
        if lock is not None:
            lock.release()


# ----------------------------------------------------------------------------------------------------
# The pieces of a run: its device, data, model and optimizers (Run), one step's log (step_record)


class Run:
    """One process's share of a training run, and what the step loop does to it.

    Its device and process group, data, model (wrapped for compile and DDP/FSDP2), optimizers and loss
    scaler, with what the step loop does to them: evaluate() and train_step(). Saving and restoring them
    is checkpoint.RunState's. train_config is the TrainConfig that runs (the model's keys as the model
    has them), model_config the model's GPTConfig."""

    def __init__(self, c, explicit, ckpt):
        self.open_processes(c)
        self.choose_precision(c, ckpt)
        self.check_layout(c)
        torch.manual_seed(c.seed)  # the same initial weights in every process (FSDP2 does not broadcast them)
        c = self.build_model(c, explicit, ckpt)
        torch.manual_seed(c.seed + self.world.rank)  # then a dropout stream of its own per process
        self.open_data(c)
        self.place_model(c)

    def open_processes(self, c):
        """The device and the process group (one process, or torchrun's)."""
        self.device_type = pick_device(c.device)
        self.world = Dist(self.device_type, c.dist_timeout)
        self.device = f"cuda:{self.world.local_rank}" if self.device_type == "cuda" else self.device_type
        if self.device_type == "cuda":
            torch.cuda.set_device(self.device)  # (pick_device allowed TF32)

    def choose_precision(self, c, ckpt):
        """The compute dtype and Muon's Newton-Schulz dtype, and the log line that says why."""
        # precision: as set, or measured at the run's start and kept by every resume (a measurement near
        # the threshold could otherwise flip it between starts, and the run would not continue bit for bit)
        kept = (ckpt or {}).get("precision")
        if kept and (kept.get("device_type", self.device_type) != self.device_type
                     or c.dtype != ckpt["train_config"]["dtype"]):  # another device, or another dtype asked for
            kept = None
        fast = precision(self.device_type)
        self.dtype = kept["dtype"] if kept else pick_dtype(c.dtype, self.device_type)
        self.newton_schulz = getattr(torch, kept["newton_schulz"]) if kept else fast.newton_schulz
        how = "kept from the checkpoint's start" if kept else "chosen" if c.dtype == "auto" else "as set"
        muon = f", Muon's Newton-Schulz in {str(self.newton_schulz).removeprefix('torch.')}" if c.optimizer == "muon" else ""
        self.precision_line = f"precision: {self.dtype} ({how}){muon} | {fast.why}"

    def check_layout(self, c):
        """ConfigError for what the process layout cannot run; the micro-steps each process takes."""
        world = self.world
        if c.gradient_accumulation_steps % world.size:
            raise ConfigError(f"gradient_accumulation_steps={c.gradient_accumulation_steps} must be divisible by "
                              f"the number of processes ({world.size})")
        if c.eval_iters % world.size:
            raise ConfigError(f"eval_iters={c.eval_iters} must be divisible by the number of processes ({world.size})")
        if c.fsdp and not world.enabled:
            raise ConfigError("fsdp=True needs torchrun (several processes); without it, leave fsdp=False")
        if c.fsdp and c.log_heads:
            raise ConfigError("log_heads=True reads whole weight matrices, which fsdp=True shards; use DDP (fsdp=False)")
        if c.fsdp and c.optimizer == "muon":
            raise ConfigError("optimizer=muon does not support sharded (FSDP2) parameters; use DDP (fsdp=False)")
        self.micro_steps = c.gradient_accumulation_steps // world.size

    def build_model(self, c, explicit, ckpt):
        """The model (a checkpoint's weights loaded, LoRA applied) on the CPU; returns the config that runs."""
        self.data_meta = read_meta(resolve_dataset(c.dataset))
        if c.head == "mlm" and self.data_meta["tokenizer"].get("kind") not in ("encoder", "images"):
            # BERT's objective on a text dataset: the run's tokenizer is its tokenizer plus [CLS] [SEP] [MASK] [PAD]
            tokenizer = EncoderTokenizer(tokenizer_from_meta(self.data_meta["tokenizer"]))
            self.data_meta = {**self.data_meta, "tokenizer": tokenizer.meta(), "vocab_size": tokenizer.vocab_size}
        self.notes = []
        model, self.lora = build_model(c, explicit, self.data_meta, ckpt, self.notes)
        self.model_config = config = model.config
        if config.family != "decoder" and (c.log_stability or c.log_heads or c.lora_rank):
            raise ConfigError(f"log_stability, log_heads and lora_rank are a decoder's (their probes and adapters read "
                              f"causal text); this model is family={config.family!r}")
        if self.data_meta["vocab_size"] > config.vocab_size:
            raise DataError(f"dataset {c.dataset!r} has a vocabulary of {self.data_meta['vocab_size']}, more than "
                            f"the model's vocab_size={config.vocab_size}")
        self.train_config = c = replace(c, **asdict(config))  # what actually runs, recorded in the checkpoint
        self.chat = is_masked_dataset(self.data_meta)  # conversations: trained where the mask says (ConversationSampler)
        self.raw_model = model
        return c

    def open_data(self, c):
        """The batch samplers (token files, or conversations with their loss mask) and bits per byte's table."""
        config, data_dir = self.model_config, resolve_dataset(c.dataset)
        self.token_bytes = None
        if is_image_dataset(self.data_meta) or config.image_size:  # a vision transformer's: images and classes
            check_images(self.data_meta["tokenizer"], config, f"dataset {c.dataset!r}")
            self.train_batches = ImageSampler(data_dir, "train", c.seed, c.image_shift)
            self.eval_batches = {s: ImageSampler(data_dir, s, 0) for s in ("train", "val")}
            return
        check_labeled(self.data_meta, config, f"dataset {c.dataset!r}")
        if labeled_kind(self.data_meta):  # texts with labels, or source/target pairs
            self.train_batches = LabeledSampler(data_dir, "train", c.seed, config.block_size)
            self.eval_batches = {s: LabeledSampler(data_dir, s, 0, config.block_size) for s in ("train", "val")}
            return
        if config.head == "mlm":  # BERT's masked tokens over the text's windows ([CLS] first)
            tokenizer = EncoderTokenizer.from_meta(self.data_meta["tokenizer"])
            splits = {s: open_split(data_dir, s, tokenizer.base.vocab_size) for s in ("train", "val")}
            self.train_batches = MaskedTokens(BatchSampler(splits["train"], config.block_size - 1, seed=c.seed), tokenizer)
            self.eval_batches = {s: MaskedTokens(BatchSampler(f, config.block_size - 1, seed=0), tokenizer) for s, f in splits.items()}
            return
        if self.chat:
            def sampler(split, seed):
                return ConversationSampler(data_dir, split, config.block_size, seed, self.data_meta["vocab_size"])
            self.train_batches = sampler("train", c.seed)
            self.notes += conversation_notes(self.train_batches, config.block_size)
            self.eval_batches = {s: sampler(s, 0) for s in ("train", "val")}
        else:
            splits = {s: open_split(data_dir, s, self.data_meta["vocab_size"]) for s in ("train", "val")}
            self.train_batches = BatchSampler(splits["train"], config.block_size, seed=c.seed)
            self.eval_batches = {s: BatchSampler(files, config.block_size, seed=0) for s, files in splits.items()}
        try:  # UTF-8 bytes per token id, for val bits per byte; None where the tokenizer cannot load
            self.token_bytes = torch.tensor(tokenizer_from_meta(self.data_meta["tokenizer"]).token_bytes())
        except DataError:
            self.token_bytes = None

    def place_model(self, c):
        """The model on its device (sharded under FSDP2), its optimizers, loss scaler and autocast."""
        model, world = self.raw_model, self.world
        # Full weights (a checkpoint's were loaded by build_model) before sharding; FSDP2 then shards them in
        # place, and the optimizer must see the sharded parameters.
        model.to(self.device)
        if c.fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            # bf16: weights gathered and used in bf16 (half the bytes of fp32), gradients reduced in fp32,
            # torchtitan's way; the residual stream is then bf16 too, where DDP's autocast keeps it fp32 (the
            # two differ by that rounding). fp16 keeps fp32 weights: an fp16 stream could overflow
            low = torch.bfloat16 if self.dtype == "bfloat16" else None
            policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
            for block in model.blocks:
                if c.compile:  # each block compiled before it is sharded (torchtitan's order; FSDP2's hooks are
                    block.compile()  # kept out of the graph by dynamo's skip_fsdp_hooks)
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)  # (in place: raw_model is the sharded model)
        shard = (world.rank, world.size) if world.enabled and not c.fsdp else None  # Muon's work shared out
        self.optimizers = build_optimizers(model, c, self.device_type, self.newton_schulz, shard)
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=self.dtype == "float16")
        self.autocast = autocast_for(self.device_type, self.dtype)
        self.pin = self.device_type == "cuda"

    def wrap(self):
        """torch.compile and DDP around the model, once its state is restored."""
        whole = self.train_config.compile and not self.train_config.fsdp  # (FSDP2's blocks were compiled one by one)
        self.model = torch.compile(self.raw_model) if whole else self.raw_model
        if self.world.enabled and not self.train_config.fsdp:
            from torch.nn.parallel import DistributedDataParallel

            # buffers (RoPE tables, ALiBi slopes) are constants: no need to sync them every forward. torch 2.13
            # renamed broadcast_buffers (now deprecated) to forward_sync_buffers; older torch (GPU nodes often
            # carry their own build) knows only the old name
            device_ids = [self.world.local_rank] if self.device_type == "cuda" else None
            no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                       else "broadcast_buffers")
            self.model = DistributedDataParallel(self.model, device_ids=device_ids, **{no_sync: False})

    def to_device(self, t):
        return t.pin_memory().to(self.device, non_blocking=True) if self.pin else t.to(self.device)

    def grad_sync(self, enabled):
        """Gradients are all-reduced only on the last micro-step of an accumulation."""
        if self.train_config.fsdp:
            self.model.set_requires_gradient_sync(enabled)
        elif self.world.enabled and not enabled:
            return self.model.no_sync()
        return nullcontext()

    @torch.no_grad()
    def evaluate(self, stop):
        """Mean cross-entropy (no z-loss) per split over eval_iters batches, or None on a stop request.

        A stop request counts between two batches in one process; under torchrun an all-reduce per batch to
        agree on it hung gloo at exit, so there the request waits for the evaluation's end. The batches come
        from a generator seeded the same way at every evaluation: evaluations compare like with like, and
        none of them moves the training RNG, so resuming stays exact."""
        c, world = self.train_config, self.world
        self.model.eval()
        result = {}
        for i, (split, sampler) in enumerate(self.eval_batches.items()):
            if hasattr(sampler, "ordered"):  # labelled examples: the split's first eval_iters batches, in order
                result |= self.evaluate_in_order(split, sampler)
                continue
            sampler.generator.manual_seed(c.seed + 1 + i)
            total = torch.zeros((), device=self.device)
            right = torch.zeros((), device=self.device, dtype=torch.long)
            masked = self.model_config.head == "mlm"
            n_bytes = n_trained = 0  # of every batch (each process draws them all): no collective needed
            for k in range(c.eval_iters):
                if stop.signum is not None and not world.enabled:  # under torchrun: after the evaluation
                    self.model.train()
                    return None
                x, y = sampler.sample(c.batch_size)
                if self.token_bytes is not None:
                    n_bytes += int((self.token_bytes[y.clamp_min(0)] * (y != -1)).sum())
                n_trained += int((y != -1).sum())
                if k % world.size != world.rank:
                    continue
                with self.autocast:
                    logits, _ = self.model(self.to_device(x))
                y = self.to_device(y)
                # conversations: summed over the trained targets, then divided by their count over all batches
                total += lm_loss(logits, y, normalizer=1 if self.chat else None)[1].float()
                if masked:  # BERT's: how many masked tokens the argmax gets back
                    right += ((logits.argmax(-1) == y) & (y != -1)).sum()
            mean = n_trained if self.chat else c.eval_iters
            result[split] = (world.mean(total) * world.size / mean).item()
            if masked:
                result[f"{split}_accuracy"] = (world.mean(right.float()) * world.size / n_trained).item()
            if split == "val" and n_bytes:  # bits per byte: comparable across tokenizers
                result["val_bpb"] = result["val"] * n_trained / math.log(2) / n_bytes
        if c.log_stability:  # on one val batch: the instabilities' two symptoms
            x, _ = self.eval_batches["val"].sample(c.batch_size)
            with recording(self.raw_model, weights=False) as records, self.autocast:
                logits, _ = self.raw_model(self.to_device(x))
            result["max_attn_logit"] = world.mean(torch.stack([r.max_logit for r in records if r]).max()).item()
            result["mean_log_z"] = world.mean(torch.logsumexp(logits.float(), dim=-1).mean()).item()
        if c.log_heads:  # the repeated random-token probe (its own generator: the training RNG is untouched)
            with self.autocast:
                heads = head_scores(self.raw_model)
            result["induction_score"], result["icl_score"] = best(heads["induction"]), heads["icl"]
            result["previous_token_score"] = best(heads["previous"])
        self.model.train()
        return result

    def evaluate_in_order(self, split, sampler):
        """{split: mean cross-entropy, split_accuracy: the share of argmax right} over a labelled split's
        first eval_iters * batch_size examples (every process reads them all: no collective)."""
        c = self.train_config
        total = correct = n = 0
        for x, y, *extra in sampler.ordered(c.batch_size, c.eval_iters * c.batch_size):
            with self.autocast:
                logits, _ = self.model(self.to_device(x), **self.inputs(extra))
            y = self.to_device(y)
            count = int((y != -1).sum())  # (pairs: the target tokens; classes: the examples)
            total += float(lm_loss(logits, y)[1]) * count
            correct += int(((logits.argmax(-1) == y) & (y != -1)).sum())
            n += count
        return {split: total / n, f"{split}_accuracy": correct / n}

    def inputs(self, extra, rows=slice(None)):
        """A batch's keyword inputs (source=, pad_mask=: labelled samplers' third item) on the device."""
        return {k: self.to_device(v[rows]) for k, v in (extra[0] if extra else {}).items()}

    def train_step(self, iter_num, lr, first_bad):
        """One optimizer step over gradient_accumulation_steps micro-batches.

        Returns a StepResult: the summed loss and cross-entropy (on the device: no host sync), the gradient
        norm, the updated first-bad-step tensor and whether the step was skipped as non-finite.
        """
        c, world, micro_steps = self.train_config, self.world, self.micro_steps
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        mine = slice(world.rank * micro_steps * c.batch_size, (world.rank + 1) * micro_steps * c.batch_size)
        x_mine, y_mine, *extra = self.train_batches.sample(c.gradient_accumulation_steps * c.batch_size, mine)
        normalizer = None  # conversations: each micro-batch's summed loss over the step's mean count of trained targets
        if self.chat:  # counted on the host, copied without a sync (pinned), summed over the processes
            trained = world.sum(self.to_device((y_mine != -1).sum().to(torch.float32)))
            normalizer = trained.clamp_min(1) / (micro_steps * world.size)
        loss_sum = torch.zeros((), device=self.device)
        ce_sum = torch.zeros((), device=self.device)
        for micro in range(micro_steps):
            rows = slice(micro * c.batch_size, (micro + 1) * c.batch_size)
            x, y = self.to_device(x_mine[rows]), self.to_device(y_mine[rows])
            with self.grad_sync(micro == micro_steps - 1):
                with self.autocast:
                    _, (loss, ce) = self.model(x, y, with_ce=True, normalizer=normalizer,  # the loss inside the compiled graph
                                               **self.inputs(extra, rows))
                self.scaler.scale(loss / micro_steps).backward()
            loss_sum += loss.detach()
            ce_sum += ce.detach()
        for optimizer in self.optimizers:
            self.scaler.unscale_(optimizer)
        grad_norm = clip_gradients(self.raw_model.parameters(), c.grad_clip)
        # with fp16 an infinite gradient is the GradScaler's business: it skips the step and rescales
        finite = torch.isfinite(loss_sum) if self.scaler.is_enabled() else torch.isfinite(loss_sum) & torch.isfinite(grad_norm)
        skipped = False
        if c.skip_nonfinite:  # deciding needs the value now: one host sync per step; every rank the same
            skipped = not bool((finite if not self.world.enabled else self.world.all(finite)).item())
        else:
            first_bad = torch.where(~finite & (first_bad < 0), iter_num, first_bad)
        if not skipped:
            for optimizer in self.optimizers:
                self.scaler.step(optimizer)
        self.scaler.update()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_sum, ce_sum, grad_norm, first_bad, skipped)


def conversation_notes(sampler, block_size):
    """What train.py says about a chat dataset's conversations that do not fit in block_size + 1 tokens."""
    notes = []
    if sampler.longer:
        notes.append(f"note: {sampler.longer:,} of {sampler.n_conversations:,} training conversations are longer than "
                     f"block_size + 1 = {block_size + 1} tokens: each is cut there and its later tokens are not trained")
    if sampler.dropped:
        notes.append(f"note: {sampler.dropped:,} of them have no trained token before the cut and are left out")
    return notes


class NonFinite(RuntimeError):
    pass


def check_finite(first_bad, ckpt_path):
    bad = int(first_bad.item())
    if bad >= 0:
        raise NonFinite(f"non-finite loss or gradient norm at iteration {bad}; stopped without saving, so "
                        f"{ckpt_path} still holds the last good state (lower learning_rate, or "
                        "skip_nonfinite=True to skip such steps)")


@dataclass
class StepResult:
    """What Run.train_step gives back, on the device (reading a value is a host sync: step_record's)."""

    loss_sum: torch.Tensor  # the micro-steps' losses, summed
    ce_sum: torch.Tensor  # and their plain cross-entropies
    grad_norm: torch.Tensor  # before clipping
    first_bad: torch.Tensor  # the first step whose loss or gradient was not finite (-1: none yet)
    skipped: bool  # skip_nonfinite dropped this step


def step_record(run, iter_num, lr, result, seconds, steps, elapsed):
    """The log record and line of a step (the only host sync of a step happens here)."""
    config, world = run.model_config, run.world
    loss = world.mean(result.loss_sum / run.micro_steps).item()
    ce = world.mean(result.ce_sum / run.micro_steps).item()
    tokens_per_sec = steps * tokens_per_step(run.train_config) / max(seconds, 1e-9)
    mfu = estimate_mfu(run.raw_model, tokens_per_sec / world.size, config.block_size, run.device, dtype=run.dtype)
    record = {"iter": iter_num, "loss": loss, "ce": ce, "lr": lr, "grad_norm": result.grad_norm.item(),
              "tokens_per_sec": tokens_per_sec, "ms_per_iter": 1000 * seconds / steps, "elapsed": elapsed}
    if config.z_loss > 0 and not config.label_smoothing:
        record["z_loss_term"] = loss - ce
    if mfu is not None:
        record["mfu"] = mfu
    if result.skipped:
        record["skipped"] = True
    line = (f"iter {iter_num}: loss {loss:.4f}" + (f" (ce {ce:.4f})" if config.z_loss or config.label_smoothing else "")
            + f", lr {lr:.2e}, grad norm {record['grad_norm']:.3f}, {tokens_per_sec:,.0f} tok/s"
            + (f", mfu {100 * mfu:.1f}%" if mfu is not None else ""))
    return record, line


# ----------------------------------------------------------------------------------------------------
# The config that runs, and the model it starts from


def settle_config(c, explicit, chosen=None):
    """The config that runs, and the checkpoint to resume (or None).

    A resumed run keeps its own config apart from what the command line changes; a fresh one refuses
    an out_dir that holds a checkpoint. Defaults the user did not set are fitted to a short run; what
    the user wrote is only checked."""
    ckpt_path = os.path.join(c.out_dir, CHECKPOINT)
    ckpt, notes = None, []
    if c.init_from == "auto":  # what a restarted job runs: torchrun --max-restarts, a requeued SLURM job
        found = os.path.exists(ckpt_path)
        notes.append(f"init_from=auto: {'resuming ' + ckpt_path if found else 'no checkpoint in ' + c.out_dir + ', starting from scratch'}")
        c = replace(c, init_from="resume" if found else "scratch")
    if c.init_from == "resume":
        ckpt = load_checkpoint(ckpt_path)
        if "rl_config" in ckpt:  # its optimizer and prompts are rl.py's
            raise ConfigError(f"{ckpt_path} was written by rl.py: continue it with python rl.py --init_from=resume "
                              f"--out_dir={c.out_dir}, or fine-tune it with --init_from={c.out_dir} and another out_dir")
        saved = {k: v for k, v in ckpt["train_config"].items() if k in TRAIN_KEYS}  # keys since removed are dropped
        c = TrainConfig(**{**saved, **{k: getattr(c, k) for k in explicit}, "init_from": "resume"})
    elif os.path.exists(ckpt_path) and not c.overwrite:
        raise ConfigError(f"{ckpt_path} exists: continue it with --init_from=resume, or start over with "
                          "--overwrite=True (or another --out_dir)")
    else:
        c = fit_defaults(c, explicit, notes, chosen)
    check_config(c)
    return c, ckpt, notes


def fit_defaults(c, explicit, notes, chosen=None):
    """c with the defaults the user did not set fitted to a short run (a note for each in notes).

    chosen: the keys given on the command line itself (None: all of explicit). A config file's (or a
    study's) warmup_iters is fitted too when the command line shortened max_iters below it and left
    the warmup alone: `train.py config/X.py --max_iters=5` is a smoke test, not a contradiction."""
    chosen = explicit if chosen is None else chosen
    from_file = "warmup_iters" in explicit and "warmup_iters" not in chosen and "max_iters" in chosen
    if ("warmup_iters" not in explicit or from_file) and c.warmup_iters > c.max_iters:
        fitted = c.max_iters // 10
        notes.append(f"note: warmup_iters={c.warmup_iters} ({'set by a config file' if from_file else 'the default'}) "
                     f"is longer than max_iters={c.max_iters}; using warmup_iters={fitted} (a tenth of the run); "
                     "set it to choose")
        c = replace(c, warmup_iters=fitted)
    return c


CONTEXT_KEYS = [f.name for f in fields(ContextKeys)]  # what a resumed run may change: fine-tune at another context


def build_model(c, explicit, data_meta, ckpt, notes):
    """The model for init_from (with a checkpoint's weights), checked against the dataset's tokenizer.

    A base model fine-tuned on a chat dataset of its own tokenizer gains the chat tokens
    (GPT.add_tokens)."""
    model, source = load_model_for(c, explicit, data_meta, ckpt, notes)
    if ckpt is not None:  # (a LoRA run resumes with its adapters in place: checkpoint.lora_model)
        return model, ckpt.get("lora")
    tokenizer = data_meta["tokenizer"]
    new_rows = None
    if tokenizer.get("kind") == "chat" and source != tokenizer:
        new_rows = base = data_meta["vocab_size"] - len(CHAT_TOKENS)
        model.add_tokens(base, list(range(base, base + len(CHAT_TOKENS))))
        notes.append(f"note: the chat template's {len(CHAT_TOKENS)} tokens are ids {base}-{base + len(CHAT_TOKENS) - 1}, their "
                     f"rows (embedding{'' if model.config.tie_embeddings else ' and head'}) set to the mean of the "
                     f"{base} base tokens' rows; vocab_size is {model.config.vocab_size}")
    if not c.lora_rank:
        return model, None
    if not os.path.exists(os.path.join(c.init_from, CHECKPOINT)):
        raise ConfigError(f"lora_rank > 0: init_from={c.init_from} must be a training run's out_dir (its {CHECKPOINT} is "
                          "the base the adapters are saved against)")
    record = {**lora.base_record(c.init_from, CHECKPOINT), "rank": c.lora_rank, "alpha": c.lora_alpha,
              "dropout": c.lora_dropout, "targets": c.lora_targets, "new_rows_from": new_rows}
    lora.apply(model, c.lora_rank, c.lora_alpha, c.lora_dropout, lora.parse_targets(c.lora_targets), new_rows)
    trained = sum(p.numel() for p in lora.trainable(model).values())
    notes.append(f"note: LoRA rank {c.lora_rank} on {c.lora_targets}: {trained:,} trained parameters, the base's "
                 f"{sum(p.numel() for p in model.parameters() if not p.requires_grad):,} frozen")
    return model, record


def base_of(tokenizer):
    """A chat dataset's base tokenizer (the one a base model was trained with), else the tokenizer itself."""
    return tokenizer["base"] if tokenizer.get("kind") == "chat" else tokenizer


def load_model_for(c, explicit, data_meta, ckpt, notes):
    tokenizer = data_meta["tokenizer"]
    if ckpt is not None:
        saved = asdict(GPTConfig(**ckpt["model_config"]))  # completed: checkpoints from before a key existed
        changed = {k: getattr(c, k) for k in explicit if k in MODEL_KEYS and k != "dropout" and getattr(c, k) != saved[k]}
        fixed = [k for k in changed if k not in CONTEXT_KEYS or saved["pos_emb"] == "learned"]
        if fixed:
            raise ConfigError("init_from=resume: " + ", ".join(f"{k}={changed[k]!r}" for k in fixed) + " differs from "
                              "the checkpoint (" + ", ".join(f"{k}={saved[k]!r}" for k in fixed) + "); a resumed "
                              "run keeps its architecture" + (" (and learned positions their length)" if any(
                                  k in CONTEXT_KEYS for k in fixed) else ""))
        if ckpt["tokenizer"] != tokenizer:
            raise DataError(f"dataset {c.dataset!r} uses {describe_meta(tokenizer)}, but {c.out_dir}/{CHECKPOINT} "
                            f"was trained with {describe_meta(ckpt['tokenizer'])}; resume with the dataset it was trained on")
        if ckpt.get("lora"):
            model = lora_model(ckpt, os.path.join(c.out_dir, CHECKPOINT), merged=False, dropout=c.dropout)
        else:
            model = GPT(GPTConfig(**{**ckpt["model_config"], "dropout": c.dropout}))
            model.load_state_dict(ckpt["model"])
        if changed:  # only context keys are left: continue at another context
            checked(model.set_context, changed.get("block_size"), changed.get("rope_scaling"), changed.get("rope_factor"))
            notes.append("note: resuming at " + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + " (the checkpoint "
                         "had " + ", ".join(f"{k}={saved[k]!r}" for k in changed) + "); the model was trained at "
                         f"block_size={model.config.trained_block_size}")
        return model, ckpt["tokenizer"]
    if c.init_from == "scratch":
        vocab_size = c.vocab_size if "vocab_size" in explicit else data_meta["vocab_size"]
        return GPT(checked(model_config, replace(c, vocab_size=vocab_size, **dataset_classes(c, explicit, data_meta)))), tokenizer
    overridden = [k for k in explicit if k in MODEL_KEYS and k not in ("dropout", "family", *HEAD_KEYS)]
    if overridden:
        raise ConfigError(f"init_from={c.init_from}: the pretrained model fixes {', '.join(overridden)}; "
                          f"drop those keys (only dropout, and an encoder's {'/'.join(HEAD_KEYS)}, can change)")
    model, source = load_pretrained_for(c, explicit, data_meta)
    if "family" in explicit and c.family != model.config.family:
        raise ConfigError(f"init_from={c.init_from} is family={model.config.family!r}; family={c.family!r} cannot change")
    heads = {k: getattr(c, k) for k in HEAD_KEYS if k in explicit} | dataset_classes(c, explicit, data_meta)
    heads = {k: v for k, v in heads.items() if getattr(model.config, k) != v}
    if heads:  # an encoder fine-tuned with another head: BERT's masked-token run -> a classifier
        model = checked(with_head, model, heads)
        notes.append(f"note: a new head ({', '.join(f'{k}={v!r}' for k, v in heads.items())}), initialised at random; "
                     f"the blocks and embeddings are {c.init_from}'s")
    return model, source


HEAD_KEYS = ("head", "n_classes", "pooler")  # what an encoder fine-tuned from a run may change


def dataset_classes(c, explicit, data_meta):
    """{"n_classes": the dataset's} for a classifier whose n_classes was not set, else {}."""
    classes = data_meta["tokenizer"].get("classes") or data_meta.get("labeled", {}).get("classes")
    return {"n_classes": len(classes)} if classes and "n_classes" not in explicit and c.head == "classify" else {}


def load_pretrained_for(c, explicit, data_meta):
    """A GGUF file's, another run's or a Hugging Face model's weights, checked against the dataset's tokenizer."""
    tokenizer = data_meta["tokenizer"]
    if c.init_from.endswith(".gguf"):  # llama.cpp's file: its vocabulary must be the dataset's (or its base's)
        model, source, _ = load_any(c.init_from)
        for meta in (tokenizer, base_of(tokenizer)):  # a chat file on chats; a base file on chats gains the tokens
            if same_vocabulary(source, tokenizer_from_meta(meta)):
                return with_dropout(model, c.dropout), meta
        raise DataError(f"init_from={c.init_from} holds another vocabulary ({describe_tokenizer(source)}) than dataset "
                        f"{c.dataset!r} ({describe_meta(tokenizer)}); prepare the data with the tokenizer it was trained with")
    run_ckpt = os.path.join(c.init_from, CHECKPOINT)  # another run's folder: its weights, a fine-tune's start
    if os.path.exists(run_ckpt):
        source = load_checkpoint(run_ckpt, mmap=True)["tokenizer"]
        if source not in (tokenizer, base_of(tokenizer)):
            raise DataError(f"init_from={c.init_from} was trained with another tokenizer than dataset {c.dataset!r}'s; "
                            "fine-tune it on a dataset prepared with its tokenizer (conversations: data/prepare.py "
                            f"--tokenizer_from={c.init_from})")
        return load_model(c.init_from, dropout=c.dropout)[0], source
    model = GPT.from_pretrained(c.init_from, dropout=c.dropout)
    if uses_gpt2_tokenizer(model.config) and base_of(tokenizer) != {"kind": "tiktoken", "encoding": "gpt2"}:
        raise DataError(f"GPT-2 weights need a dataset tokenized with tiktoken gpt2; {c.dataset!r} uses {describe_meta(tokenizer)}")
    return model, base_of(tokenizer)


# ----------------------------------------------------------------------------------------------------
# The command line's plumbing: signals, exit codes, a lost process under torchrun


def main(argv=None):
    return cli_main(command, argv)


def command(argv):
    c, explicit = parse_config(TrainConfig, argv, "python train.py [config_file ...] [--key=value ...]",
                               __doc__.strip().splitlines()[0], config_keys())
    try:
        result = train(c, explicit, script=True, chosen={a[2:].partition("=")[0] for a in argv if a.startswith("--")})
    except (NonFinite, OSError) as e:  # not bad input: a diverged run, a full disk
        print(f"error: {e.strerror if isinstance(e, OSError) and e.strerror else e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # the second Ctrl-C: out at once, without a traceback
        exit_now(c.out_dir)
    except RuntimeError as e:
        if not UNFREED_RUNS or not lost_a_process(e):
            raise
        rank = UNFREED_RUNS[0].world.rank
        print(f"error: rank {rank}: another process of this job is gone or silent ({str(e).splitlines()[0][:160]}); "
              f"{os.path.join(c.out_dir, CHECKPOINT)} holds the last saved state: restart with --init_from=auto "
              "(torchrun --max-restarts=N does so by itself)", file=sys.stderr, flush=True)
        os._exit(1)  # not sys.exit: tearing the process group down would wait on the lost process
    code = 0 if result["signal"] is None else 128 + result["signal"]  # the shell's convention for "ended by this signal"
    if UNFREED_RUNS:  # under torchrun: end here, before the interpreter frees DDP's reducer (see train())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
    return result


def lost_a_process(error):
    """Whether a collective failed because a peer process died or fell silent past dist_timeout.

    gloo's connection errors and timeouts (RuntimeErrors that name them) or torch.distributed's own error
    classes (NCCL's)."""
    import torch.distributed as dist

    return isinstance(error, dist.DistError) or any(
        sign in str(error) for sign in ("gloo/transport", "Connection reset by peer", "Timed out waiting"))


# A run under torchrun, kept until the process ends: freeing DDP's reducer joins gloo's worker thread with the
# GIL held, while that thread may still need the GIL to free a finished collective's tensors (py-spy: main
# thread in ~Reducer -> ~ProcessGroupGloo -> thread::join, worker in ~AsyncAllgatherWork -> decref): a
# deadlock at exit, about one run in ten on 2 busy cores even after a barrier. command() ends such a
# process with os._exit once the checkpoint, logs and output are written.
UNFREED_RUNS = []


if __name__ == "__main__":
    main()
