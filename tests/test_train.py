"""train.py: its keys, refused input (values, data, tokenizers), the recipe's logs, checkpoints, resume, signals."""

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import train
from checkpoint import load_checkpoint
from conftest import ROOT, TINY_RUN, fails, make_text, one_error_line, read_metrics, run_main, run_script
from dataset import HEADER, prepare_text, write_tokens
from tokenizer import char_tokenizer_for

def run(out_dir, dataset, *extra):
    return train.main([*TINY_RUN, f"--dataset={dataset}", f"--out_dir={out_dir}", *extra])


def losses(out_dir):
    return [(r["iter"], r["loss"]) for r in read_metrics(out_dir) if "loss" in r]


def weights(out_dir):
    return load_checkpoint(os.path.join(out_dir, "ckpt.pt"))["model"]


# ---------------------------------------------------------------------------------------------------
# Configuration


def test_unknown_key_on_command_line_exits_2(capsys):
    with pytest.raises(SystemExit) as exit:
        train.main(["--learning_rte=1e-3"])
    assert exit.value.code == 2
    assert "unknown key 'learning_rte'; did you mean learning_rate?" in capsys.readouterr().err


def test_unknown_key_in_config_file_exits_2(tmp_path, capsys):
    config = tmp_path / "cfg.py"
    config.write_text("import math\nn_layer = 2\nbatchsize = 8\n_private = 1\n")
    with pytest.raises(SystemExit) as exit:
        train.main([str(config)])
    assert exit.value.code == 2
    assert f"config file {config}: unknown key 'batchsize'; did you mean batch_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--max_iters=ten", "--max_iters=ten: expected int"),
        ("--compile=maybe", "--compile=maybe: expected true/false"),
        ("--dropout=0.1.2", "--dropout=0.1.2: expected float"),
        ("--lr_decay_iters=soon", "--lr_decay_iters=soon: expected int or None"),
        ("--device=tpu", "device='tpu' is not one of 'auto', 'cpu', 'cuda', 'mps'"),
        ("--pos_emb=rotary", "pos_emb='rotary' is not one of 'learned', 'rope'"),
        ("--max_iters", "--max_iters: expected --key=value"),
    ],
)
def test_wrong_type_on_command_line_exits_2(arg, message, capsys):
    with pytest.raises(SystemExit) as exit:
        train.main([arg])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_wrong_type_in_config_file_exits_2(tmp_path, capsys):
    config = tmp_path / "cfg.py"
    config.write_text("learning_rate = '3e-4'\n")
    with pytest.raises(SystemExit) as exit:
        train.main([str(config)])
    assert exit.value.code == 2
    assert "learning_rate expects float, got str '3e-4'" in capsys.readouterr().err


def test_help_lists_every_key_with_default_and_type():
    result = run_script("train.py", "--help")
    assert result.returncode == 0
    for key in train.TRAIN_KEYS + train.MODEL_KEYS:
        assert f"--{key} " in result.stdout
    assert "--learning_rate               = 0.0006         (float)" in result.stdout
    assert "(auto|cpu|cuda|mps)" in result.stdout
    assert "--vocab_size                  = dataset's      (int)  vocabulary size; default: the dataset's" in result.stdout


# ---------------------------------------------------------------------------------------------------
# Refused input: values, data, tokenizers, services


def train_fails(capsys, tmp_path, dataset, *args):
    out = tmp_path / "out"
    code, err = fails(capsys, train.main, *TINY_RUN, f"--dataset={dataset}", f"--out_dir={out}", *args)
    assert not out.exists(), "a refused run must leave nothing behind"
    return code, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n_embd=30", "--n_head=4"], "GPTConfig.n_embd=30 must be divisible by n_head=4"),
        (["--n_head=4", "--n_kv_head=3"], "GPTConfig.n_head=4 must be divisible by n_kv_head=3"),
        (["--n_embd=36", "--n_head=4", "--pos_emb=rope"], "needs an even head size; n_embd/n_head = 9"),
        (["--warmup_iters=50", "--max_iters=10"], "warmup_iters=50 must be in [0, max_iters=10]"),
        (["--learning_rate=0"], "learning_rate=0.0 must be > 0"),
        (["--learning_rate=-1e-3"], "learning_rate=-0.001 must be > 0"),
        (["--batch_size=0"], "batch_size=0 must be >= 1"),
        (["--block_size=20000"], "fewer than block_size + 1 = 20001; use a smaller block_size or more data"),
        (["--dropout=1.5"], "GPTConfig.dropout=1.5 must be in [0, 1)"),
        (["--beta2=1.0"], "beta2=1.0 must be in [0, 1)"),
        (["--fsdp=True"], "fsdp=True needs torchrun"),
        (["--dataset=no_such_data"], "dataset 'no_such_data' not found"),
    ],
)
def test_invalid_training_values(capsys, tmp_path, char_dataset, args, message):
    code, err = train_fails(capsys, tmp_path, char_dataset, "--max_iters=20", *args)
    assert code == 2 and message in err


def test_empty_and_missing_data(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, err = train_fails(capsys, tmp_path, tmp_path / "empty")
    assert code == 2 and "no meta.json; prepare the dataset first: python data/prepare.py YOUR_FILES --out=empty" in err
    text = make_text(5000)
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "d"))
    write_tokens(tmp_path / "d" / "val.bin", np.zeros(0, dtype=np.int64), len(set(text)))
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "val.bin: 0 tokens, fewer than block_size + 1" in err


def test_corrupt_token_files(capsys, tmp_path):
    text = make_text(5000)
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "d"))
    path = tmp_path / "d" / "train.bin"
    good = path.read_bytes()
    path.write_bytes(good[:-1])  # odd byte length
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "train.bin: 9063 bytes, but its header promises 4500 tokens (9064 bytes)" in err and "truncated" in err
    path.write_bytes(b"NOTATOKN" + good[8:])
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "train.bin: not a token file (bad header)" in err
    tokens = np.frombuffer(good[HEADER.itemsize:], np.uint16).copy()
    tokens[100] = 200  # beyond the 37-character vocabulary
    path.write_bytes(good[: HEADER.itemsize] + tokens.tobytes())
    code, err = train_fails(capsys, tmp_path, tmp_path / "d")
    assert code == 2 and "train.bin: token id 200 >= vocabulary size" in err


def test_dataset_shorter_than_a_block_is_refused(tmp_path, capsys):
    text = make_text(300)
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "short"))
    with pytest.raises(SystemExit) as exit:
        train.main([*TINY_RUN, f"--dataset={tmp_path / 'short'}", f"--out_dir={tmp_path / 'out'}",
                    "--block_size=64", "--max_iters=2"])
    assert exit.value.code == 2
    assert "val.bin: 30 tokens, fewer than block_size + 1 = 65; use a smaller block_size" in capsys.readouterr().err
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_model_vocabulary_smaller_than_data_is_refused(tmp_path, char_dataset, capsys):
    with pytest.raises(SystemExit) as exit:
        train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--vocab_size=20", "--max_iters=2"])
    assert exit.value.code == 2
    assert "has a vocabulary of 48, more than the model's vocab_size=20" in capsys.readouterr().err


def test_resume_on_other_tokenizer_is_refused(tmp_path, char_dataset, capsys):
    train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'run'}", "--max_iters=2"])
    text = make_text(20_000, seed=5).upper()
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "upper"))
    with pytest.raises(SystemExit) as exit:
        train.main([f"--dataset={tmp_path / 'upper'}", f"--out_dir={tmp_path / 'run'}", "--init_from=resume"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "uses 30 characters '\\n !,.;?AB" in err and "was trained with 48 characters '\\n !,.;?BCD" in err


def test_gpt2_weights_need_gpt2_tokens(tmp_path, char_dataset, capsys):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=1,
                                                              n_head=2))
    hf.save_pretrained(tmp_path / "hf")
    with pytest.raises(SystemExit) as exit:
        train.main([f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'run'}", f"--init_from={tmp_path / 'hf'}",
                    "--max_iters=2", "--warmup_iters=0", "--device=cpu"])
    assert exit.value.code == 2
    assert "GPT-2 weights need a dataset tokenized with tiktoken gpt2" in capsys.readouterr().err


def test_an_unprepared_dataset_names_its_own_prepare_script(tmp_path):
    """data/shakespeare (GPT-2 BPE) used to be told to run data/shakespeare_char/prepare.py."""
    data = tmp_path / "shakespeare"
    data.mkdir()
    shutil.copy(ROOT / "data" / "shakespeare" / "prepare.py", data / "prepare.py")
    result = run_script("train.py", f"--dataset={data}", "--init_from=gpt2", "--max_iters=1", env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    line = one_error_line(result)
    assert f"prepare the dataset first: python {os.path.relpath(data / 'prepare.py', ROOT)}" in line
    assert "shakespeare_char" not in line


def test_wandb_not_logged_in_is_one_line_and_releases_the_lock(tmp_path, char_dataset):
    pytest.importorskip("wandb")
    args = [*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2"]
    env = {"WANDB_MODE": "online", "HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_DIR": str(tmp_path)}
    result = run_script("train.py", *args, "--wandb_log=True", env=env, timeout=120)
    assert result.returncode == 2
    line = one_error_line(result)
    assert "wandb could not start" in line and "wandb login" in line and "WANDB_MODE=offline" in line
    again = run_main("train.py", *args)
    assert again.returncode == 0, again.stderr
    assert "took over the lock" not in again.stdout  # the failed run released it


def test_init_from_a_run_folder_fine_tunes_it_with_its_own_tokenizer_only(tmp_path, trained_run, char_dataset, capsys):
    import train
    from dataset import prepare_text
    from tokenizer import char_tokenizer_for

    text = "other characters entirely: 0123456789 +-*/=\n" * 200
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "digits"))
    with pytest.raises(SystemExit) as exit:
        train.main(["--init_from=" + trained_run, f"--dataset={tmp_path / 'digits'}", f"--out_dir={tmp_path / 'x'}", "--device=cpu"])
    assert exit.value.code == 2
    assert "was trained with another tokenizer than dataset" in capsys.readouterr().err
    result = train.main(["--init_from=" + trained_run, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'tuned'}",
                         "--max_iters=2", "--eval_iters=2", "--eval_interval=2", "--batch_size=4", "--device=cpu",
                         "--dtype=float32"])  # the same tokenizer: a fine-tune from the run's weights
    assert result["iter"] == 2


# ---------------------------------------------------------------------------------------------------
# Recipe


def test_logged_grad_norm_is_pre_clip(tmp_path, char_dataset):
    run(tmp_path, char_dataset, "--max_iters=1", "--grad_clip=1e-3", "--warmup_iters=0")
    logged = read_metrics(tmp_path)
    step0 = next(r for r in logged if "loss" in r)
    # the same first step by hand: same seed, same initialisation, same first batch
    from dataset import BatchSampler, open_split, read_meta
    from model import GPT, GPTConfig, lm_loss

    torch.manual_seed(1337)
    model = GPT(GPTConfig(block_size=32, vocab_size=read_meta(char_dataset)["vocab_size"], n_layer=2, n_head=2, n_embd=32))
    x, y = BatchSampler(open_split(char_dataset, "train", model.config.vocab_size), 32, seed=1337).sample(4)
    lm_loss(model(x)[0], y)[0].backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert step0["loss"] == pytest.approx(lm_loss(model(x)[0], y)[0].item(), rel=1e-6)
    assert step0["grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert step0["grad_norm"] > 100 * 1e-3  # so the logged value is not the clipped one


def test_z_loss_logged_apart_and_kept_out_of_evaluation(tmp_path, char_dataset):
    run(tmp_path / "plain", char_dataset, "--max_iters=2")
    run(tmp_path / "z", char_dataset, "--max_iters=2", "--z_loss=0.5")
    plain, z = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "z")
    step = next(r for r in z if "loss" in r)
    assert step["z_loss_term"] > 0 and step["loss"] == pytest.approx(step["ce"] + step["z_loss_term"])
    assert "z_loss_term" not in next(r for r in plain if "loss" in r)
    # before any step the two models are the same; evaluation reports cross-entropy alone
    assert plain[0]["val_loss"] == z[0]["val_loss"] and plain[0]["iter"] == z[0]["iter"] == 0
    # label smoothing likewise: the trained-on loss differs from the logged plain cross-entropy, and the
    # evaluation before any step equals the plain run's (it never smooths)
    run(tmp_path / "smooth", char_dataset, "--max_iters=2", "--label_smoothing=0.5")
    smooth = read_metrics(tmp_path / "smooth")
    step = next(r for r in smooth if "loss" in r)
    assert step["loss"] > step["ce"] + 0.01 and "z_loss_term" not in step
    assert step["ce"] == pytest.approx(next(r for r in plain if "loss" in r)["ce"], rel=1e-6)
    assert smooth[0]["val_loss"] == plain[0]["val_loss"]


# ---------------------------------------------------------------------------------------------------
# Checkpoints and resume


def test_checkpoint_loads_weights_only(tmp_path, char_dataset):
    run(tmp_path, char_dataset, "--max_iters=3")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 3 and state["model_config"]["n_layer"] == 2
    assert state["tokenizer"]["kind"] == "char"
    assert not any("_orig_mod" in k or k.startswith("module.") for k in state["model"])


@pytest.mark.slow
def test_compiled_run_saves_plain_keys(tmp_path, char_dataset, monkeypatch):
    """torch.compile's wrapper (its _orig_mod) never reaches the checkpoint. Dynamo's eager backend: the
    wrapper is the same, without inductor's C++ (10+ s cold here; the GPU tier compiles for real)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    run(tmp_path, char_dataset, "--max_iters=2", "--compile=True", "--eval_iters=1")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["model"] and not any("_orig_mod" in k for k in state["model"])
    assert not any("_orig_mod" in k for k in state["optimizer"]["state"])


def test_resume_is_exact(tmp_path, char_dataset, capsys):
    common = ["--dropout=0.1", "--max_iters=20", "--lr_decay_iters=20"]  # dropout: RNG state must resume too
    run(tmp_path / "straight", char_dataset, *common)
    run(tmp_path / "split", char_dataset, *common, "--max_iters=10")
    assert load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))["iter_num"] == 10
    run(tmp_path / "split", char_dataset, "--init_from=resume", "--max_iters=20")
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")  # bit for bit, every step
    assert len(losses(tmp_path / "split")) == 20
    straight, split = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert straight.keys() == split.keys() and all(torch.equal(straight[k], split[k]) for k in straight)
    evals = [r["iter"] for r in read_metrics(tmp_path / "split") if "val_loss" in r]
    assert evals == [0, 5, 10, 15, 20]  # no evaluation repeated at the resume point
    # a finished run resumed again: says so, and changes nothing (it printed "steps 20 -> 20" and stopped)
    files = {name: (tmp_path / "split" / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl")}
    capsys.readouterr()
    for max_iters in (20, 10):
        assert run(tmp_path / "split", char_dataset, "--init_from=resume", f"--max_iters={max_iters}")["iter"] == 20
        out = capsys.readouterr().out
        assert (f"nothing to do: {tmp_path / 'split' / 'ckpt.pt'} is at iteration 20, evaluated, and max_iters={max_iters}; "
                "a larger --max_iters trains on") in out and "steps 20 ->" not in out, out
    assert files == {name: (tmp_path / "split" / name).read_bytes() for name in files}


def test_resume_rejects_architecture_change(tmp_path, char_dataset, capsys):
    run(tmp_path, char_dataset, "--max_iters=2")
    with pytest.raises(SystemExit) as exit:
        run(tmp_path, char_dataset, "--init_from=resume", "--n_layer=3")
    assert exit.value.code == 2
    assert "n_layer=3 differs from the checkpoint (n_layer=2)" in capsys.readouterr().err


def test_scratch_refuses_to_overwrite_a_checkpoint(tmp_path, char_dataset, capsys):
    run(tmp_path, char_dataset, "--max_iters=2")
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(SystemExit) as exit:
        run(tmp_path, char_dataset, "--max_iters=2")
    assert exit.value.code == 2 and "--init_from=resume" in capsys.readouterr().err
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    run(tmp_path, char_dataset, "--max_iters=4", "--overwrite=True")
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 4
    assert [r["iter"] for r in read_metrics(tmp_path) if "loss" in r] == [0, 1, 2, 3]


def test_nan_stops_and_keeps_previous_checkpoint(tmp_path, char_dataset, capsys):
    run(tmp_path, char_dataset, "--max_iters=5")
    before = (tmp_path / "ckpt.pt").read_bytes()
    with pytest.raises(SystemExit) as exit:  # a learning rate this large overflows within a few steps
        run(tmp_path, char_dataset, "--init_from=resume", "--max_iters=40", "--learning_rate=1e30",
            "--min_lr=1e30", "--grad_clip=0")
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert "non-finite loss or gradient norm at iteration " in err and "last good state" in err
    bad_iter = int(err.split("at iteration ")[1].split(";")[0])
    assert 5 <= bad_iter < 40
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_skip_nonfinite_skips_the_step(tmp_path, char_dataset, capsys):
    run(tmp_path, char_dataset, "--max_iters=12", "--learning_rate=1e30", "--min_lr=1e30", "--grad_clip=0",
        "--skip_nonfinite=True", "--warmup_iters=0")
    out = capsys.readouterr().out
    assert "non-finite loss or gradient norm, step skipped" in out
    assert any(r.get("skipped") for r in read_metrics(tmp_path))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_continues(tmp_path, char_dataset):
    args = [*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--max_iters=100000",
            "--eval_interval=100000", "--log_interval=1"]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("iter 3:"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "continue with --init_from=resume" in out
    saved = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert saved["iter_num"] >= 4
    run(tmp_path, char_dataset, "--init_from=resume", f"--max_iters={saved['iter_num'] + 2}", "--eval_interval=100000")
    assert [r["iter"] for r in read_metrics(tmp_path) if "loss" in r] == list(range(saved["iter_num"] + 2))


@pytest.mark.slow
def test_sigusr1_saves_and_init_from_auto_resumes_bit_exact(tmp_path, char_dataset):
    """SLURM's warning signal, then a requeued job with the same command line (init_from=auto)."""
    schedule = ["--lr_decay_iters=20", "--warmup_iters=2", "--eval_interval=100000"]  # not tied to max_iters
    args = [*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'job'}", *schedule, "--init_from=auto"]
    proc = subprocess.Popen([sys.executable, "train.py", *args, "--max_iters=100000"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iter 3:"):
            break
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert any("init_from=auto: no checkpoint in" in line for line in lines)
    assert "SIGUSR1: stopping after this step" in out and "continue with --init_from=resume (or auto)" in out
    saved = load_checkpoint(str(tmp_path / "job" / "ckpt.pt"))["iter_num"]
    again = run_main("train.py", *args, f"--max_iters={saved + 4}")
    assert again.returncode == 0 and "init_from=auto: resuming" in again.stdout, again.stderr
    run(tmp_path / "straight", char_dataset, f"--max_iters={saved + 4}", *schedule)
    assert losses(tmp_path / "job") == losses(tmp_path / "straight")


def test_muon_resume_is_exact(tmp_path, char_dataset):
    common = ["--optimizer=muon", "--max_iters=8", "--lr_decay_iters=8", "--learning_rate=1e-2"]
    run(tmp_path / "straight", char_dataset, *common)
    run(tmp_path / "split", char_dataset, *common, "--max_iters=4")
    run(tmp_path / "split", char_dataset, *common, "--init_from=resume")  # run() repeats TINY_RUN's keys: repeat ours
    assert losses(tmp_path / "split") == losses(tmp_path / "straight")
    state = load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))
    assert any("momentum_buffer" in s for s in state["optimizer"]["state"].values())  # Muon's state saved too


def test_stability_diagnostics_are_logged(tmp_path, char_dataset):
    run(tmp_path, char_dataset, "--max_iters=5", "--log_stability=True", "--qk_norm=True")
    evals = [r for r in read_metrics(tmp_path) if "val_loss" in r]
    assert len(evals) == 2 and all(math.isfinite(r["max_attn_logit"]) and math.isfinite(r["mean_log_z"]) for r in evals)
    assert evals[0]["mean_log_z"] == pytest.approx(math.log(48), abs=0.05)  # a fresh model's logits are ~uniform


@pytest.mark.slow
def test_wandb_offline_logs_the_run(tmp_path, char_dataset, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tmp_path / "out", char_dataset, "--max_iters=3", "--wandb_log=True", "--wandb_run_name=tiny")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert read_metrics(tmp_path / "out")  # the local metrics file is written all the same


def test_a_short_run_fits_the_default_warmup(tmp_path, char_dataset, capsys):
    """nanoGPT users type --max_iters=60: the default warmup_iters (100) is fitted, with a note;
    a warmup the user wrote is never changed (test_invalid_training_values: refused)."""
    args = [a for a in TINY_RUN if not a.startswith("--warmup_iters")]
    train.main([*args, f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--max_iters=20", "--eval_interval=20"])
    out = capsys.readouterr().out
    assert "note: warmup_iters=100 (the default) is longer than max_iters=20; using warmup_iters=2" in out
    assert load_checkpoint(os.path.join(tmp_path, "ckpt.pt"))["train_config"]["warmup_iters"] == 2
    lrs = [r["lr"] for r in read_metrics(tmp_path) if "lr" in r]
    assert lrs[0] < lrs[2] == pytest.approx(3e-3, rel=0.01)  # warmed up in 2 steps, then the cosine


# ---------------------------------------------------------------------------------------------------
# Ctrl-C


def start_training(*args, env=None):
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def finish(proc, timeout=60):
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def wait_for(proc, prefix):
    for line in proc.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line starting with {prefix!r}: {proc.stderr.read()[-2000:]}")


@pytest.mark.slow
def test_ctrl_c_during_an_evaluation_stops_between_batches(tmp_path, char_dataset):
    """An evaluation of 10^6 batches would run for many minutes: the stop request is honoured between
    batches, and the checkpoint holds the last finished step."""
    from checkpoint import load_checkpoint

    args = [*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--max_iters=10",
            "--eval_iters=1000000"]
    proc = start_training(*args)
    wait_for(proc, "precision:")
    time.sleep(1.0)  # well inside the evaluation at step 0
    started = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    wait_for(proc, "saved")
    assert time.perf_counter() - started < 30
    # a second Ctrl-C on the way out (logs closing, threads joined at exit): the documented line or none,
    # never "Exception ignored in: <module 'threading'>" or cli_main's plain "interrupted"
    while proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.005)
    out, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert all(line.startswith("error: interrupted again; stopped at once: ") for line in err.splitlines() if line.strip()), err
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == 0


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_with_one_line(tmp_path, char_dataset):
    # a step of 1-3 s on one thread (2.4 s on a Zen 4 core): one core's speed varies less than a machine's
    big = ["--n_layer=4", "--n_embd=256", "--n_head=4", "--block_size=256", "--batch_size=32"]
    proc = start_training(*TINY_RUN, *big, f"--dataset={char_dataset}", f"--out_dir={tmp_path}", "--max_iters=1000",
                          "--eval_interval=1000", "--eval_iters=1", env={"OMP_NUM_THREADS": "1"})  # (its first evaluation: 4 s)
    wait_for(proc, "iter 0:")
    time.sleep(0.3)  # inside the step of iteration 1
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGINT
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("error: interrupted again; stopped at once"), err


def test_a_resumed_run_keeps_the_precision_it_started_with(tmp_path, char_dataset, monkeypatch):
    """dtype=auto is measured at the run's start and recorded in the checkpoint; a resume keeps it (and
    Muon's Newton-Schulz dtype) and says so, even where a new measurement would choose otherwise (here
    SMALLGPT_BF16 plays the measurement); a dtype given on the resume's command line still wins."""
    import device

    out = tmp_path / "run"
    run = [f"--dataset={char_dataset}", f"--out_dir={out}"]
    try:
        monkeypatch.setenv("SMALLGPT_BF16", "0")
        device.precision.cache_clear()
        first = run_main("train.py", *TINY_RUN, *run, "--dtype=auto", "--optimizer=muon", "--max_iters=5")
        assert "precision: float32 (chosen), Muon's Newton-Schulz in float32" in first.stdout, first.stderr
        monkeypatch.setenv("SMALLGPT_BF16", "1")
        device.precision.cache_clear()
        resumed = run_main("train.py", *run, "--init_from=resume", "--max_iters=10")
        assert resumed.returncode == 0, resumed.stderr
        assert "precision: float32 (kept from the checkpoint's start), Muon's Newton-Schulz in float32" in resumed.stdout
        again = run_main("train.py", *run, "--init_from=auto", "--dtype=auto", "--max_iters=12")  # a restart's own line
        assert "precision: float32 (kept from the checkpoint's start)" in again.stdout, again.stderr
        changed = run_main("train.py", *run, "--init_from=resume", "--max_iters=15", "--dtype=bfloat16")
        assert "precision: bfloat16 (as set), Muon's Newton-Schulz in bfloat16" in changed.stdout, changed.stderr  # chosen anew
    finally:
        device.precision.cache_clear()


def test_a_shorter_run_on_the_command_line_fits_a_config_files_warmup(tmp_path, char_dataset):
    """`train.py CONFIG --max_iters=5` where CONFIG sets warmup_iters=20: a smoke test, so the config
    file's warmup is fitted (with a note) as the default's is; a warmup given on the command line, or a
    config file that contradicts itself, is still refused."""
    config = tmp_path / "config.py"
    config.write_text("warmup_iters = 20\nmax_iters = 100\n")
    args = [a for a in TINY_RUN if not a.startswith("--warmup_iters")] + [f"--dataset={char_dataset}"]
    smoke = run_main("train.py", str(config), *args, "--max_iters=5", f"--out_dir={tmp_path / 'a'}")
    assert smoke.returncode == 0, smoke.stderr
    assert "note: warmup_iters=20 (set by a config file) is longer than max_iters=5; using warmup_iters=0" in smoke.stdout
    for extra, out in ((["--max_iters=5", "--warmup_iters=20"], "b"), ([], "c")):
        (tmp_path / "bad.py").write_text("warmup_iters = 20\nmax_iters = 5\n")
        refused = run_main("train.py", str(config if extra else tmp_path / "bad.py"), *args, *extra, f"--out_dir={tmp_path / out}")
        assert refused.returncode == 2 and "warmup_iters=20 must be in [0, max_iters=5]" in refused.stderr, refused.stderr
