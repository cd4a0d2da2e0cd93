import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# Offline by construction: no test may reach the Hugging Face Hub or wandb's servers.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
if "TIKTOKEN_CACHE_DIR" not in os.environ and (SHARED_DATA / "tiktoken_cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED_DATA / "tiktoken_cache")
sys.path.insert(0, str(ROOT))

import json  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from checkpoint import read_metrics  # noqa: E402, F401  (the tests import it from here)

WORDS = ("the king queen lord speak thou thee hath doth love death night day fair sweet good noble heart blood "
         "sword crown honour friend enemy war peace heaven earth fire water gentle cruel young old man woman").split()


def make_text(n_chars, seed=0):
    """Deterministic pseudo-verse: enough structure for a model to learn, no corpus needed."""
    rng = random.Random(seed)
    lines, length = [], 0  # (a running length: summing the lines each time took 22 s for 1 MB)
    while length < n_chars:
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        lines.append(" ".join(words).capitalize() + rng.choice([",", ".", ";", "!", "?"]) + "\n")
        length += len(lines[-1])
    return "".join(lines)[:n_chars]


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory):
    from dataset import prepare_text
    from tokenizer import char_tokenizer_for

    out = tmp_path_factory.mktemp("data") / "verse_char"
    text = make_text(40_000)
    prepare_text(text, char_tokenizer_for(text), str(out))
    return str(out)


TINY_RUN = [
    "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2",
    "--eval_interval=5", "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3", "--min_lr=3e-4",
    "--dtype=float32", "--device=cpu",
]  # fmt: skip


def run_script(*args, timeout=300, env=None, **kwargs):
    """Runs a project script in a subprocess; returns the CompletedProcess (text output)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=full_env, **kwargs)


def run_main(script, *args):
    """A script's main() in this process, as run_script's CompletedProcess-like result (returncode, stdout,
    stderr): the same cli_main path (one line and exit 2 for bad input) without starting an interpreter and
    importing torch again, about 1.5 s less per call. Where the environment matters (offline, threads,
    signals, a crash's traceback), run_script."""
    import contextlib
    import importlib
    import io
    from types import SimpleNamespace

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if "/" in script:  # a data/ prepare script: run as __main__ with its own argv
                import runpy

                sys.argv = [str(ROOT / script), *args]
                runpy.run_path(str(ROOT / script), run_name="__main__")
            else:
                importlib.import_module(script.removesuffix(".py")).main(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):  # sys.exit("error: ..."): the interpreter would print it
                print(e.code, file=sys.stderr)
        finally:
            sys.argv = argv
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())



def one_error_line(result):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[-1]


def fails(capsys, main, *args):
    """Runs a script's main; returns (exit status, stderr), checking the message is one line."""
    with pytest.raises(SystemExit) as exit:
        main(list(args))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return exit.value.code, err


def gpt2_or_skip():
    from tokenizer import TiktokenTokenizer

    try:
        TiktokenTokenizer("gpt2")
    except Exception as e:  # no ../shared tiktoken cache and no network
        pytest.skip(f"tiktoken gpt2 files unavailable: {e}")


def tiny(**overrides):
    """The GPTConfig of the small random models the unit tests build (block_size 32, 61 tokens)."""
    from model import GPTConfig

    base = dict(block_size=32, vocab_size=61, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    base.update(overrides)
    return GPTConfig(**base)


def build(seed=0, **overrides):
    """A random GPT of tiny(**overrides), seeded, in eval mode."""
    import torch
    from model import GPT

    torch.manual_seed(seed)
    return GPT(tiny(**overrides)).eval()


def max_logit_diff(ours, theirs, idx):
    """Largest absolute difference between our logits and a transformers model's on idx."""
    import torch

    with torch.no_grad():
        return (ours(idx)[0] - theirs(idx).logits).abs().max().item()

@pytest.fixture(scope="session")
def bpe_run(tmp_path_factory):
    """(dataset, out_dir): a BPE of 300 tokens learned by `data/prepare.py --tokenizer=bpe:300` from a text
    whose val split (its last tenth) holds only words the train split lacks, and a tiny model trained on it."""
    import train

    root = tmp_path_factory.mktemp("bpe")
    text = make_text(30_000) + "\n" + "zebra quokka axolotl " * 100  # all in val
    (root / "text.txt").write_text(text)
    prepared = run_main("data/prepare.py", str(root / "text.txt"), f"--out={root / 'data'}", "--tokenizer=bpe:400")
    assert prepared.returncode == 0, prepared.stderr
    assert "BPE (learned from train) vocabulary of 400" in prepared.stdout
    train.main([*TINY_RUN, f"--dataset={root / 'data'}", f"--out_dir={root / 'run'}", "--max_iters=20",
                "--eval_interval=20", "--learning_rate=1e-2"])
    return str(root / "data"), str(root / "run")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, char_dataset):
    """A tiny character model trained for a few steps: its out_dir."""
    import train

    out = tmp_path_factory.mktemp("run")
    train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={out}", "--max_iters=30", "--eval_interval=30"])
    return str(out)


SFT_RUN = ["--batch_size=4", "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3",
           "--dtype=float32", "--device=cpu"]  # fmt: skip  (TINY_RUN's keys that a fine-tune may set)


def conversations(n, seed=0):
    """The user's turn is random words (noise no model can predict); the assistant repeats its first word.
    Every third has a system turn, every fourth a second exchange."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        def exchange():
            words = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
            return [{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": words[0]}]
        messages = ([{"role": "system", "content": "be brief"}] if i % 3 == 0 else []) + exchange()
        if i % 4 == 0:
            messages += exchange()
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory, trained_run):
    """(jsonl path, dataset dir) of 120 conversations prepared with the trained_run's tokenizer."""
    root = tmp_path_factory.mktemp("chat")
    path = root / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations(120)))
    result = run_main("data/prepare.py", str(path), f"--out={root / 'data'}", f"--tokenizer_from={trained_run}")
    assert result.returncode == 0, result.stderr
    assert "120 conversations" in result.stdout
    return path, str(root / "data")


@pytest.fixture(scope="session")
def sft_run(tmp_path_factory, trained_run, chat_data):
    import train

    out = tmp_path_factory.mktemp("sft")
    train.main([*SFT_RUN, f"--init_from={trained_run}", f"--dataset={chat_data[1]}", f"--out_dir={out}",
                "--max_iters=6", "--eval_interval=6"])
    return str(out)
