"""
Looks inside a trained model: its attention maps for a prompt, and per-head scores on a standard probe.

  python interpret.py --out_dir=out-shakespeare-char-cpu --start="ROMEO: O Romeo, Romeo!"   -> out_dir/attention.png
  python interpret.py --out_dir=out-shakespeare-char-cpu --start=FILE:prompt.txt --layer=1 --head=2
  python interpret.py --out_dir=out-shakespeare-char-cpu --scores=True --json=heads.json
  python interpret.py --out_dir=out-shakespeare-char-cpu --probe=True --layer=1 --head=0   the probe's maps
  python interpret.py --out_dir=out-vit-digits --image=3      a vision transformer: held-out image 3

The maps are the softmax weights the model computed in its forward pass (layers x heads; the causal mask's
hidden half, and keys outside a sliding window, in grey; linear-attention layers have no such weights and
say so). Attention weights show where a head read from, not why the model predicted what it did (Jain and
Wallace 2019).

--scores runs the probe of Olsson et al. (2022), "In-context learning and induction heads": rows of n
distinct random tokens, each row repeated twice. Per head, averaged over rows:
  previous   attention from each token to the one before it (a previous-token head);
  duplicate  attention from each token of the second copy to its earlier occurrence;
  induction  attention from each token of the second copy to the token after its earlier occurrence:
             the pattern of an induction head (Olsson et al.'s prefix matching), 1 at best, about
             1/position for uniform attention;
  copying    whether the head's output raises the logit of the token it attends to: sum(eig)/sum(|eig|) of
             its token-to-logit matrix W_U W_O W_V W_E (norms ignored), +1 copies, -1 suppresses.
and for the model, the in-context learning score: the mean loss on the second copy minus the mean loss on
the first (below 0: the model uses the first copy; a model without induction heads stays near 0).

A vision transformer (image_size > 0): the class token's attention over the patches of one held-out image
of its dataset, per layer and head, and each head's mean attention distance by layer over the first
--images held-out images (probes.image_attention; the locality the chapter describes: lower layers hold
heads that look nearby beside heads that look across the whole image).
"""

import os
from dataclasses import dataclass
from typing import Optional


import torch

from checkpoint import load_any
from configurator import ConfigError, command_line, read_prompt
from dataset import write_json
from probes import attention_maps, default_probe_len, head_scores, image_attention, probe_tokens


@dataclass
class InterpretConfig:
    out_dir: str = "out"  # the training run's directory (init_from=resume)
    init_from: str = "resume"  # resume (out_dir/ckpt.pt) | a Hugging Face model directory | gpt2 ...
    start: str = "\n"  # the prompt whose attention to draw (\n, \t, \\ as in sample.py), or FILE:path
    probe: bool = False  # draw the maps on the first row of the --scores probe instead of --start
    layer: Optional[int] = None  # draw this layer only (0-based); None = every layer
    head: Optional[int] = None  # draw this head only, full size (with --layer); None = every head
    png: str = ""  # where the maps go; "" = attention.png in the run's folder (in this folder for --init_from)
    scores: bool = False  # per-head scores on the repeated random-token probe instead of maps
    probe_len: int = 0  # tokens in each copy of the probe; 0 = min(64, block_size // 2, vocab_size)
    probe_rows: int = 16  # probe rows (each its own random tokens)
    seed: int = 0  # the probe's random tokens
    json: str = ""  # also write the scores here as JSON
    image: int = 0  # a vision transformer: the held-out image (of its dataset's val split) to draw
    images: int = 100  # a vision transformer: held-out images the mean attention distances average over


# ----------------------------------------------------------------------------------------------------
# Scores


def scores_table(s):
    lines = [f"probe: {s['probe_len']} distinct random tokens, twice; uniform attention's induction score "
             f"{s['chance']:.3f}",
             f"in-context learning score {s['icl']:+.3f} nats (second copy {s['loss_second']:.3f} - first "
             f"{s['loss_first']:.3f})", "",
             "layer head  previous  duplicate  induction  copying"]
    for layer, row in enumerate(s["copying"]):
        for head, copying in enumerate(row):
            att = [s[k][layer] for k in ("previous", "duplicate", "induction")]
            cells = "  ".join("   linear" if a is None else f"{a[head]:9.3f}" for a in att)
            lines.append(f"{layer:5d} {head:4d} {cells}  {copying:+7.3f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Drawing


def token_labels(tokenizer, ids):
    labels = []
    for i in ids:
        text = tokenizer.decode([i])
        labels.append(text.replace("\n", "\\n").replace("\t", "\\t") if text.strip() else repr(text)[1:-1] or "·")
    return labels


def draw(maps, labels, path, layer=None, head=None):
    """The maps as a grid (layers x heads), or one map; grey where the mask hid a key."""
    from plot import pyplot, save

    plt = pyplot()
    if plt is None:
        raise ConfigError("the maps need matplotlib (pip install matplotlib); --scores=True prints text without it")
    layers = [layer] if layer is not None else list(range(len(maps)))
    n_head = next((m[0].size(0) for m in maps if m is not None), 1)
    heads = [head] if head is not None else list(range(n_head))
    single = len(layers) == len(heads) == 1
    size = 7 if single else 2.2
    fig, axes = plt.subplots(len(layers), len(heads), figsize=(size * len(heads) + 0.6, size * len(layers)),
                             squeeze=False)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d0d0d0")
    show_labels = len(labels) <= (60 if single else 24)
    image = None
    for r, l in enumerate(layers):
        for c, h in enumerate(heads):
            ax = axes[r][c]
            ax.set_title(f"layer {l}, head {h}", fontsize=9 if not single else 11)
            if maps[l] is None:
                ax.text(0.5, 0.5, "linear attention:\nno softmax weights", ha="center", va="center", fontsize=8)
                ax.set_xticks([]), ax.set_yticks([])
                continue
            weights, hidden = maps[l]
            image = ax.imshow(weights[h].masked_fill(hidden[h], float("nan")).cpu().numpy(), cmap=cmap, vmin=0,
                              vmax=1, interpolation="nearest")
            if show_labels:
                ticks = range(len(labels))
                ax.set_xticks(ticks, labels, rotation=90, fontsize=6 if not single else 8)
                ax.set_yticks(ticks, labels, fontsize=6 if not single else 8)
            else:
                ax.set_xticks([]), ax.set_yticks([])
            if single:
                ax.set_xlabel("key (attended to)"), ax.set_ylabel("query")
    if single and image is not None:
        fig.colorbar(image, ax=axes[0][0], fraction=0.046, pad=0.04)
    fig.suptitle("attention weights (rows: queries, columns: the keys they read; grey: hidden by the mask)",
                 fontsize=10 if single else 9)
    return save(plt, fig, path)


# ----------------------------------------------------------------------------------------------------
# Command line


def look_at_images(c, model, state):
    """A vision transformer's class-token maps for one held-out image, and its heads' mean attention distances."""
    from labeled import ImageSampler
    from dataset import resolve_dataset

    if state is None:
        raise ConfigError("a vision transformer's maps are drawn on its run's dataset: give --out_dir of a training run")
    sampler = ImageSampler(resolve_dataset(state["train_config"]["dataset"]), "val", 0)
    n = len(sampler.labels)
    if not 0 <= c.image < n or c.images < 1:
        raise ConfigError(f"image={c.image} must be in [0, {n - 1}] (the held-out images) and images={c.images} >= 1")
    pixels = sampler.images[: min(c.images, n)]
    _, distances = image_attention(model, pixels)
    maps, _ = image_attention(model, sampler.images[c.image : c.image + 1])
    side, patch = model.config.image_size // model.config.patch_size, model.config.patch_size
    grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(-1, 2).float()
    uniform = float(torch.cdist(grid, grid).mean()) * patch
    lines = [f"mean attention distance in pixels (patch centres, {len(pixels)} held-out images; the image is "
             f"{model.config.image_size} pixels wide; uniform attention: {uniform:.2f})", "layer  " + "  ".join(f"head {h}" for h in range(distances.size(1)))]
    lines += [f"{layer:5d}  " + "  ".join(f"{d:6.2f}" for d in row.tolist()) for layer, row in enumerate(distances)]
    print("\n".join(lines))
    from plot import pyplot, save

    plt = pyplot()
    if plt is None:
        return distances
    layers, heads = len(maps), maps[0].size(0)
    fig, axes = plt.subplots(layers, heads + 1, figsize=(1.8 * (heads + 1), 1.8 * layers), squeeze=False)
    image = sampler.images[c.image].permute(1, 2, 0).squeeze(-1).numpy()
    for r in range(layers):
        axes[r][0].imshow(image, cmap="gray" if image.ndim == 2 else None)
        axes[r][0].set_title(f"label {int(sampler.labels[c.image])}" if r == 0 else "", fontsize=8)
        for h in range(heads):
            axes[r][h + 1].imshow(maps[r][h, 0].numpy(), cmap="viridis")
            axes[r][h + 1].set_title(f"layer {r} head {h}: {distances[r, h]:.1f} px", fontsize=7)
        for ax in axes[r]:
            ax.set_xticks([]), ax.set_yticks([])
    fig.suptitle("the class token's attention over the patches (each head's mean attention distance)", fontsize=9)
    png = c.png or os.path.join(c.out_dir, "attention.png")
    print(f"wrote {save(plt, fig, png)}: held-out image {c.image}, every layer and head")
    return distances


def interpret(c):
    model, tokenizer, state = load_any(c.out_dir if c.init_from == "resume" else c.init_from)
    model.eval()
    config = model.config
    if config.image_size:
        return look_at_images(c, model, state)
    if c.scores and config.family != "decoder":
        raise ConfigError("--scores is the induction-head probe of a decoder (causal next-token logits); this model is "
                          f"family={config.family!r}")
    if config.family == "encoder-decoder":
        raise ConfigError("interpret.py draws one stack's self-attention over a prompt; an encoder-decoder's two stacks "
                          "and its cross-attention are not drawn here")
    if c.scores:
        s = head_scores(model, c.probe_len or None, c.probe_rows, c.seed)
        print(scores_table(s))
        if c.json:
            write_json(c.json, s)
            print(f"wrote {c.json}")
        return s
    for key, value, limit in (("layer", c.layer, config.n_layer), ("head", c.head, config.n_head)):
        if value is not None and not 0 <= value < limit:
            raise ConfigError(f"{key}={value} does not exist: the model has {limit} {key}s, 0 to {limit - 1}")
    if c.head is not None and c.layer is None:
        raise ConfigError("head=... draws one map: give --layer too")
    if c.probe:
        ids = probe_tokens(config.vocab_size, c.probe_len or default_probe_len(config), 1, c.seed)[0].tolist()
    else:
        ids = tokenizer.encode(read_prompt(c.start))
    if not ids:
        raise ConfigError("the prompt is empty; give some text with --start")
    limit = config.context_limit
    if limit is not None and len(ids) > limit:
        raise ConfigError(f"the prompt is {len(ids)} tokens, longer than the model's context (block_size={limit}); shorten it")
    _, maps = attention_maps(model, ids)
    if c.layer is not None and maps[c.layer] is None:
        raise ConfigError(f"layer {c.layer} is a linear-attention layer: it has no softmax weights to draw")
    png = c.png or (os.path.join(c.out_dir, "attention.png") if c.init_from == "resume" else "attention.png")
    path = draw(maps, token_labels(tokenizer, ids), png, c.layer, c.head)
    print(f"wrote {path}: {len(ids)} tokens, " + ("every layer and head" if c.layer is None else
          f"layer {c.layer}" + ("" if c.head is None else f", head {c.head}")))
    return maps


main = command_line(InterpretConfig, "python interpret.py --out_dir=DIR [--start=TEXT] [--scores=True]",
                    __doc__.strip().splitlines()[0], interpret)


if __name__ == "__main__":
    main()
