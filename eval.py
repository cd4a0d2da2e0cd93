"""
Scores a trained model on a whole split or a text file: mean loss, perplexity and bits per byte.

  python eval.py --out_dir=out-shakespeare-char-cpu                    the checkpoint's dataset, val split
  python eval.py --out_dir=DIR --text=FILE --stride=64                 any UTF-8 text, overlapping windows
  python eval.py --out_dir=DIR --tasks=hellaswag,lambada_openai        lm-evaluation-harness tasks
  python eval.py --init_from=gpt2 --tasks=arc_easy --limit=100          a Hugging Face model
  python eval.py --help

Every token but the first is scored once, in windows of block_size tokens: the first window scores all
its positions, each later one (stride tokens further) only its last stride positions, so every scored
token sees at least block_size - stride tokens of context (stride = block_size: windows do not overlap).
Bits per byte = total nats / ln 2 / the UTF-8 bytes of the scored tokens' text: comparable between a
character model and a BPE model scored on the same text.

A masked dataset's split (conversations: data/prepare.py CHATS.jsonl; data/mqar) scores the tokens it
trains, the assistants' turns or the queried values, one sequence per window (as train.py's val loss),
and the accuracy of the argmax on them. --chats=FILE answers
conversations instead: the model replies to each one's last user turn (greedy) and the reply is compared
with the file's last assistant turn, exact match per task (a "task" field; --chats_fewshot=K puts K
solved examples of the same task from --chats_examples before it; a base model without a chat template
reads them as a "User: ... / Assistant: ..." transcript and its reply ends at a newline).

--tasks runs lm-evaluation-harness tasks instead (pip install -r requirements-eval.txt): harness.py scores
each request as lm-eval's own Hugging Face backend does, so the numbers compare with published ones. Task
data comes from the Hugging Face Hub (or its local cache); offline, write the task as a YAML file with
local data files and pass its folder with --include_path.
"""

import math
import os
import sys
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from checkpoint import ContextKeys, load_for
import generate
from configurator import ConfigError, DataError, Progress, checked, cli_main, keys_of, parse_config
from dataset import (ConversationSampler, hub_offline, hub_reachable, is_masked_dataset, open_split,
                     read_meta, read_records, resolve_dataset, write_json)
from device import COMPUTE_DTYPES, DEVICES, autocast, pick_device, pick_dtype
from generate import Sampling, check_max_new_tokens
from quantize import Int8Linear, for_inference
from tokenizer import ChatTokenizer, continuation, describe_meta, same_vocabulary, tokenizer_from_meta


@dataclass
class EvalConfig(ContextKeys):
    out_dir: str = "out"  # the training run whose ckpt.pt to score (init_from=resume)
    init_from: str = "resume"  # resume (out_dir/ckpt.pt) | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face model directory
    dataset: str = ""  # a prepared dataset; empty = the one the checkpoint was trained on
    split: str = "val"  # val | train
    text: str = ""  # score this UTF-8 file instead of a dataset split
    stride: int = 0  # tokens between window starts; 0 = block_size (no overlap)
    batch_size: int = 8  # windows (or lm-eval requests) per forward pass
    tasks: str = ""  # lm-evaluation-harness tasks, comma-separated (e.g. hellaswag,lambada_openai); replaces the split's score
    limit: float = 0  # lm-eval: documents per task; below 1, a fraction of each task; 0 = all
    num_fewshot: Optional[int] = None  # lm-eval: few-shot examples per prompt; None = each task's default
    include_path: str = ""  # lm-eval: a folder of task YAML files (local data: how tasks run offline)
    device: str = "auto"  # auto | cpu | cuda | mps
    dtype: str = "float32"  # compute dtype: float32 (exact) | auto | bfloat16 | float16
    weights_dtype: str = "float32"  # the weights as sample.py decodes with them: float32 | bfloat16 | int8 (CPU; each window then runs through the KV cache 16 rows at a time, so every product is the decode kernel's); a decoder's split, --text or --chats
    json: str = ""  # also write the results to this JSON file
    chats: str = ""  # a JSON-lines file of conversations: answer each last user turn, exact match against its last assistant turn
    chats_fewshot: int = 0  # solved examples of the same task before each conversation (from chats_examples)
    chats_examples: str = ""  # the JSON-lines file the few-shot examples come from (a train split's)
    max_new_tokens: int = 64  # chats: the longest reply (it also ends at the model's context)


EVAL_CHOICES = {"device": DEVICES, "dtype": COMPUTE_DTYPES, "split": ("val", "train"), "weights_dtype": ("float32", "bfloat16", "int8"),
                **ContextKeys.CHOICES}


def windows(n_tokens, block_size, stride):
    """(begin, end, scored) per window over a sequence of n_tokens: inputs are tokens begin..end-1, their
    targets begin+1..end, and the last `scored` of those targets are scored here (each target once)."""
    out, scored_until = [], 0
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + block_size, n_tokens - 1)
        out.append((begin, end, end - scored_until))
        scored_until = end
        if end == n_tokens - 1:
            break
    return out


def token_nats(logits, targets, elements=1 << 24):
    """Cross-entropy per position in float64 (sums over a whole split lose nothing to fp32 rounding), a
    chunk of vocab-sized rows at a time so a GPT-2 vocabulary does not need gigabytes."""
    rows, y = logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    step = max(1, elements // rows.size(1))  # 128 MB of float64 at a time
    mps = rows.device.type == "mps"  # no float64 there: fp32 losses, summed in float64 on the CPU
    out = [F.cross_entropy(rows[i : i + step].to(torch.float32 if mps else torch.float64), y[i : i + step],
                           reduction="none") for i in range(0, len(y), step)]
    return torch.cat([o.cpu().double() for o in out] if mps else out).view(targets.shape)


@torch.no_grad()
def score(model, tokens, stride, batch_size, device, context):
    """(nats, targets): each scored token's loss (float64) and id, in order, over tokens (1-D int64).
    Each window's losses go straight into one buffer of the text's length: thousands of small tensors kept
    alive between the batches' large, freed logits fragment the heap until a 1 MB text at --stride=16
    needed 7.6 GB (docs/research_log.md)."""
    block_size = model.config.block_size
    spans = windows(len(tokens), block_size, stride)
    nats_all = torch.empty(len(tokens) - 1, dtype=torch.float64)  # target j is tokens[j + 1]
    with Progress(len(spans), "windows", "scoring") as progress:
        for i in range(0, len(spans), batch_size):
            score_windows(model, tokens, spans[i : i + batch_size], nats_all, context, device)
            progress.update(len(spans[i : i + batch_size]))
    scored = spans[-1][1]  # every target up to the last window's end, each once
    return nats_all[:scored], tokens[1 : scored + 1]


def window_logits(model, x):
    """The logits of windows x (B, T): one forward pass, or with int8 weights through the KV cache a few tokens
    at a time, so that each product has at most Int8Linear.DECODE_ROWS rows and runs as decoding runs it
    (rowdot's arithmetic; a longer pass takes the prefill's dequantised bf16 matmul instead)."""
    if not any(isinstance(m, Int8Linear) for m in model.modules()):
        return model(x)[0]
    rows = Int8Linear.DECODE_ROWS
    if x.size(0) > rows:  # (a batch wider than that: in groups of rows)
        return torch.cat([window_logits(model, x[i : i + rows]) for i in range(0, x.size(0), rows)])
    step, cache = rows // x.size(0), model.new_cache()
    return torch.cat([model.forward_cached(x[:, s : s + step], cache, last=min(step, x.size(1) - s))
                      for s in range(0, x.size(1), step)], dim=1)


def score_windows(model, tokens, group, nats_all, context, device):
    """One batch of windows: each window's scored targets' losses into nats_all."""
    by_length = {}  # the last window can be shorter: one forward pass per length
    for span in group:
        by_length.setdefault(span[1] - span[0], []).append(span)
    for length, same in by_length.items():
        x = torch.stack([tokens[b:e] for b, e, _ in same]).to(device)
        y = torch.stack([tokens[b + 1 : e + 1] for b, e, _ in same]).to(device)
        with context:
            logits = window_logits(model, x)
        nats = token_nats(logits, y).cpu()
        for row, (_, end, n) in enumerate(same):  # this window scores targets end - n .. end - 1
            nats_all[end - n : end] = nats[row, length - n :]


def load_tokens(c, tokenizer, meta):
    """The token ids to score, from --text or a dataset split (whose tokenizer must be the checkpoint's)."""
    if c.text:
        try:
            with open(c.text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"text={c.text}: cannot read it as UTF-8 text ({e})") from None
        return torch.tensor(tokenizer.encode(text), dtype=torch.long)
    data_dir = resolve_dataset(c.dataset)
    data_meta = read_meta(data_dir)
    if data_meta["tokenizer"] != meta and not same_vocabulary(tokenizer, tokenizer_from_meta(data_meta["tokenizer"])):
        raise DataError(f"dataset {c.dataset!r} uses {describe_meta(data_meta['tokenizer'])}, but the model was "
                        f"trained with {describe_meta(meta)}; score it on text its tokenizer covers (--text) or its own dataset")
    if is_masked_dataset(data_meta):
        return ConversationSampler(data_dir, c.split, 1 << 62, 0, data_meta["vocab_size"])  # whole conversations
    files = open_split(data_dir, c.split, data_meta["vocab_size"])
    return torch.from_numpy(np.concatenate([f.tokens for f in files]).astype(np.int64))


@torch.no_grad()
def score_conversations(model, conversations, device, context):
    """(nats, targets, how many the argmax gets right) over the trained targets of a masked split
    (conversations, MQAR), each sequence in a window of its own from position 0 (its first block_size + 1
    tokens, as train.py sees it)."""
    nats, targets, right = [], [], 0
    block_size = model.config.block_size
    with Progress(len(conversations.convs), "sequences", "scoring") as progress:
        for start, length in conversations.convs:
            length = min(length, block_size + 1)
            ids = torch.from_numpy(conversations.tokens.window(start, length))
            trained = torch.from_numpy(conversations.mask.window(start, length))[1:].bool()
            with context:
                logits = window_logits(model, ids[None, :-1].to(device))
            nats.append(token_nats(logits, ids[None, 1:].to(device))[0].cpu()[trained])
            targets.append(ids[1:][trained])
            right += int((logits[0].argmax(-1).cpu()[trained] == targets[-1]).sum())
            progress.update()
    return torch.cat(nats), torch.cat(targets), right


def score_examples(c, model, state):
    """A model of labelled examples over a whole split, in order: a classifier's (images, or texts with
    labels) loss and accuracy; an encoder-decoder's loss on the targets and greedy exact match."""
    from labeled import ImageSampler, LabeledSampler, check_images, check_labeled

    name = c.dataset or (state and state["train_config"]["dataset"])
    if not name:
        raise ConfigError(f"init_from={c.init_from} has no training dataset to default to: give --dataset=NAME")
    data_dir = resolve_dataset(name)
    meta, config = read_meta(data_dir), model.config
    if config.head == "mlm":
        return score_masked(c, model, name, data_dir, meta)
    if config.image_size:
        check_images(meta["tokenizer"], config, f"dataset {name!r}")
        batches = ImageSampler(data_dir, c.split, 0).ordered(c.batch_size, 1 << 62)
    else:
        check_labeled(meta, config, f"dataset {name!r}")
        sampler = LabeledSampler(data_dir, c.split, 0, config.block_size)
        batches = sampler.ordered(c.batch_size, 1 << 62)
    device = pick_device(c.device)
    dtype = pick_dtype(c.dtype, torch.device(device).type)
    model, context = model.to(device).eval(), autocast(torch.device(device).type, dtype)
    nats = right = n = scored = 0
    with torch.no_grad():
        for x, y, *extra in batches:
            inputs = {k: v.to(device) for k, v in (extra[0] if extra else {}).items()}
            with context:
                logits = model(x.to(device), **inputs)[0].float()
            y = y.to(device)
            nats += float(F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-1, reduction="sum"))
            scored += int((y != -1).sum())
            n += len(y)
            if config.family != "encoder-decoder":
                right += int((logits.argmax(-1) == y).sum())
                continue
            end = sampler.tok.end_token  # greedy from [CLS], the source encoded once; exact: the whole target and its end
            with context:
                out = generate.generate(model, x[:, :1].to(device), y.size(1), Sampling(temperature=0), eos_token_id=end,
                                        **inputs)[:, 1:]
            out = torch.cat([out, out.new_full((len(y), y.size(1) - out.size(1) + 1), end)], 1)[:, : y.size(1)]
            right += int(((out == y) | (y == -1)).all(1).sum())
    metric = "accuracy" if config.family != "encoder-decoder" else "exact_match"
    return {"source": f"{name}/{c.split}", "examples": n, "loss": nats / scored, metric: right / n, "dtype": dtype}


def score_masked(c, model, name, data_dir, meta):
    """BERT's objective over a text split: its windows of block_size - 1 tokens in order, each after [CLS],
    masked as in training (15%: 80/10/10) from a generator seeded 0; the loss and the share of masked
    tokens the argmax gets back."""
    from labeled import MaskedTokens
    from tokenizer import EncoderTokenizer

    tokenizer = EncoderTokenizer.from_meta(meta["tokenizer"])
    files = open_split(data_dir, c.split, tokenizer.base.vocab_size)
    tokens = torch.from_numpy(np.concatenate([f.tokens for f in files]).astype(np.int64))
    T = model.config.block_size - 1
    windows = tokens[: len(tokens) // T * T].view(-1, T)
    if not len(windows):
        raise DataError(f"dataset {name!r}: its {c.split} split holds fewer than block_size - 1 = {T} tokens")

    masked = MaskedTokens(SimpleNamespace(generator=torch.Generator().manual_seed(0)), tokenizer)  # windows given below
    device = pick_device(c.device)
    dtype = pick_dtype(c.dtype, torch.device(device).type)
    model, context = model.to(device).eval(), autocast(torch.device(device).type, dtype)
    nats = right = n = 0
    for start in range(0, len(windows), c.batch_size):
        x, y = masked.mask(windows[start : start + c.batch_size])
        with context, torch.no_grad():
            logits = model(x.to(device))[0].float()
        y = y.to(device)
        nats += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum"))
        right += int(((logits.argmax(-1) == y) & (y != -1)).sum())
        n += int((y != -1).sum())
    return {"source": f"{name}/{c.split}", "examples": len(windows), "masked_tokens": n, "loss": nats / n,
            "accuracy": right / n, "dtype": dtype}


def evaluate(c):
    """Loss, perplexity and bits per byte of a whole split or text file (a classifier: loss and accuracy)."""
    model, tokenizer, state = load_for(c)
    if model.config.family != "decoder" or model.config.head != "lm":
        if c.weights_dtype != "float32":
            raise ConfigError(f"weights_dtype={c.weights_dtype}: this model is family={model.config.family!r}, scored "
                              "with float32 weights; weights_dtype is for a decoder's split, --text or --chats")
        if c.text:
            raise ConfigError(f"--text scores a decoder's next tokens; this model is family={model.config.family!r}: "
                              "it is scored on a prepared dataset (--dataset, default its own)")
        return score_examples(c, model, state)
    if state is None and not (c.text or c.dataset):
        raise ConfigError(f"init_from={c.init_from} has no training dataset to default to: give --text=FILE or --dataset=NAME")
    meta = state["tokenizer"] if state else tokenizer.meta()
    c = replace(c, dataset=c.dataset or (state and state["train_config"]["dataset"]))
    stride = c.stride or model.config.block_size
    if not 1 <= stride <= model.config.block_size:
        raise ConfigError(f"stride={stride} must be in [1, block_size={model.config.block_size}]")
    tokens = load_tokens(c, tokenizer, meta)
    chat = isinstance(tokens, ConversationSampler)
    if not chat and len(tokens) < 2:
        raise DataError("fewer than 2 tokens: nothing to score")
    device = pick_device(c.device)
    dtype = pick_dtype(c.dtype, torch.device(device).type)
    model = model.to(device).eval()
    if c.weights_dtype != "float32":  # (float32 keeps the exact forward pass, as before)
        model = checked(for_inference, model, c.weights_dtype)
    context = autocast(torch.device(device).type, dtype)
    right = None
    if chat:
        losses, scored, right = score_conversations(model, tokens, device, context)
    else:
        losses, scored = score(model, tokens, stride, c.batch_size, device, context)
    nats = losses.sum().item()
    n_bytes = int(torch.tensor(tokenizer.token_bytes(), dtype=torch.long)[scored].sum())
    return {
        "source": c.text or f"{c.dataset}/{c.split}" + (f" (the trained tokens of {len(tokens.convs):,} conversations)" if chat else ""),
        "tokenizer": meta.get("kind"), "tokens": len(scored),
        "bytes": n_bytes, "loss": nats / len(scored), "perplexity": math.exp(nats / len(scored)),
        "bits_per_byte": nats / math.log(2) / n_bytes if n_bytes else None, "block_size": model.config.block_size,
        "stride": stride, "dtype": dtype, "weights_dtype": c.weights_dtype,
        **({"accuracy": right / len(scored)} if right is not None else {}),
    }  # fmt: skip


def import_harness():
    """harness.py, which needs lm_eval. When the Hub cannot be reached, Hugging Face's libraries are put
    offline first (before they are imported): a task whose data is not cached then fails at once, where
    datasets' retries would take half a minute."""
    if not hub_offline() and not hub_reachable(timeout=3):
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        print("note: the Hugging Face Hub cannot be reached; task data comes from its local cache or --include_path",
              file=sys.stderr)
    try:
        import harness
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        raise ConfigError("--tasks needs lm-evaluation-harness, which is not installed: "
                          "pip install -r requirements-eval.txt") from None
    return harness


def run_tasks(c):
    """lm-evaluation-harness's results dict for --tasks."""
    tasks = [t.strip() for t in c.tasks.split(",") if t.strip()]
    if c.limit < 0:
        raise ConfigError(f"limit={c.limit} must be >= 0 (0 = every document)")
    if c.num_fewshot is not None and c.num_fewshot < 0:
        raise ConfigError(f"num_fewshot={c.num_fewshot} must be >= 0, or None for each task's default")
    if c.include_path and not os.path.isdir(c.include_path):
        raise ConfigError(f"include_path={c.include_path}: not a folder (it should hold task YAML files)")
    if c.weights_dtype != "float32":
        raise ConfigError(f"weights_dtype={c.weights_dtype}: --tasks scores with float32 weights; weights_dtype is for a "
                          "split, --text or --chats")
    harness = import_harness()
    model, tokenizer, _ = load_for(c)
    if model.config.family != "decoder":
        raise ConfigError(f"--tasks scores a decoder's next-token log-likelihoods; this model is family={model.config.family!r}")
    device = pick_device(c.device)
    dtype = pick_dtype(c.dtype, torch.device(device).type)
    lm = harness.GPTHarness(model.to(device).eval(), tokenizer, device, c.batch_size,
                            autocast(torch.device(device).type, dtype))
    limit = None if c.limit == 0 else int(c.limit) if c.limit >= 1 else c.limit
    return harness.run_tasks(lm, tasks, limit, c.num_fewshot, c.include_path or None)


def read_chats(path):
    """[(task, messages)] of a JSON-lines file; each conversation must end with the assistant's reference turn."""
    out = []
    for n, (record, messages) in enumerate(read_records(path)):
        if messages[-1]["role"] != "assistant" or len(messages) < 2:
            raise DataError(f"{path}: conversation {n}: the last message must be the assistant's reference answer, "
                            "after a user turn")
        out.append((str(record.get("task", "-")), messages))
    if not out:
        raise DataError(f"{path}: no conversations")
    return out


TRANSCRIPT = {"system": "System", "user": "User", "assistant": "Assistant"}  # a base model's few-shot form


def chat_prompt(tokenizer, messages):
    """The prompt ids for a reply after messages: the chat template where the model has one, else a
    plain transcript ("User: ...\nAssistant: ...\n" per line, "Assistant:" last)."""
    if isinstance(tokenizer, ChatTokenizer):
        return tokenizer.render(messages, add_generation_prompt=True)[0]
    return tokenizer.encode("".join(f"{TRANSCRIPT[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:")


def reply_of(tokenizer, prompt, ids):
    """The reply's text: up to the first chat token (a chat model) or the first newline (a transcript)."""
    if isinstance(tokenizer, ChatTokenizer):
        ids = ids[: next((i for i, t in enumerate(ids) if t in tokenizer.names), len(ids))]
        return continuation(tokenizer, prompt[-1:], ids)
    return continuation(tokenizer, prompt, ids).split("\n")[0].strip()


def exact_match(reply, reference):
    """--chats' rule (rl.py's default reward too): the reference itself, surrounding whitespace aside."""
    return reply.strip() == reference.strip()


def answer_chats(c):
    """Exact match of the greedy replies to --chats' conversations, per task and overall. One conversation
    at a time, as chat.py answers it: a batch's products may round otherwise than a single row's, and a
    near-tie in the argmax would then make the score depend on which conversations share a batch."""
    if c.chats_fewshot < 0 or (c.chats_fewshot and not c.chats_examples):
        raise ConfigError("chats_fewshot=K needs K >= 0 and, above 0, chats_examples=FILE to take the examples from")
    checked(check_max_new_tokens, c.max_new_tokens)
    conversations = read_chats(c.chats)
    examples = {}
    for task, messages in read_chats(c.chats_examples) if c.chats_fewshot else []:
        examples.setdefault(task, []).append(messages)
    model, tokenizer, _ = load_for(c)
    device = pick_device(c.device)
    model = checked(for_inference, model.to(device), c.weights_dtype)
    rows, tasks = [], {}
    with Progress(len(conversations), "conversations", "answering") as progress:
        for task, messages in conversations:
            shots = [m for shot in examples.get(task, [])[: c.chats_fewshot] for m in shot[-2:]]  # its last exchange
            reply = greedy_reply(model, tokenizer, shots + messages[:-1], c.max_new_tokens, device, task)
            right = exact_match(reply, messages[-1]["content"])
            rows.append({"task": task, "reply": reply, "reference": messages[-1]["content"], "exact": right})
            tasks.setdefault(task, []).append(right)
            progress.update()
    table = ["| task | conversations | exact match |", "| --- | --- | --- |"]
    table += [f"| {t} | {len(v)} | {sum(v) / len(v):.3f} |" for t, v in tasks.items()]
    overall = sum(r["exact"] for r in rows) / len(rows)
    table.append(f"| **all** | {len(rows)} | **{overall:.3f}** |")
    return {"source": c.chats, "fewshot": c.chats_fewshot, "exact_match": overall,
            "by_task": {t: sum(v) / len(v) for t, v in tasks.items()}, "table": "\n".join(table), "replies": rows}


def greedy_reply(model, tokenizer, messages, max_new_tokens, device, task):
    """The model's greedy reply to messages (its last turn the user's), as chat.py gives it."""
    prompt = chat_prompt(tokenizer, messages)
    limit = model.config.context_limit
    if limit is not None and len(prompt) > limit:
        raise DataError(f"a conversation of task {task!r} needs {len(prompt)} prompt tokens, more than the model's "
                        f"context of {limit}: no room for a reply; lower chats_fewshot or raise block_size")
    room = max_new_tokens if limit is None else min(max_new_tokens, limit + 1 - len(prompt))  # as chat.py's
    eos = tokenizer.end_token if isinstance(tokenizer, ChatTokenizer) else None
    out = generate.generate(model, torch.tensor([prompt], device=device), room, Sampling(temperature=0), eos_token_id=eos)
    return reply_of(tokenizer, prompt, out[0, len(prompt) :].tolist())


def main(argv=None):
    def command(argv):
        c, _ = parse_config(EvalConfig, argv, "python eval.py --out_dir=DIR [--key=value ...]",
                            __doc__.strip().splitlines()[0], keys_of(EvalConfig, EVAL_CHOICES, base=ContextKeys))
        if c.batch_size < 1:
            raise ConfigError(f"batch_size={c.batch_size} must be >= 1")
        if c.tasks and c.chats:
            raise ConfigError("tasks and chats are two ways to score: give one of them")
        result = run_tasks(c) if c.tasks else answer_chats(c) if c.chats else evaluate(c)
        if c.tasks or c.chats:
            print(result["table"])
        elif "examples" in result:
            metric = "accuracy" if "accuracy" in result else "exact_match"
            masked = f" ({result['masked_tokens']:,} masked tokens)" if "masked_tokens" in result else ""
            print(f"{result['source']}: {result['examples']:,} examples{masked} | loss {result['loss']:.4f} nats, "
                  f"{metric.replace('_', ' ')} {result[metric]:.4f}" + (" (greedy)" if metric == "exact_match" else ""))
        else:
            print(f"{result['source']}: {result['tokens']:,} tokens, {result['bytes']:,} bytes | loss {result['loss']:.4f} "
                  f"nats/token, perplexity {result['perplexity']:.3f}, {result['bits_per_byte']:.4f} bits per byte"
                  + (f" | accuracy {result['accuracy']:.4f} (argmax = the trained target)" if "accuracy" in result else ""))
        if c.json:
            write_json(c.json, result)
        return result

    return cli_main(command, argv)


if __name__ == "__main__":
    main()
