"""
Reinforcement learning with verifiable rewards on a chat model: GRPO's groups, sampled, scored, learned from.

  python rl.py config/rl_chat_tasks_cpu.py                 from the README's chat fine-tune (init_from=its out_dir)
  python rl.py --init_from=resume --out_dir=out-rl         continue a stopped run exactly
  python rl.py --help                                      every key, its default and type

Each step takes prompts_per_step conversations from `prompts` (JSON lines whose last assistant turn is the
reference: data/chat_tasks/prepare.py --rl writes them), samples group_size replies to each at
`temperature` through generate(lengths=...), scores every reply with its task's reward (REWARDS, or a function of
yours: `rewards`), and takes one AdamW step on the groups whose rewards differ: each reply token's
log-probability weighted by its advantage, reward - group mean (/ the group's std with scale_rewards),
plus kl_coef times an estimate of the KL divergence to the starting model. A group whose replies all
score alike teaches nothing (every advantage is 0) and is not run. Every eval_interval steps: greedy exact
match per task on eval_chats (eval.py's comparison), pass@k at the sampling temperature, and a checkpoint in
train.py's format, so chat.py, eval.py, export.py and serve.py read the result as they read a fine-tune.
"""

import hashlib
import importlib
import importlib.util
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

from checkpoint import (CHECKPOINT, CheckpointError, Logger, RunLock, RunState, StopRequest, at_dropout, exit_now,
                        load_checkpoint, model_from_checkpoint)
from configurator import ConfigError, DataError, cli_main, keys_of, parse_config
from device import DEVICES, Dist, pick_device
from eval import chat_prompt, exact_match, read_chats, reply_of
from generate import Sampling, stream_rows
import lora
from optim import clip_gradients, get_lr
from tokenizer import ChatTokenizer, tokenizer_from_meta


@dataclass
class RLConfig:
    # input and output
    init_from: str = ""  # the chat run to start from (its out_dir) | resume (continue out_dir's RL run)
    out_dir: str = "out-rl"  # ckpt.pt (train.py's format) and metrics.jsonl go here
    overwrite: bool = False  # a fresh run into an out_dir that holds a checkpoint: False refuses, True starts over
    prompts: str = "data/chat_tasks/rl.jsonl"  # JSON-lines conversations to learn from; each last assistant turn is the reference
    tasks: str = ""  # learn on these tasks' prompts only (comma separated); empty = every task in `prompts`
    eval_chats: str = "data/chat_tasks/val.jsonl"  # held-out conversations: greedy exact match per task at every evaluation
    eval_per_task: int = 0  # the first this many held-out conversations of each task; 0 = all
    pass_per_task: int = 32  # pass@k: this many held-out prompts of each task, group_size samples each; 0 = not measured
    # rewards: each conversation's "task" field picks its reward
    reward: str = "exact"  # a task's reward unless `rewards` names another: exact (eval.py's exact match) | chars (fraction of characters right)
    rewards: str = ""  # per task: task=exact|chars|module:function|file.py:function, comma separated; function(reply, reference, messages) -> [0, 1]
    # groups and sampling
    group_size: int = 16  # replies sampled per prompt; the advantage is measured within a group
    prompts_per_step: int = 16  # groups per optimizer step
    temperature: float = 1.0  # sampling temperature; the policy's log-probabilities are taken at it too
    max_new_tokens: int = 32  # the longest reply sampled
    scale_rewards: bool = False  # divide each group's advantages by its reward std (GRPO's); False: reward - mean (Dr. GRPO's)
    kl_coef: float = 0.0  # weight of the KL estimate (k3) to the starting model; 0 = none (and no copy of it kept)
    # the update
    max_iters: int = 100  # optimizer steps in the whole run
    learning_rate: float = 2e-4  # AdamW's peak rate (study 15: 3e-4 at 8 prompts a step collapsed a 0.8M model, 5e-5 barely moved)
    min_lr: float = 2e-4  # the cosine decays to this (equal to learning_rate: constant)
    warmup_iters: int = 0  # linear warmup steps
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping (the norm is still logged)
    # evaluation, logging, system
    eval_interval: int = 25  # evaluate (and checkpoint) every this many steps, and at the start and end
    log_interval: int = 1  # steps between log lines
    device: str = "auto"  # auto: cuda, else mps, else cpu (float32 throughout)
    seed: int = 1337
    wandb_log: bool = False  # also log to Weights & Biases (honours WANDB_MODE=offline)
    wandb_project: str = "smallgpt"
    wandb_run_name: str = "rl"

    lr_decay_iters = None  # (optim.get_lr's: the cosine ends at max_iters)


RL_CHOICES = {"device": DEVICES}
RL_KEYS = [f.name for f in fields(RLConfig)]


# ----------------------------------------------------------------------------------------------------
# Rewards: a reply's score in [0, 1] against its conversation's reference, keyed by the conversation's task


def exact(reply, reference, messages):
    """1 for the reference itself (eval.py --chats' rule: surrounding whitespace aside), else 0."""
    return float(exact_match(reply, reference))


def chars(reply, reference, messages):
    """The fraction of the reference's characters the reply has in place (over the longer of the two, so
    that extra characters cost too): dense partial credit, 1 only for the exact reference."""
    reply, reference = reply.strip(), reference.strip()
    if reply == reference:  # (two empty strings too)
        return 1.0
    return sum(a == b for a, b in zip(reply, reference)) / max(len(reply), len(reference), 1)


REWARDS = {"exact": exact, "chars": chars}


def load_reward(spec):
    """A reward: a REWARDS name, or module:function / path/to/file.py:function (a user's own)."""
    if spec in REWARDS:
        return REWARDS[spec]
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"reward {spec!r}: give one of {', '.join(REWARDS)}, module:function or file.py:function")
    try:
        if where.endswith(".py"):
            if not os.path.exists(where):
                raise ConfigError(f"reward {spec!r}: no file {where}")
            name_of = "rl_reward_" + os.path.splitext(os.path.basename(where))[0]
            found = importlib.util.spec_from_file_location(name_of, where)
            module = sys.modules[name_of] = importlib.util.module_from_spec(found)  # (dataclasses, pickling need it there)
            found.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:  # module:function is found from where the command runs, too
                sys.path.append(os.getcwd())
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: name it, one line
        raise ConfigError(f"reward {spec!r}: importing {where} failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(f"reward {spec!r}: {where} has no function {name}")
    return function


def task_rewards(c, tasks):
    """{task: reward function} from `rewards`, and the default for every other task; tasks: those in the data."""
    chosen = {}
    for item in filter(None, (part.strip() for part in c.rewards.split(","))):
        task, _, spec = item.partition("=")
        if not task.strip() or not spec.strip():
            raise ConfigError(f"rewards: {item!r} is not task=reward (e.g. rewards=\"reverse=chars,spell=my_rewards.py:spell\")")
        chosen[task.strip()] = load_reward(spec.strip())
    unknown = sorted(set(chosen) - set(tasks))
    if unknown:
        raise ConfigError(f"rewards: no conversation of task {', '.join(map(repr, unknown))} in {c.prompts} (its tasks: "
                          f"{', '.join(sorted(set(tasks)))})")
    return chosen, load_reward(c.reward)


def score(reward, reply, reference, messages, task):
    try:
        value = reward(reply, reference, messages)
    except Exception as e:  # the user's function failed: one line that names the task and the reply
        raise DataError(f"the reward of task {task!r} raised {type(e).__name__} ({str(e).splitlines()[0] if str(e) else ''}) "
                        f"on reply {reply!r}") from None
    try:
        value = float(value)
    except (TypeError, ValueError, OverflowError):
        value = math.nan
    if not 0.0 <= value <= 1.0:  # (NaN fails too)
        raise DataError(f"the reward of task {task!r} gave {value!r} for reply {reply!r}; a reward is a number in [0, 1]")
    return value


# ----------------------------------------------------------------------------------------------------
# Prompts: the conversations in a seeded order, a new permutation each pass, resumable


class Prompts:
    """The RL conversations, drawn prompts_per_step at a time in a seeded order that changes each pass.

    Its state (the pass, the position in it, and the sampling generator's state) goes into the
    checkpoint as train.py's batch sampler's does: a resumed run draws the same prompts and samples."""

    def __init__(self, conversations, seed, device="cpu"):
        self.conversations, self.seed = conversations, seed
        self.epoch, self.position = 0, 0
        self.generator = torch.Generator(device=device).manual_seed(seed)  # the replies' sampling noise, on their device
        self.order = self.permutation()

    def permutation(self):
        g = torch.Generator().manual_seed(self.seed + 1 + self.epoch)
        return torch.randperm(len(self.conversations), generator=g).tolist()

    def take(self, n):
        out = []
        while len(out) < n:
            if self.position == len(self.order):
                self.epoch, self.position = self.epoch + 1, 0
                self.order = self.permutation()
            out.append(self.conversations[self.order[self.position]])
            self.position += 1
        return out

    def digest(self):
        return hashlib.sha256(json.dumps(self.conversations).encode()).hexdigest()

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position, "generator": self.generator.get_state(),
                "seed": self.seed, "conversations": len(self.conversations), "digest": self.digest()}

    def load_state_dict(self, state):
        if state.get("digest") != self.digest():
            raise ConfigError(f"init_from=resume: the run drew from {state.get('conversations')} prompts, other than the "
                              f"{len(self.conversations)} `prompts` (and `tasks`) give now; resume with the file it ran on")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]  # (its own order, whatever --seed says)
        self.generator.set_state(state["generator"])
        self.order = self.permutation()


# ----------------------------------------------------------------------------------------------------
# Sampling and scoring


def prompt_batch(prompts, device):
    """(B, T) ids of prompts (lists) right-padded with 0, and their lengths: stream_rows' input."""
    lengths = [len(p) for p in prompts]
    idx = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, : len(p)] = torch.tensor(p)
    return idx.to(device), lengths


@torch.no_grad()
def sample_replies(model, tokenizer, prompts, n, sampling, max_new_tokens, generator, device, rows=256):
    """n replies to each prompt (ids): [(reply ids up to and with the end token, reply text)], prompt by
    prompt, in one generate() call per `rows` rows (the prompts' lengths differ)."""
    model.eval()
    flat = [p for p in prompts for _ in range(n)]
    out = []
    for begin in range(0, len(flat), rows):
        chunk = flat[begin : begin + rows]
        idx, lengths = prompt_batch(chunk, device)  # (a row that fills the context ends there: check_prompts)
        new = torch.cat(list(stream_rows(model, idx, lengths, max_new_tokens, sampling, tokenizer.end_token, generator)), dim=1)
        for prompt, ids in zip(chunk, new.tolist()):
            end = ids.index(tokenizer.end_token) + 1 if tokenizer.end_token in ids else len(ids)
            out.append((ids[:end], reply_of(tokenizer, prompt, ids[:end])))
    return out


def ranks(tasks):
    """For each item, how many items of the same task came before it."""
    seen = {}
    for task in tasks:
        seen[task] = seen.get(task, 0) + 1
        yield seen[task] - 1


def by_task(items):
    """{task: [values]} in first-seen order, from (task, value) pairs."""
    out = {}
    for task, value in items:
        out.setdefault(task, []).append(value)
    return out


def held_out(c, model, tokenizer, conversations, generator, device):
    """Greedy exact match per task (and overall) on the held-out conversations, and pass@k per task at the
    sampling temperature (k = group_size) on the first pass_per_task of each."""
    prompts = [chat_prompt(tokenizer, m[:-1]) for _, m in conversations]
    greedy = sample_replies(model, tokenizer, prompts, 1, Sampling(temperature=0), c.max_new_tokens, None, device)
    right = by_task((task, exact(text, m[-1]["content"], m)) for (task, m), (_, text) in zip(conversations, greedy))
    record = {f"exact_{t}": sum(v) / len(v) for t, v in right.items()}
    record["exact_match"] = sum(map(sum, right.values())) / len(conversations)
    if c.pass_per_task:
        chosen = [i for i, n in enumerate(ranks(t for t, _ in conversations)) if n < c.pass_per_task]
        samples = sample_replies(model, tokenizer, [prompts[i] for i in chosen], c.group_size,
                                 Sampling(temperature=c.temperature), c.max_new_tokens, generator, device)
        passed = []
        for j, i in enumerate(chosen):
            task, m = conversations[i]
            group = samples[j * c.group_size : (j + 1) * c.group_size]
            passed.append((task, float(any(exact(text, m[-1]["content"], m) for _, text in group))))
        record.update({f"pass_{t}": sum(v) / len(v) for t, v in by_task(passed).items()})
        record["pass_at_k"] = sum(v for _, v in passed) / len(passed)
    return record


# ----------------------------------------------------------------------------------------------------
# The update


def advantages(rewards, scale):
    """(groups, group_size) rewards -> advantages (reward - group mean, / group std if scale) and which
    groups are mixed (rewards not all equal: the others have advantage 0 everywhere)."""
    rewards = rewards.double()  # (16 equal rewards of 0.1 have a float32 std of 7e-9, not 0)
    mixed = rewards.amax(dim=1) > rewards.amin(dim=1)
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / rewards.std(dim=1, keepdim=True).clamp_min(1e-6)  # (GRPO's: the sample std)
    return (adv * mixed[:, None]).float(), mixed


def policy_batch(rows, device):
    """rows: [(prompt ids, reply ids, advantage)] -> inputs (B, T), and for the positions that predict a
    reply token (the mask): those tokens and their rows' advantages."""
    T = max(len(p) + len(r) for p, r, _ in rows) - 1
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    targets, weight = [], []
    for b, (p, r, a) in enumerate(rows):
        seq = p + r
        idx[b, : len(seq) - 1] = torch.tensor(seq[:-1])
        mask[b, len(p) - 1 : len(seq) - 1] = True
        targets += r
        weight += [a] * len(r)
    return idx.to(device), mask.to(device), torch.tensor(targets, device=device), torch.tensor(weight, device=device)


def token_logprobs(model, idx, mask, targets, temperature):
    """Log-probabilities at temperature of targets, one per masked position (row-major), and each of those
    positions' entropy. Only the masked positions' logits go through the softmax (a large vocabulary's
    (B, T, vocab) probabilities would not fit)."""
    logits, _ = model(idx)
    logp = F.log_softmax(logits[mask].float() / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp.gather(-1, targets[:, None])[:, 0], entropy


def policy_loss(model, reference, rows, c, device):
    """The step's loss: -(advantage x log p) summed over every reply token of the mixed groups, over their
    count, plus kl_coef x the mean k3 estimate of KL(policy || start) on the same tokens; and what to log."""
    idx, mask, targets, weight = policy_batch(rows, device)
    logp, entropy = token_logprobs(model, idx, mask, targets, c.temperature)
    loss = -(weight * logp).mean()
    logged = {"entropy": float(entropy.mean())}
    if reference is not None:
        with torch.no_grad():
            ref_logp, _ = token_logprobs(reference, idx, mask, targets, c.temperature)
        delta = (ref_logp - logp).clamp(-20, 20)  # (a token the policy or the start finds all but impossible)
        kl = (delta.exp() - delta - 1).mean()  # k3: unbiased, never negative (Schulman's estimator)
        loss = loss + c.kl_coef * kl
        logged["kl"] = float(kl.detach())
    return loss, logged


class RLRun:
    """What checkpoint.RunState saves and restores, for an RL run: the model, one AdamW, the prompts'
    position and sampling generator (as train.py's batch sampler), both configs, the tokenizer."""

    def __init__(self, c, state, path, device):
        """state: the checkpoint at path, the chat run's (a fresh run) or this run's own (a resumed one)."""
        self.device, self.device_type = device, torch.device(device).type
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # (before Dist would start a process group)
            raise ConfigError("rl.py runs in one process; run it with python, not torchrun")
        self.world = Dist(self.device_type)
        model = model_from_checkpoint(state, path)  # (a LoRA run: merged)
        if model.config.family != "decoder":
            raise ConfigError(f"{path}: a {model.config.family} model; rl.py samples replies from a decoder-only chat model")
        self.raw_model = self.without_dropout(model).to(device)
        self.model_config = self.raw_model.config
        self.tokenizer = tokenizer_from_meta(state["tokenizer"])
        if not isinstance(self.tokenizer, ChatTokenizer):
            raise ConfigError(f"init_from={c.init_from} is not a chat model (its tokenizer has no chat template): "
                              "fine-tune it on conversations first (README: Chat)")
        self.data_meta = {"tokenizer": state["tokenizer"]}
        # the start's training config as it saved it (eval.py reads its dataset), this run's out_dir and start
        self.train_config = {**state["train_config"], "out_dir": c.out_dir, "init_from": c.init_from, "lora_rank": 0}
        self.rl_config, self.lora = c, None
        self.dtype, self.newton_schulz = "float32", None
        self.scaler = torch.amp.GradScaler(self.device_type if self.device_type != "mps" else "cpu", enabled=False)
        self.optimizers = [torch.optim.AdamW(self.raw_model.parameters(), lr=c.learning_rate, betas=(c.beta1, c.beta2),
                                             weight_decay=c.weight_decay)]

    @staticmethod
    def without_dropout(model):
        """The model with dropout 0: the update's log-probabilities must be those of the policy that sampled."""
        return at_dropout(model, 0.0)


# ----------------------------------------------------------------------------------------------------
# The recipe


def check_config(c):
    if not c.init_from:
        raise ConfigError("init_from: give the chat run to start from (its out_dir, e.g. out-chat-tasks), or resume")
    for key in ("group_size", "prompts_per_step", "max_new_tokens", "max_iters", "eval_interval", "log_interval"):
        if getattr(c, key) < 1:
            raise ConfigError(f"{key}={getattr(c, key)} must be >= 1")
    if c.group_size < 2:
        raise ConfigError(f"group_size={c.group_size}: a group needs >= 2 replies (the advantage compares them)")
    if c.eval_per_task < 0 or c.pass_per_task < 0:
        raise ConfigError("eval_per_task and pass_per_task must be >= 0 (0: all / not measured)")
    if c.temperature <= 0:
        raise ConfigError(f"temperature={c.temperature} must be > 0: greedy replies to a prompt are all the same, "
                          "and a group of equal replies teaches nothing")
    if c.learning_rate <= 0 or not 0 <= c.min_lr <= c.learning_rate:
        raise ConfigError(f"learning_rate={c.learning_rate} must be > 0 and min_lr={c.min_lr} in [0, learning_rate]")
    if not 0 <= c.warmup_iters <= c.max_iters:
        raise ConfigError(f"warmup_iters={c.warmup_iters} must be in [0, max_iters={c.max_iters}]")
    if c.kl_coef < 0 or c.grad_clip < 0 or c.weight_decay < 0:
        raise ConfigError("kl_coef, grad_clip and weight_decay must be >= 0")
    if not (0 <= c.beta1 < 1 and 0 <= c.beta2 < 1):
        raise ConfigError(f"beta1={c.beta1} and beta2={c.beta2} must be in [0, 1)")


def settle(c, explicit):
    """The config that runs and the checkpoint to resume (or None), as train.py's settle_config."""
    ckpt_path = os.path.join(c.out_dir, CHECKPOINT)
    if c.init_from == "resume":
        ckpt = load_checkpoint(ckpt_path)
        if "rl_config" not in ckpt:
            raise ConfigError(f"{ckpt_path} was written by train.py, not rl.py: start RL from it with --init_from={c.out_dir} "
                              "and another --out_dir")
        saved = {k: v for k, v in ckpt["rl_config"].items() if k in RL_KEYS}
        c = RLConfig(**{**saved, **{k: getattr(c, k) for k in explicit if k != "init_from"}})
        check_config(c)
        return c, ckpt
    if os.path.exists(ckpt_path) and not c.overwrite:
        raise ConfigError(f"{ckpt_path} exists: continue it with --init_from=resume, or start over with --overwrite=True "
                          "(or another --out_dir)")
    check_config(c)
    if os.path.abspath(c.init_from) == os.path.abspath(c.out_dir):
        raise ConfigError(f"out_dir={c.out_dir} is init_from's own directory: write the RL run to another out_dir")
    return c, None


def read_data(c):
    """(training conversations, held-out conversations), checked and filtered (tasks, eval_per_task)."""
    train_set, eval_set = read_chats(c.prompts), read_chats(c.eval_chats)
    if c.tasks:
        chosen = {t.strip() for t in c.tasks.split(",") if t.strip()}
        missing = sorted(chosen - {t for t, _ in train_set})
        if missing:
            raise ConfigError(f"tasks: {', '.join(missing)} not in {c.prompts} (it has {', '.join(sorted({t for t, _ in train_set}))})")
        train_set = [x for x in train_set if x[0] in chosen]
    if c.eval_per_task:
        eval_set = [x for x, n in zip(eval_set, ranks(t for t, _ in eval_set)) if n < c.eval_per_task]
    return train_set, eval_set


def check_prompts(tokenizer, block_size, files):
    """A DataError naming the first conversation whose prompt leaves no room for a reply in the context: found
    now, not when a step draws it."""
    for path, conversations in files:
        for n, (task, messages) in enumerate(conversations):
            length = len(chat_prompt(tokenizer, messages[:-1]))
            if length >= block_size:
                raise DataError(f"{path}: conversation {n} (task {task!r}) has a prompt of {length} tokens: no room for a "
                                f"reply in block_size={block_size}; drop it or shorten it")


def rl(c, explicit, script=False):
    """Runs the RL that c (an RLConfig) describes; explicit: the keys the user set. Returns a summary."""
    c, ckpt = settle(c, explicit)
    train_set, eval_set = read_data(c)
    rewards, default_reward = task_rewards(c, {t for t, _ in train_set})
    device = pick_device(c.device)
    # where RL started (the KL's reference, a fresh run's weights): resumed, the absolute path recorded then
    start_dir = c.init_from if ckpt is None else ckpt["rl_start"]["base"]
    start_path = os.path.join(start_dir, CHECKPOINT)
    start = load_checkpoint(start_path) if ckpt is None or c.kl_coef else None
    if ckpt is not None:
        if start is not None and lora.file_sha256(start_path) != ckpt["rl_start"]["base_sha256"]:
            raise CheckpointError(f"init_from=resume: {start_path}, the model this run started from (its KL's reference), "
                                  "changed since; restore it")
        if ckpt["precision"]["device_type"] != torch.device(device).type:
            raise ConfigError(f"init_from=resume: the run sampled on {ckpt['precision']['device_type']}, this is {device}: "
                              f"resume it there (--device={ckpt['precision']['device_type']}); its random streams are that device's")
    torch.manual_seed(c.seed)
    run = RLRun(c, start if ckpt is None else ckpt, os.path.join(c.out_dir if ckpt else start_dir, CHECKPOINT), device)
    check_prompts(run.tokenizer, run.model_config.block_size, ((c.prompts, train_set), (c.eval_chats, eval_set)))
    reference = None
    if c.kl_coef:
        reference = run.without_dropout(model_from_checkpoint(start, start_path)).to(device).eval().requires_grad_(False)
    run.train_batches = Prompts(train_set, c.seed, device)
    state = RunState()
    run.extra_state = {"rl_config": asdict(c),
                       "rl_start": ckpt["rl_start"] if ckpt is not None else lora.base_record(start_dir, CHECKPOINT)}
    if ckpt is not None:
        state.restore(ckpt, run)
    del start, ckpt
    model, tokenizer = run.raw_model, run.tokenizer
    ckpt_path = os.path.join(c.out_dir, CHECKPOINT)
    os.makedirs(c.out_dir, exist_ok=True)
    lock = RunLock(c.out_dir).acquire()
    logger = stop = None
    try:
        logger = Logger(c, c.out_dir, state.iter_num, state.metrics_bytes, True)
        tasks = by_task((t, 1) for t, _ in train_set)
        logger.print(f"{model.get_num_params():,} parameters | {device} float32 | {len(train_set):,} prompts ("
                     + ", ".join(f"{t} {len(v)}" for t, v in tasks.items()) + f") | {c.prompts_per_step} x "
                     f"{c.group_size} replies per step | steps {state.iter_num} -> {c.max_iters}")
        stop = StopRequest(logger, c.out_dir if script else None)
        sampling = Sampling(temperature=c.temperature)
        while True:
            it = state.iter_num
            if (it % c.eval_interval == 0 or it == c.max_iters) and state.evaluated_at != it:
                result = held_out(c, model, tokenizer, eval_set, torch.Generator(device=device).manual_seed(c.seed + 7), device)
                state.evaluated_at = it
                logger.log({"iter": it, **result, "elapsed": state.elapsed()},
                           f"eval {it}: held-out exact match {result['exact_match']:.4f} ("
                           + ", ".join(f"{k[6:]} {v:.3f}" for k, v in result.items() if k.startswith("exact_") and k != "exact_match")
                           + ")" + (f", pass@{c.group_size} {result['pass_at_k']:.3f}" if "pass_at_k" in result else ""))
                if it > 0:
                    state.save(run, ckpt_path, logger)
            if it >= c.max_iters:
                break
            record, line = step(c, run, reference, rewards, default_reward, sampling, it, device)
            record["elapsed"] = state.elapsed()
            state.iter_num = it + 1
            if it % c.log_interval == 0 or it == c.max_iters - 1:
                logger.log(record, line)
            logger.tick()
            if stop.signum is not None:
                state.save(run, ckpt_path, logger)
                logger.print(f"saved {ckpt_path} at iteration {state.iter_num}; continue with --init_from=resume")
                return {"iter": state.iter_num, "signal": int(stop.signum)}
        return {"iter": state.iter_num, "signal": None}
    finally:
        for part in (stop, logger):
            if part is not None:
                part.close()
        lock.release()


def step(c, run, reference, rewards, default_reward, sampling, it, device):
    """One RL step: sample the groups, score them, update on the mixed ones. -> (metrics record, log line)."""
    model, tokenizer = run.raw_model, run.tokenizer
    conversations = run.train_batches.take(c.prompts_per_step)
    prompts = [chat_prompt(tokenizer, m[:-1]) for _, m in conversations]
    replies = sample_replies(model, tokenizer, prompts, c.group_size, sampling, c.max_new_tokens,
                             run.train_batches.generator, device)
    scores = []
    for j, (task, m) in enumerate(conversations):
        reward = rewards.get(task, default_reward)
        for ids, text in replies[j * c.group_size : (j + 1) * c.group_size]:
            scores.append(score(reward, text, m[-1]["content"], m[:-1], task))
    table = torch.tensor(scores).view(len(conversations), c.group_size)
    adv, mixed = advantages(table, c.scale_rewards)
    rows = [(prompts[j], replies[j * c.group_size + k][0], float(adv[j, k]))
            for j in range(len(conversations)) if mixed[j] for k in range(c.group_size)]
    lr = get_lr(it, c)
    record = {"iter": it, "reward": float(table.mean()), "mixed": float(mixed.float().mean()), "lr": lr,
              "reply_tokens": sum(len(ids) for ids, _ in replies) / len(replies)}
    record.update({f"reward_{t}": sum(v) / len(v) for t, v in by_task(
        (task, float(table[j].mean())) for j, (task, _) in enumerate(conversations)).items()})
    if rows:
        model.train()
        for group in run.optimizers[0].param_groups:
            group["lr"] = lr
        loss, logged = policy_loss(model, reference, rows, c, device)
        loss.backward()
        norm = clip_gradients(model.parameters(), c.grad_clip)
        finite = bool(torch.isfinite(loss) & torch.isfinite(norm))
        if finite:  # (a non-finite step is skipped, never written into the weights)
            run.optimizers[0].step()
        run.optimizers[0].zero_grad(set_to_none=True)
        record.update({"loss": float(loss.detach()), "grad_norm": float(norm), "skipped": not finite, **logged})
    line = (f"iter {it}: reward {record['reward']:.3f}, mixed groups {record['mixed']:.2f}, reply "
            f"{record['reply_tokens']:.1f} tokens" + (f", entropy {record['entropy']:.3f}, grad norm {record['grad_norm']:.3f}"
                                                    if rows else ", no mixed group: no update")
            + (f", kl {record['kl']:.4f}" if "kl" in record else "") + (", non-finite: step skipped" if record.get("skipped") else ""))
    return record, line


# ----------------------------------------------------------------------------------------------------
# The command line


def main(argv=None):
    return cli_main(command, argv)


def command(argv):
    c, explicit = parse_config(RLConfig, argv, "python rl.py [config_file ...] [--key=value ...]",
                               __doc__.strip().splitlines()[0], keys_of(RLConfig, RL_CHOICES))
    try:
        result = rl(c, explicit, script=True)
    except OSError as e:  # not bad input: a full disk
        print(f"error: {e.strerror or e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        exit_now(c.out_dir)
    if result["signal"] is not None:
        sys.exit(128 + result["signal"])
    return result


if __name__ == "__main__":
    main()
