"""
Runs an ablation study: every variant x seed of a study file, through the same code path as train.py,
then a results table and loss curves.

  python ablate.py config/ablations/positions.py [--out_dir=DIR] [--wandb_log=True]
  python ablate.py config/ablations/positions.py --quick=True     its quick form (minutes, to try it out)
  python ablate.py config/ablations/positions.py --max_iters=100 --seeds=1    any smaller form
  python ablate.py --help

Any train.py key on the command line (--max_iters=100, --n_layer=2, --dataset=...) overrides it in every
variant, and --seeds=K keeps the study's first K seeds; such a run goes to its own out_dir
(out-ablations/positions-max_iters100-seeds1), so it never mixes with the full study's runs. --quick=True
applies the study's own `quick` keys (out-ablations/positions-quick): a form that runs in about two minutes
on two CPU cores, to see the study work end to end; its figures are not the study's.

A study file is a Python file that assigns:
  base     = {...}   training and model keys shared by every variant (the budget: max_iters, or tokens)
  variants = {"name": {...}, ...}   each variant's keys on top of base
  seeds    = [1, 2]
  tokens   = 2_000_000   (optional) a token budget instead of max_iters: each variant then runs
                         tokens // (batch_size * block_size * gradient_accumulation_steps) steps
  targets  = [1.8, 1.6]  (optional) also tabulate the steps each variant needs to reach these val losses
  continue_from = {"variant": "earlier variant"}   (optional) the variant starts from the earlier one's
                         final checkpoint (same seed) and resumes with its own keys: a fine-tune, at a longer
                         block_size say (train.py --init_from=resume)
  eval_lengths = [128, 256, 512]   (optional) score every run's final model on the whole val split at each
                         of these contexts (eval.py --block_size), tabulated and plotted as val bits per byte
  eval_as  = {"row": ("variant", {"rope_scaling": "linear", "rope_factor": 4.0})}   (optional) eval_lengths
                         rows of a variant's models run with other RoPE scaling, without training
  axis     = dict(label="key-value pairs", points={"softmax, 4 pairs": ("softmax", 4), ...})   (optional)
                         the variants as series over an x value: a table (series x value) and out_dir/axis.png
                         of final val accuracy (a masked dataset's) or else final val bits per byte
  quick    = dict(batch_size=8, seeds=1)   (optional) the keys of --quick=True, on top of every variant's
                         (seeds: how many of the study's seeds; eval_lengths: the contexts to score)
Every variant's keys are checked before anything trains. A finished run is not run again; an interrupted
one resumes. Results: out_dir/results.md, out_dir/loss_curves.png, out_dir/lengths.png and out_dir/axis.png
(matplotlib). A masked dataset's runs (data/mqar, conversations) also get their final val accuracy, and
labelled examples' runs (images, texts with labels) the accuracy of their last evaluation.
Runs go to out_dir/<variant>/seed<N>, the variant's name lowercased with other characters as "-".
"""

import json
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, fields, replace

from checkpoint import CHECKPOINT, METRICS, ContextKeys, load_checkpoint, read_metrics, tokens_per_step
from configurator import ConfigError, UserError, checked, cli_main, clock_time, keys_of, parse, parse_config, parse_dict, read_config_file
from dataset import is_masked_dataset, read_meta, resolve_dataset
from model import GPT, GPTConfig, model_config
from plot import line_style, pyplot, save, title as figure_title
import train


@dataclass
class AblateConfig:
    out_dir: str = ""  # where runs and results go; default: out-ablations/<study file name>[-<the overrides>]
    seeds: int = 0  # run the study's first K seeds only; 0 = all of them
    quick: bool = False  # the study's quick form (its `quick` keys): minutes, to try it; figures not the study's
    wandb_log: bool = False  # log every run to Weights & Biases (one group per study)
    wandb_project: str = "smallgpt-ablations"


STUDY_KEYS = ("base", "variants", "seeds", "tokens", "targets", "title", "notes", "continue_from", "eval_lengths",
              "eval_as", "quick", "axis")
EVAL_AS_KEYS = [f.name for f in fields(ContextKeys) if f.name != "block_size"]  # eval_lengths sets block_size


def slug(name):
    """A variant's folder name: 'none (NoPE)' -> 'none-nope', '+ RoPE' -> 'rope'."""
    return re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-") or "variant"


def run_dir(root, variant, seed):
    path = os.path.join(root, slug(variant), f"seed{seed}")
    legacy = os.path.join(root, variant, f"seed{seed}")  # runs made before folder names were plain
    return legacy if not os.path.exists(path) and os.path.exists(legacy) else path


def load_study(path, overrides=None, n_seeds=0, quick=False):
    """(runs, study) where runs is [(variant, seed, config, explicit)], every one checked. overrides:
    train keys set on top of every variant; n_seeds: the first n_seeds seeds only (0: all); quick: the
    study's quick keys under the overrides."""
    overrides = overrides or {}
    study = read_config_file(path)
    unknown = set(study) - set(STUDY_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown study keys {sorted(unknown)}; a study assigns {', '.join(STUDY_KEYS)}")
    if quick:
        if not isinstance(study.get("quick"), dict):
            raise ConfigError(f"{path} has no quick form (a `quick = dict(...)`); shrink it with keys instead, e.g. "
                              "--max_iters=100 --seeds=1")
        keys = dict(study["quick"])
        n_seeds = n_seeds or keys.pop("seeds", 0)
        if "eval_lengths" in keys:  # fewer contexts to score (each scores the whole val split)
            study["eval_lengths"] = keys.pop("eval_lengths")
        overrides = {**keys, **overrides}
    if not isinstance(study.get("variants"), dict) or not study["variants"]:
        raise ConfigError(f"{path}: variants must be a non-empty dict of name -> keys")
    seeds = study.get("seeds", [1337])
    if n_seeds > len(seeds):
        raise ConfigError(f"seeds={n_seeds}: {path} has {len(seeds)} seed(s); give at most that many")
    seeds = seeds[: n_seeds or None]
    folders = {}
    for name in study["variants"]:
        if slug(name) in folders:
            raise ConfigError(f"{path}: variants {folders[slug(name)]!r} and {name!r} would share the folder {slug(name)!r}; rename one")
        folders[slug(name)] = name
    keys = train.config_keys()
    runs, notes = [], []
    for name, variant_keys in study["variants"].items():
        try:  # unknown keys and wrong types, with the closest names
            values, explicit = parse_dict(keys, {**study.get("base", {}), **variant_keys, **overrides}, f"variant {name!r}")
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        c = train.TrainConfig(**values)
        if "tokens" in study and "max_iters" not in overrides:
            c = replace(c, max_iters=max(1, study["tokens"] // tokens_per_step(c)))
        try:  # as train.py will run it; the command line (and --quick) chose the overrides
            c = train.fit_defaults(c, explicit, notes, chosen=set(overrides))
            train.check_config(c)
            checked(model_config, c)
        except ConfigError as e:
            raise ConfigError(f"{path}: variant {name!r}: {e}") from None
        for seed in seeds:
            runs.append((name, seed, replace(c, seed=seed), explicit | {"seed", "max_iters"}))
    names = list(study["variants"])
    for name, parent in study.get("continue_from", {}).items():
        if name not in names or parent not in names or names.index(parent) >= names.index(name):
            raise ConfigError(f"{path}: continue_from {name!r}: {parent!r} must be a variant listed before it")
    for row, (variant, keys) in study.get("eval_as", {}).items():
        if variant not in names or set(keys) - set(EVAL_AS_KEYS):
            raise ConfigError(f"{path}: eval_as {row!r}: a variant and keys among {', '.join(EVAL_AS_KEYS)}")
    axis = study.get("axis")
    if axis is not None and not (isinstance(axis, dict) and set(axis) == {"label", "points"}
                                 and all(v in names and isinstance(p, tuple) and len(p) == 2 for v, p in axis["points"].items())):
        raise ConfigError(f"{path}: axis must be dict(label=..., points={{variant: (series, x), ...}}) over its variants")
    return runs, {**study, "seeds": seeds, "fitted": list(dict.fromkeys(notes))}


def finished(c, out_dir):
    """Whether a run of c ended before (a checkpoint at max_iters, or diverged)."""
    ckpt_path = os.path.join(out_dir, CHECKPOINT)
    if os.path.exists(os.path.join(out_dir, "diverged")):
        return True
    return os.path.exists(ckpt_path) and load_checkpoint(ckpt_path, mmap=True)["iter_num"] >= c.max_iters


def run_one(c, explicit, out_dir, wandb, parent=None):
    """Trains one variant x seed (resuming it if it was interrupted; from a copy of parent's final
    checkpoint, a run directory, where given); returns 'done' or 'diverged'."""
    ckpt_path = os.path.join(out_dir, CHECKPOINT)
    marker = os.path.join(out_dir, "diverged")
    if os.path.exists(marker):
        return "diverged"
    if parent and os.path.exists(os.path.join(parent, "diverged")):  # marked too: it is finished, and counts
        os.makedirs(out_dir, exist_ok=True)
        with open(marker, "w") as f:
            f.write(f"not run: the run it continues from diverged ({parent})\n")
        return "diverged"
    if parent and not os.path.exists(ckpt_path):  # the fine-tune starts where the parent ended
        os.makedirs(out_dir, exist_ok=True)
        for name in (METRICS, CHECKPOINT):  # the checkpoint last: a copy cut short leaves none
            shutil.copyfile(os.path.join(parent, name), os.path.join(out_dir, name))
    if os.path.exists(ckpt_path):
        if load_checkpoint(ckpt_path)["iter_num"] >= c.max_iters:
            return "done"
        c = replace(c, init_from="resume")
    c = replace(c, out_dir=out_dir, overwrite=True, **wandb)
    try:
        result = train.train(c, explicit | {"out_dir", "init_from", "overwrite"} | set(wandb))
    except train.NonFinite as e:
        with open(marker, "w") as f:
            f.write(str(e) + "\n")
        return "diverged"
    if result["signal"] is not None:  # Ctrl-C or SIGTERM: the run saved a checkpoint; stop the study too
        print(f"stopped by a signal; run the same command again to continue from {out_dir}")
        sys.exit(128 + result["signal"])
    return "done"


def summarize(runs, root):
    """Per variant: parameters, final and best val loss (mean, std over seeds), tokens/s, diverged, and how
    many of its runs have finished (a run not yet trained, or cut short, counts in none of the figures)."""
    rows = {}
    for name, seed, c, _ in runs:
        out_dir = run_dir(root, name, seed)
        row = rows.setdefault(name, {"final": [], "best": [], "bpb": [], "tps": [], "diverged": 0, "params": None,
                                     "curves": [], "evals": [], "accuracy": [], "runs": 0, "of": 0})
        row["of"] += 1
        if not finished(c, out_dir):
            continue
        row["runs"] += 1
        records = read_metrics(out_dir)
        evals = [r for r in records if "val_loss" in r]
        steps = [r for r in records if "tokens_per_sec" in r]
        if os.path.exists(os.path.join(out_dir, "diverged")):
            row["diverged"] += 1
        elif evals:
            row["final"].append(evals[-1]["val_loss"])
            row["best"].append(min(r["val_loss"] for r in evals))
            if "val_bpb" in evals[-1]:  # comparable across tokenizers, where val loss is not
                row["bpb"].append(evals[-1]["val_bpb"])
            # labelled examples (images, texts): the run's own last evaluation of the whole val split
            accuracy = evals[-1]["val_accuracy"] if "val_accuracy" in evals[-1] else masked_accuracy(out_dir, c)
            if accuracy is not None:
                row["accuracy"].append(accuracy)
        if steps:
            row["tps"].append(statistics.median(r["tokens_per_sec"] for r in steps))
        row["curves"].append([(r["iter"] * tokens_per_step(c), r["val_loss"]) for r in evals])
        row["evals"].append(evals)
        ckpt = os.path.join(out_dir, CHECKPOINT)
        if row["params"] is None and os.path.exists(ckpt):
            row["params"] = GPT(GPTConfig(**load_checkpoint(ckpt, mmap=True)["model_config"])).get_num_params()
    return rows


def cached_score(run_dir, key, compute):
    """compute() of run_dir's final model, kept in run_dir/lengths.json under key: a finished score is not
    computed again (each is written as soon as it exists, so an interrupted study keeps what it scored)."""
    path = os.path.join(run_dir, "lengths.json")
    cache = {}
    if os.path.exists(path):
        with open(path) as f:
            cache = json.load(f)
    if key not in cache:
        cache[key] = compute()
        with open(path, "w") as f:
            json.dump(cache, f, indent=1)
    return cache[key]


def length_scores(run_dir, lengths, keys=None):
    """{length: val bits per byte} of run_dir's final model at each context (eval.py's evaluate, the whole
    val split), keys: RoPE scaling to run it with."""
    import eval as evaluation  # the scoring of eval.py, as train is the training of train.py

    def bits_per_byte(length):
        try:
            return evaluation.evaluate(evaluation.EvalConfig(out_dir=run_dir, block_size=length, **(keys or {})))["bits_per_byte"]
        except UserError:  # it cannot run at this length (learned positions past their table): a "-"
            return None

    return {length: cached_score(run_dir, f"{length} {json.dumps(keys or {}, sort_keys=True)}", lambda: bits_per_byte(length))
            for length in lengths}


def masked_accuracy(run_dir, c):
    """The final model's accuracy on the queried (trained) tokens of its val split, for a masked dataset
    (conversations, data/mqar): eval.py's evaluate; None for a plain one."""
    import eval as evaluation

    if not is_masked_dataset(read_meta(resolve_dataset(c.dataset))) or not os.path.exists(os.path.join(run_dir, CHECKPOINT)):
        return None
    return cached_score(run_dir, "accuracy", lambda: evaluation.evaluate(evaluation.EvalConfig(out_dir=run_dir))["accuracy"])


def length_rows(runs, root, study):
    """row name -> {length: [bpb per seed]} for every variant and eval_as row."""
    lengths = study.get("eval_lengths") or []
    rows = {}
    for name, seed, _, _ in runs:
        folder = run_dir(root, name, seed)
        if os.path.exists(os.path.join(folder, "diverged")):
            continue
        targets = [(name, None)] + [(row, keys) for row, (variant, keys) in study.get("eval_as", {}).items()
                                    if variant == name]
        for row, keys in targets:
            for length, bpb in length_scores(folder, lengths, keys).items():
                scores = rows.setdefault(row, {}).setdefault(length, [])
                if bpb is not None:
                    scores.append(bpb)
    return rows


def write_length_table(rows, lengths):
    lines = ["", "Val bits per byte of the final models at each evaluation context (whole val split, eval.py "
             "--block_size; mean ± std over seeds; - where the model cannot run at that length):", "",
             "| variant | " + " | ".join(f"{n}" for n in lengths) + " |", "| --- |" + " --- |" * len(lengths)]
    for name, by_length in rows.items():
        lines.append(f"| {name} | " + " | ".join(mean_std(by_length[n]) for n in lengths) + " |")
    return lines


def plot_lengths(rows, root, title):
    return plot_series(rows, root, title, "evaluation context (tokens)", "val bits per byte (mean over seeds)", "lengths.png")


def plot_series(series, root, title, xlabel, ylabel, name):
    """{series: {x: [value per seed]}} as one line per series over a log2 x axis, in root/name."""
    plt = pyplot()
    if plt is None or not series:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.2), dpi=100)
    for i, (label, values) in enumerate(series.items()):
        xs = sorted(x for x in values if values[x])
        ax.plot(xs, [statistics.mean(values[x]) for x in xs], marker="o", label=label, linestyle=line_style(i))
    ax.set_xscale("log", base=2)
    ticks = sorted({x for values in series.values() for x in values})
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    figure_title(fig, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save(plt, fig, os.path.join(root, name))


def steps_to_reach(runs, target):
    steps = [next((r["iter"] for r in evals if r["val_loss"] <= target), None) for evals in runs]
    return "-" if not steps or None in steps else f"{statistics.median(steps):g}"


def mean_std(values):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def write_results(rows, root, study, command, n_seeds, lengths=None):
    accuracy = any(row["accuracy"] for row in rows.values())  # a masked dataset's runs (MQAR, conversations)
    columns = ["variant", "parameters", "final val loss", "best val loss", "final val bits per byte",
               *(["final val accuracy"] if accuracy else []), "tokens/s", "diverged"]
    lines = [f"# {study['title']}", "",
             f"`{command}`: {n_seeds} seed(s) per variant; val loss as mean ± std over seeds"
             + ("; accuracy: the argmax on the trained (queried) tokens of the whole val split (eval.py)" if accuracy else "")
             + ".", "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    missing = sum(row["of"] - row["runs"] for row in rows.values())
    if missing:  # written after each run: a study cut short still has its table, with what is missing
        lines[2:2] = [f"**Partial: {missing} of {sum(row['of'] for row in rows.values())} runs not finished yet** (their "
                      "variants are marked; the same command continues the study).", ""]
    for name, row in rows.items():
        tps = f"{statistics.mean(row['tps']):,.0f}" if row["tps"] else "-"
        diverged = f"yes ({row['diverged']}/{n_seeds})" if row["diverged"] else "no"
        if row["runs"] < row["of"]:
            name = f"{name} ({row['runs']} of {row['of']} runs finished)" if row["runs"] else f"{name} (not run yet)"
        params = f"{row['params']:,}" if row["params"] else "-"
        lines.append(f"| {name} | {params} | {mean_std(row['final'])} | {mean_std(row['best'])} | {mean_std(row['bpb'])} "
                     + (f"| {mean_std(row['accuracy'])} " if accuracy else "") + f"| {tps} | {diverged} |")
    if study.get("targets"):
        lines += ["", "Steps to reach a val loss (median over seeds; - where a seed never got there):", "",
                  "| variant | " + " | ".join(f"val <= {t:g}" for t in study["targets"]) + " |",
                  "| --- |" + " --- |" * len(study["targets"])]
        for name, row in rows.items():
            cells = [steps_to_reach(row["evals"], t) for t in study["targets"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if any("max_attn_logit" in r for row in rows.values() for run in row["evals"] for r in run):
        lines += ["", "At the last evaluation (mean over the seeds that did not diverge):", "",
                  "| variant | largest attention logit | mean output log Z |", "| --- | --- | --- |"]
        for name, row in rows.items():
            last = [run[-1] for run in row["evals"] if run and "max_attn_logit" in run[-1]]
            logit = mean_std([r["max_attn_logit"] for r in last]) if last else "-"
            log_z = mean_std([r["mean_log_z"] for r in last]) if last else "-"
            lines.append(f"| {name} | {logit} | {log_z} |")
    if any("induction_score" in r for row in rows.values() for run in row["evals"] for r in run):
        lines += heads_table(rows)
    if study.get("axis"):
        metric, by_series = axis_values(rows, study["axis"])
        xs = sorted({x for values in by_series.values() for x in values})
        lines += ["", f"Final val {metric} (mean ± std over seeds) by {study['axis']['label']}:", "",
                  "| variant | " + " | ".join(f"{x:g}" for x in xs) + " |", "| --- |" + " --- |" * len(xs)]
        for series, values in by_series.items():
            lines.append(f"| {series} | " + " | ".join(mean_std(values.get(x, [])) for x in xs) + " |")
    if lengths:
        lines += write_length_table(lengths, study["eval_lengths"])
    text = "\n".join(lines) + "\n"
    with open(os.path.join(root, "results.md"), "w") as f:
        f.write(text)
    return text


def heads_table(rows):
    """Lines of the heads table (runs with train.py --log_heads): per variant, over its seeds, the best
    induction score at the last evaluation, its largest rise between two evaluations (and where), and the
    in-context score at the end and at its lowest."""
    lines = ["", "Heads (train.py --log_heads, the repeated random-token probe; mean over seeds): the best "
             "induction score at the last evaluation and its largest jump between two evaluations, the "
             "in-context score (second copy's loss - first's, nats):", "",
             "| variant | induction, last | largest rise (at step) | in-context, last | in-context, lowest |",
             "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        scored = [[r for r in run if r.get("induction_score") is not None] for run in row["evals"]]
        scored = [run for run in scored if run]
        if not scored:
            lines.append(f"| {name} | - | - | - | - |")
            continue
        rises = [max(zip(run[1:], run), key=lambda pair: pair[0]["induction_score"] - pair[1]["induction_score"])
                 for run in scored if len(run) > 1]
        rise = (f"{statistics.mean(a['induction_score'] - b['induction_score'] for a, b in rises):+.3f} "
                f"({', '.join(str(a['iter']) for a, _ in rises)})") if rises else "-"
        lines.append(f"| {name} | {mean_std([run[-1]['induction_score'] for run in scored])} | {rise} | "
                     f"{mean_std([run[-1]['icl_score'] for run in scored])} | "
                     f"{mean_std([min(r['icl_score'] for r in run) for run in scored])} |")
    return lines


def axis_values(rows, axis):
    """(metric name, {series: {x: [per seed]}}) of the study's axis: accuracy where the runs have it."""
    accuracy = any(rows[v]["accuracy"] for v in axis["points"] if v in rows)
    by_series = {}
    for variant, (series, x) in axis["points"].items():
        row = rows.get(variant)
        if row is not None:
            by_series.setdefault(series, {})[x] = row["accuracy"] if accuracy else row["bpb"]
    return ("accuracy" if accuracy else "bits per byte"), by_series


def plot_axis(rows, root, study):
    metric, by_series = axis_values(rows, study["axis"])
    return plot_series(by_series, root, study["title"], study["axis"]["label"], f"final val {metric} (mean over seeds)", "axis.png")


def plot(rows, root, title):
    plt = pyplot()
    if plt is None:
        print("matplotlib is not installed: skipped loss_curves.png (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.2), dpi=100)
    for i, (name, row) in enumerate(rows.items()):
        curves = [c for c in row["curves"] if c]
        if not curves:
            continue
        n = min(len(c) for c in curves)  # mean over seeds at the evaluations they share
        xs = [curves[0][i][0] for i in range(n)]
        ys = [statistics.mean(c[i][1] for c in curves) for i in range(n)]
        ax.plot(xs[1:], ys[1:], label=name, linestyle=line_style(i))  # from the first evaluation after step 0
    ax.set_xlabel("training tokens")
    ax.set_ylabel("val loss (mean over seeds)")
    figure_title(fig, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, never over a curve
    return save(plt, fig, os.path.join(root, "loss_curves.png"))


def main(argv=None):
    cli_main(run_study, argv)


def run_study(argv):
    files = [a for a in argv if not a.startswith("-")]
    options = [a for a in argv if a.startswith("-")]
    own_keys = {k.name for k in keys_of(AblateConfig)}
    own = [a for a in options if a in ("-h", "--help") or a[2:].partition("=")[0] in own_keys]
    c, _ = parse_config(AblateConfig, own, "python ablate.py STUDY_FILE [--key=value ...] [--TRAIN_KEY=value ...]",
                        " ".join(__doc__.strip().split("\n\n")[0].split()) + " Any train.py key on the command line "
                        "(--max_iters=100, python train.py --help lists them) overrides every variant.")
    values, explicit = parse(train.config_keys(), [a for a in options if a not in own])  # types, closest names
    overrides = {k: values[k] for k in explicit}
    if c.seeds < 0:
        raise ConfigError(f"seeds={c.seeds} must be >= 0 (0 = all of the study's seeds)")
    if len(files) != 1:
        raise ConfigError("give exactly one study file, e.g. python ablate.py config/ablations/positions.py")
    path = files[0]
    runs, study = load_study(path, overrides, c.seeds, c.quick)
    for note in study["fitted"]:
        print(note, flush=True)
    name = os.path.splitext(os.path.basename(path))[0]
    keys = [f"--{k}={v}" for k, v in overrides.items()] + ([f"--seeds={c.seeds}"] if c.seeds else [])
    suffix = ("-quick" if c.quick else "") + "".join("-" + re.sub(r"[^A-Za-z0-9_.]+", "", arg) for arg in keys)
    shrunk = (["--quick=True"] if c.quick else []) + keys
    root = c.out_dir or os.path.join("out-ablations", name + suffix)
    study["title"] = study.get("title", name) + (f" [shrunk: {' '.join(shrunk)}; figures not the study's]" if shrunk else "")
    command = " ".join(["python ablate.py", path, *shrunk])
    spent, done_work = 0.0, 0  # this invocation's training: seconds over tokens, for the time left
    todo = [not finished(values, run_dir(root, variant, seed)) for variant, seed, values, _ in runs]
    for i, (variant, seed, values, explicit) in enumerate(runs):
        where = f"[{i + 1}/{len(runs)}] {variant} seed {seed}"
        folder = run_dir(root, variant, seed)
        if not todo[i]:
            print(f"{where}: finished earlier ({folder})", flush=True)
            continue
        wandb = {"wandb_log": True, "wandb_project": c.wandb_project,
                 "wandb_run_name": f"{name + suffix}/{slug(variant)}/seed{seed}"} if c.wandb_log else {}
        left = sum(work(r) for r, pending in zip(runs[i:], todo[i:]) if pending)
        print(where + (f" (about {clock_time(spent / done_work * left)} left for the study's {sum(todo[i:])} runs to "
                       "go, from the runs so far)" if done_work else ""), flush=True)
        parent = study.get("continue_from", {}).get(variant)
        started = time.perf_counter()
        try:
            status = run_one(values, explicit, folder, wandb, parent and run_dir(root, parent, seed))
        except UserError as e:
            raise ConfigError(f"variant {variant!r} seed {seed}: {e}") from None
        spent, done_work = spent + time.perf_counter() - started, done_work + work(runs[i])
        print(f"{where}: {status}", flush=True)
        if i + 1 < len(runs):  # the table so far: a study stopped here still has one
            report(runs, root, study, command, final=False)
    print(report(runs, root, study, command, final=True))
    written = [os.path.join(root, name) for name in ("results.md", "loss_curves.png", "lengths.png", "axis.png")]
    print("wrote " + ", ".join(path for path in written if os.path.exists(path)), flush=True)


def work(run):
    """A run's training tokens: what its time is reckoned by."""
    return run[2].max_iters * tokens_per_step(run[2])


def report(runs, root, study, command, final):
    """Writes results.md and the plots from the runs finished so far; returns the table's text. The final
    report also scores every model at the study's eval_lengths (minutes of evaluation: once, at the end)."""
    rows = summarize(runs, root)
    scored = length_rows(runs, root, study) if final and study.get("eval_lengths") else None
    text = write_results(rows, root, study, command, len(study["seeds"]), scored)
    if final or pyplot() is not None:  # (the final one says once if matplotlib is missing)
        plot(rows, root, study["title"])
    if scored:
        plot_lengths(scored, root, study["title"])
    if study.get("axis"):
        plot_axis(rows, root, study)
    return text


if __name__ == "__main__":
    main()
