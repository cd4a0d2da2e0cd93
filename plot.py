"""
Plots training runs from their metrics.jsonl: train and val loss against step and against wall time,
learning rate, gradient norm and tokens/s (and, for runs with train.py --log_heads=True, the induction,
in-context and previous-token scores), several runs overlaid, in one PNG; and a text summary.

  python plot.py out-shakespeare-char-cpu                      -> out-shakespeare-char-cpu/curves.png
  python plot.py out-a out-b out-c --out=compare.png           several runs, one legend
  python plot.py out-rl                                        an rl.py run: held-out exact match (per task),
                                                               pass@k, reward, mixed groups, reply length, entropy

The PNG needs matplotlib (pip install matplotlib); without it the summary is printed alone.
"""

import os
import sys
import textwrap
from types import SimpleNamespace

from checkpoint import CHECKPOINT, CheckpointError, load_checkpoint, read_metrics, tokens_per_step
from configurator import ConfigError, cli_main

STYLES = ("-", "--", ":")  # past matplotlib's 10 default colours, the line style tells runs apart


def pyplot():
    """matplotlib.pyplot drawing to files, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def title(fig, text):
    """A title over the whole figure, wrapped to its width: an axes title is centred over the axes, which
    a legend beside them narrows, so a long one ran off the figure's left edge ("osition schemes")."""
    fig.suptitle(textwrap.fill(text, 90), fontsize=10)


def save(plt, fig, path):
    """Lays the figure out, writes it to path and frees it; returns path."""
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def line_style(i):
    return STYLES[i // 10 % len(STYLES)]


def read_run(out_dir):
    """(steps, evals, tokens per step or None) of one run; an rl.py run's: (steps, evals, "rl")."""
    records = read_metrics(out_dir)
    if not records:
        raise CheckpointError(f"{out_dir}: no metrics.jsonl (or it is empty); give the out_dir of a training run")
    if any("exact_match" in r for r in records):
        return [r for r in records if "reward" in r], [r for r in records if "exact_match" in r], "rl"
    per_step = None
    path = os.path.join(out_dir, CHECKPOINT)
    if os.path.exists(path):
        saved = load_checkpoint(path, mmap=True)["train_config"]  # the configs only: the weights stay on disk
        per_step = tokens_per_step(SimpleNamespace(**saved))
    return [r for r in records if "loss" in r], [r for r in records if "val_loss" in r], per_step


def summary(name, steps, evals, per_step):
    if per_step == "rl":
        first, last = evals[0], evals[-1]
        tasks = [k for k in last if k.startswith("exact_") and k != "exact_match"]
        return (f"{name}: held-out exact match {first['exact_match']:.4f} at step {first['iter']} -> {last['exact_match']:.4f} "
                f"at step {last['iter']} (" + ", ".join(f"{k[6:]} {first.get(k, 0):.3f} -> {last[k]:.3f}" for k in tasks)
                + f"), {last['elapsed']:.0f} s")
    if not evals:
        return f"{name}: {len(steps)} steps logged, no evaluation yet"
    best = min(evals, key=lambda r: r["val_loss"])
    last = evals[-1]
    tokens = f", {last['iter'] * per_step:,} tokens" if per_step else ""
    return (f"{name}: best val {best['val_loss']:.4f} at step {best['iter']}; last val {last['val_loss']:.4f} at step "
            f"{last['iter']}, {last['elapsed']:.0f} s{tokens}")


def draw(runs, path):
    """runs: name -> (steps, evals). One figure, six panels; returns path, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    heads = any("induction_score" in r for _, evals in runs.values() for r in evals)  # train.py --log_heads
    fig, axes = plt.subplots(3 if heads else 2, 3, figsize=(13, 10.5 if heads else 7), dpi=100)
    panels = [  # (axis, records, x key, y key, x label, y label, log y)
        (axes[0, 0], "evals", "iter", "val_loss", "step", "val loss", False),
        (axes[0, 1], "evals", "elapsed", "val_loss", "wall seconds", "val loss", False),
        (axes[0, 2], "steps", "iter", "loss", "step", "train loss (per step)", False),
        (axes[1, 0], "steps", "iter", "lr", "step", "learning rate", False),
        (axes[1, 1], "steps", "iter", "grad_norm", "step", "gradient norm (before clipping)", True),
        (axes[1, 2], "steps", "iter", "tokens_per_sec", "step", "tokens/s", False),
    ]
    if heads:  # under the loss panels: a phase change shows in the loss and these scores at the same steps
        panels += [
            (axes[2, 0], "evals", "iter", "induction_score", "step", "best induction score (probe)", False),
            (axes[2, 1], "evals", "iter", "icl_score", "step", "in-context score (2nd - 1st copy, nats)", False),
            (axes[2, 2], "evals", "iter", "previous_token_score", "step", "best previous-token score", False),
        ]
    for i, (name, (steps, evals)) in enumerate(runs.items()):
        records = {"steps": steps, "evals": evals}
        for ax, kind, x, y, *_ in panels:
            points = [(r[x], r[y]) for r in records[kind] if r.get(y) is not None and x in r]
            if kind == "evals" and y == "val_loss":
                points = points[1:] or points  # step 0's loss (log of the vocabulary) dwarfs the curve
            if points:
                ax.plot(*zip(*points), label=name, linestyle=line_style(i), marker="." if kind == "evals" else None)
    for ax, _, _, _, xlabel, ylabel, log in panels:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    return save(plt, fig, path)


RL_PANELS = [  # rl.py's runs: (records, y key, y label, log y); "exact_*": one line per task
    ("evals", "exact_match", "held-out exact match (greedy)", False),
    ("evals", "pass_at_k", "held-out pass@k (sampled)", False),
    ("steps", "reward", "mean reward of the step's samples", False),
    ("steps", "mixed", "fraction of mixed groups", False),
    ("steps", "reply_tokens", "mean reply length (tokens)", False),
    ("steps", "entropy", "policy entropy on the replies (nats)", False),
    ("evals", "exact_*", "held-out exact match per task", False),
    ("steps", "grad_norm", "gradient norm (before clipping)", True),
    ("steps", "kl", "KL to the starting model (k3)", False),
]


def draw_rl(runs, path):
    """draw() for rl.py's runs: nine panels against the step."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(3, 3, figsize=(13, 10.5), dpi=100)
    for ax, (kind, y, label, log) in zip(axes.flat, RL_PANELS):
        for i, (name, (steps, evals)) in enumerate(runs.items()):
            records = steps if kind == "steps" else evals
            keys = sorted({k for r in records for k in r if k.startswith("exact_") and k != "exact_match"}) if y == "exact_*" else [y]
            for key in keys:
                points = [(r["iter"], r[key]) for r in records if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), label=f"{name}: {key[6:]}" if y == "exact_*" else name, linestyle=line_style(i),
                            marker="." if kind == "evals" else None)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if log:
            ax.set_yscale("log")
        if y in ("exact_match", "exact_*"):
            ax.legend(fontsize=7)
    return save(plt, fig, path)


def main(argv=None):
    cli_main(plot_runs, argv)


def plot_runs(argv):
    if not argv or "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    outs = [a[len("--out=") :] for a in argv if a.startswith("--out=")]
    unknown = [a for a in argv if a.startswith("-") and not a.startswith("--out=")]
    dirs = [a for a in argv if not a.startswith("-")]
    if unknown or not dirs:
        raise ConfigError("usage: python plot.py OUT_DIR [OUT_DIR ...] [--out=FILE.png]"
                          + (f" (unknown: {' '.join(unknown)})" if unknown else ""))
    names = [os.path.basename(os.path.normpath(d)) or d for d in dirs]
    if len(set(names)) < len(names):  # two runs named alike (a/out, b/out): label them by the path given
        names = [f"{d} ({i + 1})" if dirs.count(d) > 1 else d for i, d in enumerate(dirs)]
    loaded = {name: read_run(d) for name, d in zip(names, dirs)}
    rl = {per_step == "rl" for _, _, per_step in loaded.values()}
    if len(rl) > 1:
        raise ConfigError("rl.py's runs and training runs log different things: plot them separately")
    for name, (steps, evals, per_step) in loaded.items():
        print(summary(name, steps, evals, per_step))
    path = outs[-1] if outs else os.path.join(dirs[0], "curves.png")
    if (draw_rl if rl == {True} else draw)({name: (steps, evals) for name, (steps, evals, _) in loaded.items()}, path) is None:
        print("matplotlib is not installed: printed the summary only (pip install matplotlib for the PNG)")
    else:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
