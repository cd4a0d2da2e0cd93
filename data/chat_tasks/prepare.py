"""Conversations made from Tiny Shakespeare, for fine-tuning the Quick start's character model to chat.

  python data/chat_tasks/prepare.py --tokenizer_from=out-shakespeare-char-cpu
  python train.py config/sft_chat_tasks_cpu.py                    # full fine-tuning (or --lora_rank=8)
  python eval.py --out_dir=out-chat-tasks --chats=data/chat_tasks/val.jsonl
  python chat.py --out_dir=out-chat-tasks --temperature=0

Five tasks, all in the characters Tiny Shakespeare has (it has one digit, so numbers are words):
  speaker   "Who says: <a line>"                -> its speaker, as the play names them ("ROMEO")
  reverse   "reverse <word>"                     -> the word backwards
  shout     "shout <two words>"                  -> them in capitals
  add       "<number> plus <number>"             -> the sum (zero to eighteen)
  count     "count the words: <a line>"          -> how many (two to nine)
A third of the conversations open with a system turn, a quarter of the training ones hold two exchanges.
Held out for val (625 conversations per task by default): lines from the text's last tenth (speaker,
count), a tenth of the words (reverse, shout), 20 of the 100 sums (add). The next line of a speech is not a
task: on held-out text its exact match is about 0 for any model of this size, so it would measure nothing.

Writes train.jsonl and val.jsonl here (a "task" field beside "messages": what eval.py --chats scores per
task) and, with --tokenizer_from, the dataset data/chat_tasks that train.py reads (data/prepare.py's).
--rl=N also writes rl.jsonl: prompts for reinforcement learning whose questions come from the training
pools but no training conversation asks them (the same train and val files with it or without).
"""

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from checkpoint import run_tokenizer  # noqa: E402
from configurator import UserError, fail  # noqa: E402
from dataset import fetch_text, prepare_conversations  # noqa: E402

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
QUICK_START = os.path.join(HERE, "..", "shakespeare_char")  # the Quick start's dataset: its text, or where it came from
NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
           "seventeen eighteen").split()
SYSTEM = "Answer in as few words as you can."


def quick_start_text():
    """The Quick start's Tiny Shakespeare, offline too: the copy its prepare downloaded, else the file its
    --input named (recorded in the dataset's meta.json); None when neither is there."""
    downloaded = os.path.join(QUICK_START, "input.txt")
    if os.path.exists(downloaded):
        return downloaded
    try:
        with open(os.path.join(QUICK_START, "meta.json")) as f:
            source = json.load(f).get("source")
    except (OSError, ValueError):
        return None
    return source if isinstance(source, str) and os.path.exists(source) else None


def speeches(text):
    """[(speaker, [lines])] of a play's text: a "NAME:" line, then its lines up to a blank one."""
    out = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if len(lines) >= 2 and lines[0].endswith(":") and 0 < len(lines[0]) < 30:
            out.append((lines[0][:-1], lines[1:]))
    return out


def make_tasks(text, rng, n_train, n_val, n_rl=0):
    """(train, val, rl): lists of {"task", "messages"}; rl (n_rl, drawn after the others, so that they are
    the same with it or without) asks, from the training pools, only questions no training conversation asks
    (RL rewards what a fine-tune has not seen; a task whose pool the training set exhausts gets none)."""
    cut = int(len(text) * 0.9)
    parts = {"train": speeches(text[:cut]), "val": speeches(text[cut:])}
    common = {s for s, _ in parts["train"]}  # speakers of val lines must be ones training has seen
    lines = {split: [(s, line) for s, ls in sp for line in ls if 3 <= len(line.split()) <= 9 and len(line) <= 48
                     and (split == "train" or s in common)] for split, sp in parts.items()}
    words = sorted({w for w in text.lower().split() if w.isalpha() and 3 <= len(w) <= 7})
    rng.shuffle(words)
    held = max(1, len(words) // 10)
    vocab = {"val": words[:held], "train": words[held:]}
    sums = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(sums)
    pairs = {"val": sums[:20], "train": sums[20:]}

    def exchange(task, split):
        if task == "speaker":
            speaker, line = rng.choice(lines[split])
            return f"Who says: {line}", speaker
        if task == "reverse":
            word = rng.choice(vocab[split])
            return f"reverse {word}", word[::-1]
        if task == "shout":
            a, b = rng.choice(vocab[split]), rng.choice(vocab[split])
            return f"shout {a} {b}", f"{a} {b}".upper()
        if task == "add":
            a, b = rng.choice(pairs[split])
            return f"{NUMBERS[a]} plus {NUMBERS[b]}", NUMBERS[a + b]
        _, line = rng.choice(lines[split])
        return f"count the words: {line}", NUMBERS[len(line.split())]

    tasks = ("speaker", "reverse", "shout", "add", "count")
    out = {}
    for split, n in (("train", n_train), ("val", n_val)):
        conversations = []
        for i in range(n):
            task = tasks[i % len(tasks)]
            messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
            if split == "train" and rng.random() < 0.25:  # an earlier exchange, of any task
                question, answer = exchange(rng.choice(tasks), split)
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            question, answer = exchange(task, split)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            conversations.append({"task": task, "messages": messages})
        out[split] = conversations
    asked = {m["content"] for c in out["train"] for m in c["messages"] if m["role"] == "user"}
    rl, open_tasks = [], list(tasks)
    while len(rl) < n_rl and open_tasks:
        task = open_tasks[len(rl) % len(open_tasks)]
        for _ in range(1000):  # a fresh question, or the task's pool is spent
            question, answer = exchange(task, "train")
            if question not in asked:
                break
        else:
            open_tasks.remove(task)
            continue
        asked.add(question)
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
        rl.append({"task": task, "messages": messages + [{"role": "user", "content": question},
                                                         {"role": "assistant", "content": answer}]})
    return out["train"], out["val"], rl


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="Tiny Shakespeare's text (default: the Quick start's, downloaded or its --input, else a download)")
    parser.add_argument("--tokenizer_from", help="the base run whose tokenizer the dataset uses (the Quick start's out_dir)")
    parser.add_argument("--out_dir", default=HERE, help="where train.jsonl, val.jsonl and the dataset go")
    parser.add_argument("--train", type=int, default=20_000, help="training conversations")
    parser.add_argument("--val", type=int, default=3125, help="held-out conversations: 625 per task, so one task's exact "
                        "match has a standard error of at most 0.02 (--train=5000 --val=250 makes the sets of before)")
    parser.add_argument("--rl", type=int, default=0, help="also rl.jsonl: this many prompts for reinforcement learning, "
                        "questions from the training pools that no training conversation asks (its answer is the last turn)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        text = fetch_text(args.input or quick_start_text(), URL, os.path.join(HERE, "input.txt"))
        if args.rl < 0:
            raise UserError(f"--rl={args.rl}: give a number of prompts >= 0")
        train, val, rl = make_tasks(text, random.Random(args.seed), args.train, args.val, args.rl)
        os.makedirs(args.out_dir, exist_ok=True)
        for name, conversations in (("train", train), ("val", val)) + ((("rl", rl),) if args.rl else ()):
            with open(os.path.join(args.out_dir, f"{name}.jsonl"), "w") as f:
                f.writelines(json.dumps(c) + "\n" for c in conversations)
        print(f"{len(train):,} train and {len(val):,} val conversations -> {args.out_dir}/{{train,val}}.jsonl")
        if args.rl:
            per_task = {t: sum(c["task"] == t for c in rl) for t in dict.fromkeys(c["task"] for c in train)}
            print(f"{len(rl):,} RL prompts no training conversation asks -> {args.out_dir}/rl.jsonl ("
                  + ", ".join(f"{t} {n}" for t, n in per_task.items()) + ")")
        if args.tokenizer_from:
            stats = prepare_conversations([c["messages"] for c in train], run_tokenizer(args.tokenizer_from), args.out_dir,
                                          val=[c["messages"] for c in val])
            print(f"dataset: {stats['train']['trained_tokens']:,} trained tokens in train, longest conversation "
                  f"{max(s['longest'] for s in stats.values())} tokens -> {args.out_dir}")
    except UserError as e:  # DataError, or a checkpoint's error for --tokenizer_from
        fail(e)


if __name__ == "__main__":
    main()
