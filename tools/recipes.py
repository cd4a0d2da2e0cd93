"""
The documented recipes, run as written, each figure compared with the one the documentation states.

  python tools/recipes.py                          # every recipe: about 30 minutes on 2 CPU cores
  python tools/recipes.py chat lora                # some (with the ones they need: chat needs quickstart)
  python tools/recipes.py --input=PATH/input.txt   # offline: Tiny Shakespeare's local copy, as the Quick start's --input
  python tools/recipes.py authors --input=... --tolstoy=PATH/warpeace.txt   # offline, War and Peace's too
  python tools/recipes.py --work=DIR               # where the copy and its runs go (default: a new temporary folder)

Each recipe's commands run in a copy of this checkout (its tracked files as they are now, uncommitted
changes included), so the README's relative paths (out-shakespeare-char-cpu, data/chat_tasks) are used as
written and nothing here is touched. One line per recipe: the figure, the documented one and the
tolerance, pass or FAIL; the exit status is 1 if any failed. Run it before closing any change to training,
data or sampling: a figure the README states is a promise. tests/test_recipes.py keeps the commands
verbatim in the README and runs a fast tier of the chat recipe (a short fine-tune) in the suite.

The tolerances are what moves a figure between the CPUs we measure on (their kernels round otherwise):
the Quick start's val loss by about 0.001 (1.5488-1.5503), the speedrun's first evaluation by about 0.01,
an exact match over the 3,125 held-out conversations (standard error about 0.008) by up to 0.03.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Recipe:
    commands: list  # as the documentation prints them (tests/test_recipes.py holds them to it)
    what: str  # the figure's name
    read: object  # work folder -> the figure (a float)
    source: str  # the file that states the figure
    pattern: str  # a regex whose groups are the stated figure (two: a range)
    tolerance: float
    needs: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # command index -> arguments added (the speedrun's shortening)


def final_val_loss(out_dir):
    return lambda work: [r for r in metrics(work, out_dir) if "val_loss" in r][-1]["val_loss"]


def final_val_accuracy(out_dir):
    return lambda work: [r for r in metrics(work, out_dir) if "val_accuracy" in r][-1]["val_accuracy"]


def val_loss_at(out_dir, step):
    return lambda work: next(r["val_loss"] for r in metrics(work, out_dir) if r.get("iter") == step and "val_loss" in r)


def exact_match(json_path):
    def read(work):
        with open(os.path.join(work, json_path)) as f:
            return json.load(f)["exact_match"]
    return read


def metrics(work, out_dir):
    sys.path.insert(0, ROOT)
    from checkpoint import read_metrics  # (the project's reader; imported here: --help needs no torch)

    return read_metrics(os.path.join(work, out_dir))


RECIPES = {
    "quickstart": Recipe(
        ["python data/shakespeare_char/prepare.py", "python train.py config/train_shakespeare_char_cpu.py"],
        "final val loss", final_val_loss("out-shakespeare-char-cpu"), "README.md", r"val loss (\d\.\d+)-(\d\.\d+)\.", 0.005),
    "chat": Recipe(
        ["python data/chat_tasks/prepare.py --tokenizer_from=out-shakespeare-char-cpu --rl=2000",
         "python train.py config/sft_chat_tasks_cpu.py",
         "python eval.py --out_dir=out-chat-tasks --chats=data/chat_tasks/val.jsonl --json=chat.json"],
        "held-out exact match", exact_match("chat.json"), "README.md", r"held-out exact match: (\d\.\d+)", 0.03,
        needs=["quickstart"]),
    "lora": Recipe(
        ["python train.py config/sft_chat_tasks_cpu.py --lora_rank=8 --learning_rate=1e-2 --out_dir=out-chat-tasks-lora",
         "python eval.py --out_dir=out-chat-tasks-lora --chats=data/chat_tasks/val.jsonl --json=lora.json"],
        "held-out exact match", exact_match("lora.json"), "README.md", r"LoRA's: (\d\.\d+)", 0.03, needs=["chat"]),
    "rl": Recipe(
        ["python rl.py config/rl_chat_tasks_cpu.py",
         "python eval.py --out_dir=out-rl-chat-tasks --chats=data/chat_tasks/val.jsonl --json=rl.json"],
        "held-out exact match after RL", exact_match("rl.json"), "README.md", r"after RL: (\d\.\d+)", 0.03, needs=["chat"]),
    "speedrun": Recipe(
        ["python data/shakespeare_char/prepare.py", "python train.py config/speedrun_shakespeare_char_cpu.py"],
        "val loss at step 400 (its first target: <= 1.886)", val_loss_at("out-speedrun-char-cpu", 400),
        "docs/benchmarks.md", r"\| speedrun: val ≤ 1\.886 \| (\d\.\d+) at", 0.01,
        # its first 400 steps, with the 4000-step schedule's learning rates: the same steps as the whole run's
        extra={1: ["--max_iters=400", "--lr_decay_iters=4000"]}),
    # the other families (README, "Other families"): 360 held-out digits, 2,000 snippets, 500 numbers
    "vit": Recipe(
        ["python data/images/prepare.py digits", "python train.py config/train_vit_digits_cpu.py"],
        "held-out accuracy", final_val_accuracy("out-vit-digits"), "README.md", r"ViT, \d+ s: (\d\.\d+) held out", 0.02),
    "mlm": Recipe(
        ["python data/shakespeare_char/prepare.py", "python train.py config/train_mlm_shakespeare_char_cpu.py"],
        "masked characters' val loss", final_val_loss("out-mlm-shakespeare"), "README.md",
        r"BERT's masked characters, \d+ s: val loss (\d\.\d+)", 0.05),
    "authors": Recipe(
        ["python data/authors/prepare.py", "python train.py config/finetune_authors_cpu.py"],
        "held-out accuracy", final_val_accuracy("out-authors"), "README.md", r"a classifier from it: (\d\.\d+)", 0.02,
        needs=["mlm"]),
    "seq2seq": Recipe(
        ["python data/numbers/prepare.py", "python train.py config/train_seq2seq_cpu.py",
         "python eval.py --out_dir=out-seq2seq --json=seq2seq.json"],
        "greedy exact match", exact_match("seq2seq.json"), "README.md", r"500 held-out numbers: (\d\.\d+)", 0.01),
}
JSON_FLAG = re.compile(r" --json=\S+$")  # what a recipe adds to a documented eval command to read its figure


def documented(recipe):
    """(low, high) of the figure the documentation states (one number: low = high)."""
    with open(os.path.join(ROOT, recipe.source), encoding="utf-8") as f:
        found = re.search(recipe.pattern, f.read())
    if found is None:
        raise SystemExit(f"error: {recipe.source} no longer states the figure /{recipe.pattern}/: update tools/recipes.py")
    values = [float(v) for v in found.groups()]
    return min(values), max(values)


def copy_checkout(work):
    """The checkout's tracked files, as they are in the working tree, into work."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for path in filter(None, listed.split("\0")):
        if os.path.isfile(os.path.join(ROOT, path)):
            os.makedirs(os.path.join(work, os.path.dirname(path)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, path), os.path.join(work, path))


def run_recipe(name, recipe, work, source_text, tolstoy=None):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    for i, command in enumerate(recipe.commands):
        args = shlex.split(command)
        args[0] = sys.executable
        if source_text and args[1:2] == ["data/shakespeare_char/prepare.py"]:
            args.append(f"--input={source_text}")  # the Quick start's documented offline form
        if source_text and args[1:2] == ["data/authors/prepare.py"]:
            args += [f"--shakespeare={source_text}", *([f"--tolstoy={tolstoy}"] if tolstoy else [])]
        args += recipe.extra.get(i, [])
        log = os.path.join(work, "logs", f"{name}-{i + 1}.log")
        os.makedirs(os.path.dirname(log), exist_ok=True)
        print(f"  {name} [{i + 1}/{len(recipe.commands)}]: {' '.join(shlex.quote(a) for a in [command.split()[0], *args[1:]])}",
              flush=True)
        with open(log, "w") as out:
            done = subprocess.run(args, cwd=work, stdout=out, stderr=subprocess.STDOUT, env=env)
        if done.returncode != 0:
            with open(log) as f:
                tail = "".join(f.readlines()[-15:])
            return None, time.perf_counter() - start, f"command {i + 1} exited {done.returncode} ({log}):\n{tail}"
    try:
        return recipe.read(work), time.perf_counter() - start, None
    except (OSError, ValueError, KeyError, IndexError, StopIteration) as e:
        return None, time.perf_counter() - start, f"its figure could not be read ({type(e).__name__}: {e})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipes", nargs="*", help=f"some of {', '.join(RECIPES)} (default: all)")
    parser.add_argument("--input", help="Tiny Shakespeare's text, for a machine without network (the Quick start's --input)")
    parser.add_argument("--tolstoy", help="War and Peace's text, for the authors recipe on a machine without network")
    parser.add_argument("--work", help="the folder for the copy and its runs (default: a new temporary one, kept)")
    args = parser.parse_args(argv)
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        parser.exit(2, f"error: no recipe {', '.join(unknown)}: choose from {', '.join(RECIPES)}\n")
    if args.input and not os.path.isfile(args.input):
        parser.exit(2, f"error: --input={args.input}: no such file\n")
    chosen = set(args.recipes or RECIPES)
    while any(set(RECIPES[name].needs) - chosen for name in chosen):  # and the ones they need
        chosen |= {need for name in chosen for need in RECIPES[name].needs}
    order = [name for name in RECIPES if name in chosen]
    assert all(RECIPES[n].needs == [m for m in RECIPES[n].needs if order.index(m) < order.index(n)] for n in order), \
        "RECIPES must list each recipe after the ones it needs"
    stated = {name: documented(RECIPES[name]) for name in order}  # before hours of work: every figure is still stated
    work = os.path.abspath(args.work or tempfile.mkdtemp(prefix="recipes-"))
    if os.path.exists(work) and os.listdir(work):
        parser.exit(2, f"error: --work={work} is not empty; give a new folder\n")
    copy_checkout(work)
    print(f"recipes {', '.join(order)} in {work}", flush=True)
    lines, failed, broken = [], False, set()
    for name in order:
        recipe = RECIPES[name]
        missing = [need for need in recipe.needs if need in broken]
        if missing:
            broken.add(name)
            line, failed = f"{name:<11} FAIL  not run: it needs {', '.join(missing)}, which did not finish", True
            print(line, flush=True)
            lines.append(line)
            continue
        figure, seconds, error = run_recipe(name, recipe, work, args.input and os.path.abspath(args.input),
                                            args.tolstoy and os.path.abspath(args.tolstoy))
        if error:
            broken.add(name)
        low, high = stated[name]
        want = f"{low:g}" if low == high else f"{low:g}-{high:g}"
        if error:
            line, failed = f"{name:<11} FAIL  {error}", True
        else:
            ok = low - recipe.tolerance <= figure <= high + recipe.tolerance
            failed |= not ok
            line = (f"{name:<11} {'pass' if ok else 'FAIL'}  {recipe.what} {figure:.4f}; {recipe.source} states {want} "
                    f"(± {recipe.tolerance:g}); {seconds:.0f} s")
        print(line, flush=True)
        lines.append(line)
    print("\n" + "\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
