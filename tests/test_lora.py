"""lora.py: adapters that start as the base and merge exactly, a LoRA run's checkpoint (adapters only, its base
checked by sha256), exact resume, and one-line errors for keys LoRA cannot take."""

import pytest
import torch
from conftest import SFT_RUN, build, one_error_line, read_metrics, run_main


def test_lora_starts_as_the_base_and_merged_equals_unmerged():
    import lora

    model = build(vocab_size=61)
    idx = torch.randint(61, (2, 12))
    base = model(idx)[0]
    lora.apply(model, 4, 16.0, 0.0, lora.parse_targets("all"))
    assert torch.equal(model(idx)[0], base)  # B = 0: exactly the base
    with_rows = lora.apply(build(vocab_size=61), 4, 16.0, 0.0, lora.parse_targets("qkv"), new_rows_from=57)
    assert torch.allclose(with_rows(idx)[0], base, atol=1e-6)
    for name, p in lora.trainable(model).items():
        torch.nn.init.normal_(p, std=0.05)
    unmerged = model(idx)[0]
    assert (unmerged - base).abs().max() > 1e-3
    lora.merge(model)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert (model(idx)[0] - unmerged).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, trained_run, chat_data):
    import train

    out = tmp_path_factory.mktemp("lora")
    train.main([*SFT_RUN, f"--init_from={trained_run}", f"--dataset={chat_data[1]}", f"--out_dir={out}", "--max_iters=6",
                "--eval_interval=3", "--lora_rank=4", "--lora_targets=qkv,mlp_fc", "--learning_rate=1e-2"])
    return str(out)


def test_a_lora_checkpoint_holds_the_adapters_and_loads_merged(lora_run, trained_run):
    import lora
    from checkpoint import load_checkpoint, load_model, lora_model

    state = load_checkpoint(f"{lora_run}/ckpt.pt")
    assert state["lora"]["base"] == str(__import__("pathlib").Path(trained_run).resolve())
    assert state["lora"]["base_sha256"] == lora.file_sha256(f"{trained_run}/ckpt.pt")
    assert sorted({k.rsplit(".", 1)[-1] for k in state["model"]}) == ["lora_a", "lora_b", "rows"]
    assert sum(v.numel() for v in state["model"].values()) < 0.1 * sum(v.numel() for v in load_checkpoint(f"{trained_run}/ckpt.pt")["model"].values())
    merged = load_model(lora_run)[0]  # what sample, serve, eval and export load
    unmerged = lora_model(state, lora_run, merged=False).eval()
    idx = torch.randint(merged.config.vocab_size, (2, 20))
    assert (merged(idx)[0] - unmerged(idx)[0]).abs().max() <= 1e-5
    assert (merged(idx)[0] - load_model(trained_run)[0].add_tokens(48, [48, 49, 50, 51])(idx)[0]).abs().max() > 1e-4  # it learned


def test_a_lora_run_resumes_exactly(tmp_path, trained_run, chat_data):
    import train

    keys = [*SFT_RUN, f"--init_from={trained_run}", f"--dataset={chat_data[1]}", "--eval_interval=3", "--lora_rank=2"]
    train.main([*keys, f"--out_dir={tmp_path / 'whole'}", "--max_iters=6"])
    train.main([*keys, f"--out_dir={tmp_path / 'cut'}", "--max_iters=3", "--lr_decay_iters=6"])
    train.main([f"--out_dir={tmp_path / 'cut'}", "--init_from=resume", "--max_iters=6"])
    whole, cut = (read_metrics(str(tmp_path / d)) for d in ("whole", "cut"))
    assert [r["loss"] for r in whole if "loss" in r] == [r["loss"] for r in cut if "loss" in r]
    # lora_targets' default: every matrix of the blocks (on qkv alone the chat tasks learned almost nothing)
    from checkpoint import load_checkpoint

    state = load_checkpoint(str(tmp_path / "whole" / "ckpt.pt"))
    adapted = {".".join(k.split(".")[2:-1]) for k in state["model"] if k.endswith(".lora_a")}
    assert adapted == {"attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"} and state["lora"]["targets"] == "all"


def test_a_changed_base_is_refused(tmp_path, lora_run):
    import shutil

    from checkpoint import load_checkpoint, save_checkpoint

    state = load_checkpoint(f"{lora_run}/ckpt.pt")
    base = tmp_path / "base"
    shutil.copytree(state["lora"]["base"], base)
    state["lora"] = {**state["lora"], "base": str(base)}
    (tmp_path / "run").mkdir()
    save_checkpoint(str(tmp_path / "run" / "ckpt.pt"), state)
    assert run_main("chat.py", f"--out_dir={tmp_path / 'run'}", "--prompt=the", "--device=cpu").returncode == 0
    base_state = load_checkpoint(str(base / "ckpt.pt"))
    base_state["iter_num"] += 1
    save_checkpoint(str(base / "ckpt.pt"), base_state)
    result = run_main("chat.py", f"--out_dir={tmp_path / 'run'}", "--prompt=the", "--device=cpu")
    assert result.returncode == 2 and "changed since the LoRA run began" in one_error_line(result)


@pytest.mark.parametrize("keys, message", [
    (["--init_from=scratch"], "lora_rank > 0 fine-tunes a trained model"),
    (["--optimizer=muon"], "set optimizer=adamw"),
    (["--lora_targets=q,v"], "lora_targets='q,v': use a comma list of qkv, attn_proj, mlp_fc, mlp_proj"),
    (["--lora_dropout=1.0"], "lora_dropout=1.0 in [0, 1)"),
])  # fmt: skip
def test_bad_lora_keys_get_one_line(tmp_path, trained_run, chat_data, keys, message):
    result = run_main("train.py", *SFT_RUN, f"--init_from={trained_run}", f"--dataset={chat_data[1]}", f"--out_dir={tmp_path}",
                      "--lora_rank=4", *keys)
    assert result.returncode == 2 and message in one_error_line(result)
