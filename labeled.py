"""
Labelled examples for the encoder and encoder-decoder families (GPTConfig.family): images with classes (a
vision transformer), texts with labels (a classifier), source/target texts (an encoder-decoder), and
BERT's masked tokens made from a text dataset: preparing them and drawing their batches.

Images.

A prepared folder holds meta.json ("tokenizer": {"kind": "images", ...}: the classes, the image shape and
how pixels were scaled) and, per split, {split}_images.npy (float32, N x channels x size x size, already
scaled) and {split}_labels.npy (int64). Sources: scikit-learn's bundled digits (offline: 1,797 8x8 images,
pixels / 16, the last 360 held out), a folder of the user's (one subfolder per class, resized, pixels / 255)
and CIFAR-10 from the Hugging Face Hub (online). ImageSampler draws examples from its own seeded generator
(its state goes into checkpoints, as BatchSampler's), with random shifts as augmentation; evaluation reads
a split in order (ordered()).
"""

import json
import os

import numpy as np
import torch

from configurator import DataError
from dataset import atomic_write, read_meta, write_json
from tokenizer import EncoderTokenizer, encoder_tokenizer, source_ids

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def is_image_dataset(meta):
    return meta.get("tokenizer", {}).get("kind") == "images"


def write_images(out_dir, splits, classes, rescale, source):
    """Writes {split}_images.npy, {split}_labels.npy and meta.json from {split: (images, labels)}."""
    os.makedirs(out_dir, exist_ok=True)
    for split, (images, labels) in splits.items():
        atomic_write(os.path.join(out_dir, f"{split}_images.npy"), lambda f, a=images: np.save(f, a.astype(np.float32)))
        atomic_write(os.path.join(out_dir, f"{split}_labels.npy"), lambda f, a=labels: np.save(f, a.astype(np.int64)))
    images = splits["train"][0]
    meta = {"kind": "images", "classes": [str(c) for c in classes], "channels": int(images.shape[1]),
            "image_size": int(images.shape[2]), "rescale": rescale}
    write_json(os.path.join(out_dir, "meta.json"), {"vocab_size": 1, "tokenizer": meta, "source": source,
                                                     "examples": {s: int(len(l)) for s, (_, l) in splits.items()}})
    return meta


def digits(val=360):
    """scikit-learn's bundled handwritten digits (no network): 1 x 8 x 8, pixels 0..16 scaled to 0..1."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the digits come with scikit-learn: pip install scikit-learn") from None
    data = load_digits()
    images = (data.images / 16.0)[:, None].astype(np.float32)
    return {"train": (images[:-val], data.target[:-val]), "val": (images[-val:], data.target[-val:])}, list(range(10)), 1 / 16


def image_folder(path, size, val_fraction=0.1, seed=0):
    """A folder with one subfolder per class: images resized to size x size, RGB, pixels / 255; a seeded
    val_fraction of each class held out."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading an image folder needs Pillow: pip install pillow") from None
    classes = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)) and not d.startswith("."))
    if len(classes) < 2:
        raise DataError(f"{path}: expected one subfolder per class (at least two), found {len(classes)}")
    rng = np.random.default_rng(seed)
    splits = {"train": ([], []), "val": ([], [])}
    for label, name in enumerate(classes):
        files = sorted(f for f in os.listdir(os.path.join(path, name)) if f.lower().endswith(IMAGE_EXTENSIONS))
        if len(files) < 2:
            raise DataError(f"{path}/{name}: {len(files)} image(s); each class needs at least two (train and val)")
        order = rng.permutation(len(files))
        n_val = max(1, round(len(files) * val_fraction))
        for i, k in enumerate(order):
            try:
                with Image.open(os.path.join(path, name, files[k])) as image:
                    pixels = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 255
            except OSError as e:
                raise DataError(f"{path}/{name}/{files[k]}: not an image Pillow reads ({e})") from None
            split = splits["val" if i < n_val else "train"]
            split[0].append(pixels.transpose(2, 0, 1))
            split[1].append(label)
    return {s: (np.stack(x), np.array(y)) for s, (x, y) in splits.items()}, classes, 1 / 255


def cifar10():
    """CIFAR-10 from the Hugging Face Hub (online, or the datasets cache): 3 x 32 x 32, pixels / 255."""
    from dataset import hub_offline

    if hub_offline():
        raise DataError("CIFAR-10 comes from the Hugging Face Hub, which is unreachable here (HF_DATASETS_OFFLINE or "
                        "no network); prepare digits or an image folder instead")
    from datasets import load_dataset

    data = load_dataset("uoft-cs/cifar10")
    classes = data["train"].features["label"].names
    splits = {}
    for split, name in (("train", "train"), ("val", "test")):
        images = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32).transpose(2, 0, 1) / 255 for im in data[name]["img"]])
        splits[split] = (images, np.array(data[name]["label"]))
    return splits, classes, 1 / 255


class ImageSampler:
    """A split's images drawn uniformly, with replacement, from a seeded generator; shift > 0 moves each
    drawn image by up to that many pixels in each direction (zeros fill in), a new draw each time."""

    def __init__(self, data_dir, split, seed, shift=0):
        path = os.path.join(data_dir, f"{split}_images.npy")
        if not os.path.exists(path):
            raise DataError(f"{data_dir}: no {split}_images.npy; prepare the images first (data/images/prepare.py)")
        self.images = torch.from_numpy(np.load(path))
        self.labels = torch.from_numpy(np.load(os.path.join(data_dir, f"{split}_labels.npy")))
        self.shift = shift
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, n, rows=slice(None)):
        """n examples -> (pixels (n, C, H, W), labels (n,)); rows: which of them this process reads."""
        picks = torch.randint(len(self.labels), (n,), generator=self.generator)
        x = self.images[picks]
        if self.shift:  # drawn for all n, so every process's stream stays the same
            s, (H, W) = self.shift, x.shape[2:]
            moves = torch.randint(-s, s + 1, (n, 2), generator=self.generator)
            padded = torch.nn.functional.pad(x, (s, s, s, s))
            x = torch.stack([padded[i, :, s - dy : s - dy + H, s - dx : s - dx + W] for i, (dy, dx) in enumerate(moves.tolist())])
        return x[rows].contiguous(), self.labels[picks][rows].contiguous()

    def ordered(self, batch_size, limit):
        """The split's first `limit` examples in order, in batches: what evaluation reads."""
        for start in range(0, min(limit, len(self.labels)), batch_size):
            end = min(start + batch_size, limit, len(self.labels))
            yield self.images[start:end], self.labels[start:end]

    def state_dict(self):
        return self.generator.get_state()

    def load_state_dict(self, state):
        self.generator.set_state(state)


def check_images(meta, config, where):
    """DataError when a vision transformer's config does not fit the images it is given."""
    if meta.get("kind") != "images":
        raise DataError(f"{where} holds text, but image_size={config.image_size} makes a vision transformer: prepare "
                        "images (python data/images/prepare.py digits) or train a text model")
    want = (meta["channels"], meta["image_size"], len(meta["classes"]))
    have = (config.channels, config.image_size, config.n_classes)
    if config.image_size == 0:
        raise DataError(f"{where} holds images; train a vision transformer on them (image_size={meta['image_size']}, "
                        f"channels={meta['channels']}, family='encoder', head='classify'; config/train_vit_digits_cpu.py)")
    if want != have:
        raise DataError(f"{where} holds {want[0]} x {want[1]} x {want[1]} images of {want[2]} classes; the model takes "
                        f"channels={have[0]}, image_size={have[1]}, n_classes={have[2]}")


# ----------------------------------------------------------------------------------------------------
# Texts with labels and source/target pairs: data/prepare.py FILE.jsonl of {"text", "label"} or
# {"source", "target"} per line. Ids framed by the encoder tokenizer's specials (tokenizer.EncoderTokenizer):
# a classifier reads [CLS] text [SEP]; an encoder-decoder reads source [SEP] and writes [CLS] target -> target [SEP].
# Per split: {split}_{field}_ids.npy (every example's ids back to back) and {split}_{field}_starts.npy.

LABELED_KINDS = {"labels": ("text", "label"), "pairs": ("source", "target")}


def labeled_kind(meta):
    """'labels', 'pairs' or None: what a prepared dataset holds."""
    return meta.get("labeled", {}).get("kind")


def read_labeled(path):
    """(kind, records) of a JSON-lines file whose every line is {"text", "label"} or {"source", "target"}."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    records, kind = [], None
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
        found = next((k for k, keys in LABELED_KINDS.items() if isinstance(record, dict) and keys[0] in record), None)
        if found is None or (kind and found != kind):
            raise DataError(f"{path}:{n}: expected an object with {' or '.join(' and '.join(map(repr, k)) for k in LABELED_KINDS.values())}"
                            + (f", as the lines before it ({kind})" if kind else ""))
        kind = found
        first, second = LABELED_KINDS[kind]
        if not isinstance(record[first], str) or second not in record or (kind == "pairs" and not isinstance(record[second], str)):
            raise DataError(f"{path}:{n}: {first!r} must be a string and {second!r} present"
                            + (" (a string)" if kind == "pairs" else ""))
        records.append(record)
    if len(records) < 2:
        raise DataError(f"{path}: {len(records)} example(s); a dataset needs at least 2 (train and val)")
    return kind, records


def is_labeled_file(path):
    """Whether a .jsonl file's first line is a labelled example (not a conversation)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        line = next((line for line in f if line.strip()), "")
    try:
        first = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(first, dict) and any(keys[0] in first for keys in LABELED_KINDS.values())


def prepare_labeled(kind, records, tokenizer, out_dir, val_fraction=0.1):
    """Writes a labelled dataset (the last val_fraction of the examples, at least one, are val); returns its meta."""
    tok = encoder_tokenizer(tokenizer)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction={val_fraction} must be in (0, 1)")
    n_val = max(1, round(len(records) * val_fraction))
    splits = {"train": records[:-n_val], "val": records[-n_val:]}
    classes = sorted({str(r["label"]) for r in records}) if kind == "labels" else None
    if classes is not None and len(classes) < 2:
        raise DataError(f"every example has the label {classes[0]!r}: a classifier needs at least two")
    os.makedirs(out_dir, exist_ok=True)
    for split, part in splits.items():
        if kind == "labels":
            fields = {"text": [tok.wrap(r["text"]) for r in part]}
            labels = np.array([classes.index(str(r["label"])) for r in part], dtype=np.int64)
            atomic_write(os.path.join(out_dir, f"{split}_labels.npy"), lambda f, a=labels: np.save(f, a))
        else:
            fields = {"source": [source_ids(tok, r["source"]) for r in part], "target": [tok.encode(r["target"]) for r in part]}
        for name, seqs in fields.items():
            ids = np.concatenate([np.array(x, dtype=np.int64) for x in seqs]).astype(np.int32)
            starts = np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64)
            atomic_write(os.path.join(out_dir, f"{split}_{name}_ids.npy"), lambda f, a=ids: np.save(f, a))
            atomic_write(os.path.join(out_dir, f"{split}_{name}_starts.npy"), lambda f, a=starts: np.save(f, a))
    labeled = {"kind": kind, "examples": {s: len(p) for s, p in splits.items()}, **({"classes": classes} if classes else {})}
    meta = {"vocab_size": tok.vocab_size, "tokenizer": tok.meta(), "labeled": labeled}
    write_json(os.path.join(out_dir, "meta.json"), meta)
    return meta


class Sequences:
    """A split's field: example i is ids[starts[i]:starts[i + 1]]."""

    def __init__(self, data_dir, split, name):
        path = os.path.join(data_dir, f"{split}_{name}_ids.npy")
        if not os.path.exists(path):
            raise DataError(f"{data_dir}: no {split}_{name}_ids.npy; prepare it with data/prepare.py FILE.jsonl")
        self.ids = torch.from_numpy(np.load(path).astype(np.int64))
        self.starts = np.load(os.path.join(data_dir, f"{split}_{name}_starts.npy"))

    def __len__(self):
        return len(self.starts) - 1

    def __getitem__(self, i):
        return self.ids[self.starts[i] : self.starts[i + 1]]


def padded(rows, fill):
    """Rows of different lengths -> (len(rows), longest) filled with `fill`, and its mask (True on the rows' own)."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=torch.long)
    mask = torch.zeros(out.shape, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)], mask[i, : len(r)] = r, True
    return out, mask


class LabeledSampler:
    """A labelled text dataset's batches: whole examples drawn from a seeded generator (its state goes
    into checkpoints), padded with [PAD] to the batch's longest and cut at block_size.

    labels -> (ids, labels, {"pad_mask"}); pairs -> ([CLS] target, target [SEP] with -1 after it,
    {"source", "pad_mask"}): the forward's keyword inputs ride in the third item."""

    def __init__(self, data_dir, split, seed, block_size):
        meta = read_meta(data_dir)
        self.kind, self.block_size = labeled_kind(meta), block_size
        self.tok = EncoderTokenizer.from_meta(meta["tokenizer"])
        if self.kind == "labels":
            self.text = Sequences(data_dir, split, "text")
            self.labels = torch.from_numpy(np.load(os.path.join(data_dir, f"{split}_labels.npy")))
        else:
            self.source, self.target = Sequences(data_dir, split, "source"), Sequences(data_dir, split, "target")
        self.n = len(self.text if self.kind == "labels" else self.target)
        self.generator = torch.Generator().manual_seed(seed)

    def examples(self, picks):
        pad, cut = self.tok.special["[PAD]"], self.block_size
        if self.kind == "labels":
            x, mask = padded([self.text[i][:cut] for i in picks], pad)
            return x, self.labels[picks], {"pad_mask": mask}
        source, mask = padded([self.source[i][:cut] for i in picks], pad)
        targets = [self.target[i][: cut - 1] for i in picks]
        x, _ = padded([torch.cat([torch.tensor([self.tok.special["[CLS]"]]), t]) for t in targets], pad)
        y, _ = padded([torch.cat([t, torch.tensor([self.tok.end_token])]) for t in targets], -1)
        return x, y, {"source": source, "pad_mask": mask}

    def sample(self, n, rows=slice(None)):
        """n examples (this process's rows of them) -> (x, y, the forward's keyword inputs)."""
        return self.examples(torch.randint(self.n, (n,), generator=self.generator)[rows].tolist())

    def ordered(self, batch_size, limit):
        """The split's first `limit` examples in order, in batches: what evaluation reads."""
        for start in range(0, min(limit, self.n), batch_size):
            yield self.examples(list(range(start, min(start + batch_size, limit, self.n))))

    def state_dict(self):
        return self.generator.get_state()

    def load_state_dict(self, state):
        self.generator.set_state(state)


def check_labeled(meta, config, where):
    """DataError when the model's family or head does not fit a labelled dataset (or a text dataset)."""
    kind = labeled_kind(meta)
    if kind == "labels" and (config.head != "classify" or config.n_classes != len(meta["labeled"]["classes"])):
        raise DataError(f"{where} holds texts with {len(meta['labeled']['classes'])} labels: train an encoder with "
                        f"head='classify' and n_classes={len(meta['labeled']['classes'])} on it (it has head={config.head!r}, "
                        f"n_classes={config.n_classes})")
    if kind == "pairs" and config.family != "encoder-decoder":
        raise DataError(f"{where} holds source/target pairs: train an encoder-decoder on it (family='encoder-decoder')")
    if kind is None and (config.family == "encoder-decoder" or config.head == "classify"):
        raise DataError(f"{where} holds plain text; family={config.family!r} with head={config.head!r} trains on "
                        "labelled examples: prepare a .jsonl of {\"text\", \"label\"} or {\"source\", \"target\"} with data/prepare.py")


# ----------------------------------------------------------------------------------------------------
# BERT's masked tokens, made from a text dataset's windows


class MaskedTokens:
    """BERT's objective over a text dataset: rows of [CLS] and block_size - 1 tokens (a BatchSampler's
    windows), of whose text positions `rate` (15%) are chosen: 80% of those become [MASK], 10% a random
    token, 10% stay. Targets are the original tokens there and -1 everywhere else (the loss counts masked
    positions only). The choices come from the windows' generator, whose state checkpoints keep."""

    def __init__(self, windows, tokenizer, rate=0.15):
        self.windows, self.tok, self.rate = windows, tokenizer, rate
        self.generator = windows.generator

    def sample(self, n, rows=slice(None)):
        x, _ = self.windows.sample(n)  # all n drawn (and masked) in every process: the stream stays the same
        x, y = self.mask(x)
        return x[rows].contiguous(), y[rows].contiguous()

    def mask(self, x):
        """Windows x (n, T) -> ([CLS] and x masked, targets), the choices drawn from the generator."""
        n, T, g = x.size(0), x.size(1), self.generator
        chosen = torch.rand(n, T, generator=g) < self.rate
        how = torch.rand(n, T, generator=g)
        random_ids = torch.randint(self.tok.base.vocab_size, (n, T), generator=g)
        y = torch.where(chosen, x, -1)
        x = torch.where(chosen & (how < 0.8), self.tok.special["[MASK]"], torch.where(chosen & (how >= 0.9), random_ids, x))
        cls = torch.full((n, 1), self.tok.special["[CLS]"])
        return torch.cat([cls, x], 1), torch.cat([torch.full((n, 1), -1), y], 1)

    def state_dict(self):
        return self.windows.state_dict()

    def load_state_dict(self, state):
        self.windows.load_state_dict(state)
