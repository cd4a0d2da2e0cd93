"""
Proves that a refactoring changed no behaviour: record a fixed scenario before, record it again after,
compare the two.

  python tools/behaviour.py record DIR       a 120-step run with dropout, samples, --help texts -> DIR
  python tools/behaviour.py compare OLD NEW  weights and losses bit for bit, texts equal, help diffs shown

The scenario: a 2-layer character model trained 120 steps on generated verse (fp32, CPU, dropout 0.1),
then sample.py with a fixed seed from its checkpoint with fp32, bf16 and int8 weights, and speculative
decoding (greedy and sampled) with prompt lookup and with a 1-layer draft trained 10 steps. Two more
models cover the other kinds of attention: a sliding-window + linear one (SR, RoPE: its caches are bounded,
so its 60-token samples run past block_size=32 through them) trained 40 steps and sampled with the three
weight formats, and a window + full one (SL) trained 20 steps, sampled and decoded speculatively with both
drafts (its window cache rolls back). Timing fields (elapsed, tokens/s, ms/step, MFU) differ between any
two runs and are left out.
"""

import difflib
import json
import os
import random
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("elapsed", "tokens_per_sec", "ms_per_iter", "mfu")
TRAIN = ["--max_iters=120", "--dropout=0.1", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
         "--batch_size=4", "--eval_interval=40", "--eval_iters=2", "--log_interval=1", "--warmup_iters=5",
         "--learning_rate=3e-3", "--min_lr=3e-4", "--dtype=float32", "--device=cpu"]  # fmt: skip
WEIGHTS = ("float32", "bfloat16", "int8")
DRAFTS = ("ngram", "model")
KINDS = {"window_linear": ["--attn_pattern=SR", "--attn_window=8", "--pos_emb=rope", "--max_iters=40"],
         "window_full": ["--attn_pattern=SL", "--attn_window=8", "--max_iters=20"]}  # fmt: skip
HELP = ("train.py", "sample.py", "bench.py", "export.py", "eval.py", "ablate.py", "plot.py")


def verse(n_chars, seed=0):
    rng = random.Random(seed)
    words = "the king queen lord speak thou hath love death night day fair sweet noble heart crown war".split()
    text = ""
    while len(text) < n_chars:
        text += " ".join(rng.choice(words) for _ in range(rng.randint(3, 8))).capitalize() + ".\n"
    return text[:n_chars]


def run(*args):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"})
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(args[:2])} failed:\n{result.stderr[-2000:]}")
    return result.stdout


def sample_weights_key():
    """sample.py's key for the inference weight format (renamed dtype -> weights_dtype)."""
    return "weights_dtype" if "--weights_dtype" in run("sample.py", "--help") else "dtype"


def record(out):
    sys.path.insert(0, ROOT)
    from dataset import prepare_text
    from tokenizer import char_tokenizer_for

    os.makedirs(out, exist_ok=True)
    text = verse(30_000)
    data = os.path.join(out, "data")
    prepare_text(text, char_tokenizer_for(text), data)
    run_dir = os.path.join(out, "run")
    run("train.py", *TRAIN, f"--dataset={data}", f"--out_dir={run_dir}", "--overwrite=True")
    draft_dir = os.path.join(out, "draft")
    run("train.py", *TRAIN, "--n_layer=1", "--max_iters=10", f"--dataset={data}", f"--out_dir={draft_dir}",
        "--overwrite=True")
    key = sample_weights_key()
    common = (f"--out_dir={run_dir}", "--seed=7", "--num_samples=2", "--max_new_tokens=60", "--start=The king",
              "--device=cpu")
    texts = {w: run("sample.py", *common, f"--{key}={w}") for w in WEIGHTS}
    speculative = {f"{d} t={t}": run("sample.py", *common, f"--draft={draft_dir if d == 'model' else d}",
                                     f"--temperature={t}") for d in DRAFTS for t in (0, 0.8)}
    for name, keys in KINDS.items():
        kind_dir = os.path.join(out, name)
        run("train.py", *TRAIN, *keys, f"--dataset={data}", f"--out_dir={kind_dir}", "--overwrite=True")
        kind_common = (f"--out_dir={kind_dir}", *common[1:])
        texts.update({f"{name} {w}": run("sample.py", *kind_common, f"--{key}={w}") for w in WEIGHTS})
        if name == "window_full":  # linear layers cannot roll back, so only this one decodes speculatively
            speculative.update({f"{name} {d} t={t}": run("sample.py", *kind_common, f"--draft={draft_dir if d == 'model' else d}",
                                                         f"--temperature={t}") for d in DRAFTS for t in (0, 0.8)})
    helps = {script: run(script, "--help") for script in HELP}
    with open(os.path.join(out, "texts.json"), "w") as f:
        json.dump({"samples": texts, "speculative": speculative, "help": helps}, f, indent=1)
    print(f"recorded -> {out}")


def compare(old, new):
    problems = []
    runs = ["run"] + [name for name in KINDS if os.path.isdir(os.path.join(old, name))]
    n_metrics = n_weights = 0
    for name in runs:
        metrics = []
        for d in (old, new):
            with open(os.path.join(d, name, "metrics.jsonl")) as f:
                metrics.append([{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f])
        added = sorted({k for record in metrics[1] for k in record} - {k for record in metrics[0] for k in record})
        if added:
            print(f"new metrics.jsonl keys in {name} (not compared): {', '.join(added)}")
        if len(metrics[0]) != len(metrics[1]) or any(a != {k: b[k] for k in a if k in b} or a.keys() - b.keys()
                                                     for a, b in zip(*metrics)):
            problems.append(f"{name}/metrics.jsonl differs")
        weights = [torch.load(os.path.join(d, name, "ckpt.pt"), weights_only=True)["model"] for d in (old, new)]
        if weights[0].keys() != weights[1].keys():
            problems.append(f"{name}: checkpoint weights have other names")
        else:
            problems += [f"{name}: weight {k} differs" for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])]
        n_metrics, n_weights = n_metrics + len(metrics[0]), n_weights + len(weights[0])
    texts = []
    for d in (old, new):
        with open(os.path.join(d, "texts.json")) as f:
            texts.append(json.load(f))
    problems += [f"sample text ({name}) differs" for name in texts[0]["samples"]
                 if texts[0]["samples"][name] != texts[1]["samples"].get(name)]
    problems += [f"speculative sample text ({name}) differs" for name in texts[0].get("speculative", {})
                 if texts[0]["speculative"][name] != texts[1]["speculative"].get(name)]
    for script in texts[0]["help"]:
        diff = list(difflib.unified_diff(texts[0]["help"][script].splitlines(), texts[1]["help"].get(script, "").splitlines(),
                                         f"old {script} --help", f"new {script} --help", lineterm="", n=0))
        if diff:
            print("\n".join(diff))
    n_texts = len(texts[0]["samples"]) + len(texts[0].get("speculative", {}))
    print(f"{n_metrics} metrics lines, {n_weights} weight tensors ({', '.join(runs)}), {n_texts} sample texts compared")
    if problems:
        sys.exit("BEHAVIOUR CHANGED: " + "; ".join(problems))
    print("same behaviour: weights and losses bit for bit, sample texts identical (help diffs above, if any)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        record(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__.strip())
