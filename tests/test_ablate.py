"""ablate.py: a study's variants and seeds, its tables, shrunk and quick forms, refused studies, signals."""

import pytest

import ablate
from conftest import ROOT, read_metrics, run_script

STUDY = """
title = "tiny"
base = dict(dataset={dataset!r}, n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=6,
            warmup_iters=1, learning_rate=3e-3, eval_interval=3, eval_iters=2, log_interval=3, dtype="float32",
            device="cpu")
variants = {{"learned": dict(pos_emb="learned"), "rope": dict(pos_emb="rope", norm="rmsnorm")}}
seeds = [1, 2]
targets = [4.5, 0.1]
"""


def write_study(tmp_path, dataset, text=STUDY):
    path = tmp_path / "study.py"
    path.write_text(text.format(dataset=dataset))
    return str(path)


def test_runs_every_variant_and_seed_then_tables(tmp_path, char_dataset, capsys):
    study = write_study(tmp_path, char_dataset)
    ablate.main([study, f"--out_dir={tmp_path / 'out'}"])
    table = (tmp_path / "out" / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| variant")
            and not line.startswith("| ---")]
    assert [r.split(" | ")[0] for r in rows] == ["| learned", "| rope", "| learned", "| rope"]
    assert all("±" in r and r.endswith("| no |") for r in rows[:2])
    assert "| final val bits per byte |" in table and all(r.split(" | ")[4].count("±") == 1 for r in rows[:2])
    assert "| learned | 0 | - |" in table  # val <= 4.5 from the start; 0.1 never
    for variant in ("learned", "rope"):
        for seed in (1, 2):
            assert [r["iter"] for r in read_metrics(tmp_path / "out" / variant / f"seed{seed}") if "val_loss" in r] == [0, 3, 6]
    # the two seeds differ, so the std is real
    a = read_metrics(tmp_path / "out" / "rope" / "seed1")[-1]["val_loss"]
    b = read_metrics(tmp_path / "out" / "rope" / "seed2")[-1]["val_loss"]
    assert a != b
    capsys.readouterr()
    ablate.main([study, f"--out_dir={tmp_path / 'out'}"])  # again: nothing is retrained, and it says so per run
    out = capsys.readouterr().out
    assert out.count(": finished earlier") == 4 and "eval 0" not in out and "iter 0" not in out
    assert "] learned seed 1\n" not in out  # no line announcing a run that does not happen
    assert f"wrote {tmp_path / 'out' / 'results.md'}, {tmp_path / 'out' / 'loss_curves.png'}\n" in out


def test_a_study_shrinks_from_the_command_line_into_its_own_folder(tmp_path, char_dataset, capsys, monkeypatch):
    study = write_study(tmp_path, char_dataset, STUDY.replace('"rope": dict', '"+ RoPE (norm)": dict'))
    monkeypatch.chdir(tmp_path)
    ablate.main([study, "--max_iters=3", "--seeds=1"])
    root = tmp_path / "out-ablations" / "study-max_iters3-seeds1"  # not the full study's folder
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["learned", "rope-norm"]  # plain folder names
    assert [p.name for p in (root / "learned").iterdir()] == ["seed1"]
    assert [r["iter"] for r in read_metrics(root / "rope-norm" / "seed1") if "val_loss" in r] == [0, 3]
    table = (root / "results.md").read_text()
    assert table.startswith("# tiny [shrunk: --max_iters=3 --seeds=1; figures not the study's]")
    assert "`python ablate.py " in table and "--max_iters=3 --seeds=1`: 1 seed(s)" in table
    capsys.readouterr()
    for args, message in [(["--max_iter=3"], "max_iters"), (["--seeds=3"], "has 2 seed(s)"), (["--seeds=-1"], "must be >= 0")]:
        with pytest.raises(SystemExit) as exit:
            ablate.main([study, *args])
        assert exit.value.code == 2 and message in capsys.readouterr().err


def test_a_shorter_run_on_the_command_line_fits_the_studys_warmup(tmp_path, char_dataset, capsys, monkeypatch):
    study = write_study(tmp_path, char_dataset, STUDY.replace("warmup_iters=1,", "warmup_iters=4,"))
    monkeypatch.chdir(tmp_path)
    ablate.main([study, "--max_iters=2", "--seeds=1"])
    assert "note: warmup_iters=4 (set by a config file) is longer than max_iters=2; using warmup_iters=0" in capsys.readouterr().out
    assert [r["iter"] for r in read_metrics(tmp_path / "out-ablations" / "study-max_iters2-seeds1" / "rope" / "seed1")
            if "val_loss" in r] == [0, 2]


def test_quick_form_uses_the_studys_quick_keys(tmp_path, char_dataset, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bare = write_study(tmp_path, char_dataset)
    with pytest.raises(SystemExit) as exit:
        ablate.main([bare, "--quick=True"])
    assert exit.value.code == 2 and "has no quick form" in capsys.readouterr().err
    study = write_study(tmp_path, char_dataset, STUDY + "quick = dict(max_iters=2, eval_interval=2, seeds=1)\n")
    ablate.main([study, "--quick=True", "--n_embd=8"])
    root = tmp_path / "out-ablations" / "study-quick-n_embd8"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["learned", "rope"]
    assert [p.name for p in (root / "rope").iterdir()] == ["seed1"]
    assert [r["iter"] for r in read_metrics(root / "rope" / "seed1") if "val_loss" in r] == [0, 2]
    assert "--quick=True --n_embd=8`: 1 seed(s)" in (root / "results.md").read_text()


# every study file in config/ablations: a new one is covered without editing this test
STUDIES = sorted(path.stem for path in (ROOT / "config" / "ablations").glob("*.py"))


@pytest.mark.parametrize("study", STUDIES)
def test_every_study_has_a_quick_form_that_loads(study):
    from conftest import ROOT

    runs, loaded = ablate.load_study(str(ROOT / "config" / "ablations" / f"{study}.py"), quick=True)
    assert len(loaded["seeds"]) == 1 and runs


def test_typo_fails_before_any_training(tmp_path, char_dataset, capsys):
    bad = STUDY.replace('"rope": dict(pos_emb="rope", norm="rmsnorm")', '"rope": dict(pos_emb="rope", nrom="rmsnorm")')
    study = write_study(tmp_path, char_dataset, bad)
    with pytest.raises(SystemExit) as exit:
        ablate.main([study, f"--out_dir={tmp_path / 'out'}"])
    assert exit.value.code == 2
    assert "variant 'rope': unknown key 'nrom'; did you mean norm" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_invalid_value_fails_before_any_training(tmp_path, char_dataset, capsys):
    bad = STUDY.replace('dict(pos_emb="learned")', 'dict(pos_emb="learned", n_embd=15)')
    with pytest.raises(SystemExit) as exit:
        ablate.main([write_study(tmp_path, char_dataset, bad), f"--out_dir={tmp_path / 'out'}"])
    assert exit.value.code == 2 and "n_embd=15 must be divisible by n_head=2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_token_budget_sets_steps(tmp_path, char_dataset):
    text = STUDY.replace("max_iters=6,", "") + "tokens = 4 * 16 * 5\n"
    runs, _ = ablate.load_study(write_study(tmp_path, char_dataset, text))
    assert {c.max_iters for _, _, c, _ in runs} == {5}


def test_diverged_variant_is_reported(tmp_path, char_dataset):
    text = STUDY.replace('"learned": dict(pos_emb="learned")',
                         '"learned": dict(pos_emb="learned", learning_rate=1e30, min_lr=1e30, grad_clip=0.0)')
    ablate.main([write_study(tmp_path, char_dataset, text), f"--out_dir={tmp_path / 'out'}"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| learned |" in table and "yes (2/2)" in table


def test_a_variant_continuing_a_diverged_one_is_reported_diverged_not_missing(tmp_path, char_dataset):
    text = STUDY.replace('"learned": dict(pos_emb="learned")',
                         '"learned": dict(pos_emb="learned", learning_rate=1e30, min_lr=1e30, grad_clip=0.0)')
    text += 'continue_from = {{"rope": "learned"}}\n'
    ablate.main([write_study(tmp_path, char_dataset, text), f"--out_dir={tmp_path / 'out'}"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert "Partial" not in table and "| rope |" in table and table.count("yes (2/2)") == 2, table


def test_a_signal_stops_the_whole_study(tmp_path, char_dataset, monkeypatch, capsys):
    import signal

    import train

    calls = []

    def interrupted(c, explicit):  # as train.train returns after saving on SIGTERM
        calls.append(c.seed)
        return {"iter": 1, "signal": int(signal.SIGTERM), "best_val_loss": 4.0}

    monkeypatch.setattr(train, "train", interrupted)
    with pytest.raises(SystemExit) as exit:
        ablate.main([write_study(tmp_path, char_dataset), f"--out_dir={tmp_path / 'out'}"])
    assert exit.value.code == 128 + signal.SIGTERM and calls == [1]
    assert "run the same command again to continue" in capsys.readouterr().out


def test_a_study_stopped_part_way_has_its_table_so_far(tmp_path, char_dataset, monkeypatch, capsys):
    """results.md (and the curves) after each finished run, the missing runs marked; the time left is
    printed from the runs so far. Stopped after 2 of 4 runs (learned's two seeds), by SIGTERM in the third."""
    import signal

    import train

    real, calls = train.train, []

    def third_is_stopped(c, explicit):
        calls.append(c.seed)
        if len(calls) == 3:
            return {"iter": 1, "signal": int(signal.SIGTERM), "best_val_loss": 4.0}
        return real(c, explicit)

    monkeypatch.setattr(train, "train", third_is_stopped)
    with pytest.raises(SystemExit):
        ablate.main([write_study(tmp_path, char_dataset), f"--out_dir={tmp_path / 'out'}"])
    out = capsys.readouterr().out
    assert "[1/4] learned seed 1\n" in out and "[2/4] learned seed 2 (about " in out and " left for the study's 3 runs to go" in out
    table = (tmp_path / "out" / "results.md").read_text()
    assert "**Partial: 2 of 4 runs not finished yet**" in table
    learned = next(line for line in table.splitlines() if line.startswith("| learned |"))
    assert learned.count("±") == 3  # both seeds in its figures
    assert "| rope (not run yet) | - | - | - |" in table
    monkeypatch.setattr(train, "train", real)
    ablate.main([write_study(tmp_path, char_dataset), f"--out_dir={tmp_path / 'out'}"])  # continues: rope's two
    table = (tmp_path / "out" / "results.md").read_text()
    assert "Partial" not in table and "| rope |" in table


LENGTH_STUDY = """
base = dict(dataset={dataset!r}, n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=4,
            warmup_iters=1, learning_rate=3e-3, eval_interval=4, eval_iters=2, log_interval=2, dtype="float32",
            device="cpu", pos_emb="rope")
variants = {{"rope16": {{}}, "alibi16": dict(pos_emb="alibi"), "learned16": dict(pos_emb="learned"),
             "rope32, fine-tuned": dict(block_size=32, rope_scaling="linear", rope_factor=2.0, max_iters=6)}}
continue_from = {{"rope32, fine-tuned": "rope16"}}
eval_lengths = [16, 32]
eval_as = {{"rope16, linear x2": ("rope16", dict(rope_scaling="linear", rope_factor=2.0))}}
"""


def test_length_study_fine_tunes_from_a_variant_and_scores_every_context(tmp_path, char_dataset):
    out = tmp_path / "out"
    ablate.main([write_study(tmp_path, char_dataset, LENGTH_STUDY), f"--out_dir={out}"])
    from checkpoint import load_checkpoint

    tuned = load_checkpoint(str(out / "rope32-fine-tuned" / "seed1337" / "ckpt.pt"))
    assert tuned["iter_num"] == 6 and tuned["model_config"]["block_size"] == 32
    assert (tuned["model_config"]["trained_block_size"], tuned["model_config"]["rope_scaling"]) == (16, "linear")
    parent = load_checkpoint(str(out / "rope16" / "seed1337" / "ckpt.pt"))
    assert parent["iter_num"] == 4 and parent["model_config"]["block_size"] == 16  # untouched by its fine-tune
    table = (out / "results.md").read_text()
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ") and line.count("|") == 4}
    assert set(rows) >= {"rope16", "alibi16", "rope32, fine-tuned", "rope16, linear x2"}, table
    assert rows["learned16"].endswith(" | - |")  # learned positions cannot run at 32: a dash, not a failed study
    import json

    scores = json.loads((out / "rope16" / "seed1337" / "lengths.json").read_text())
    assert scores["32 {}"] != scores['32 {"rope_factor": 2.0, "rope_scaling": "linear"}']  # scaled at evaluation
    assert len(scores) == 4 and all(0 < s < 10 for s in scores.values())


def test_ablate_with_gpt2_offline_is_one_line(tmp_path, char_dataset):
    """init_from=gpt2 without network or a Hugging Face cache: PretrainedError, a UserError like any other."""
    study = tmp_path / "study.py"
    study.write_text(f"base = dict(dataset={char_dataset!r}, init_from='gpt2', max_iters=2, eval_interval=2, "
                     "eval_iters=1, batch_size=2, device='cpu', dtype='float32')\nvariants = {'gpt2': {}}\n")
    result = run_script("ablate.py", str(study), f"--out_dir={tmp_path / 'out'}",
                        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: variant 'gpt2' seed 1337: could not download 'gpt2'"), result.stderr
    assert "Traceback" not in result.stderr


MQAR_STUDY = """
title = "tiny recall"
base = dict(n_layer=1, n_head=2, n_embd=16, batch_size=4, max_iters=4, warmup_iters=1, learning_rate=3e-3,
            eval_interval=4, eval_iters=2, log_interval=4, dtype="float32", device="cpu")
variants = {{f"{{k}}, {{p}} pairs": dict(attn_pattern=k, dataset=str({root!r}) + f"/mqar{{p}}", block_size=4 * p)
            for k in ("L", "R") for p in (2, 4)}}
seeds = [1]
axis = dict(label="pairs", points={{f"{{k}}, {{p}} pairs": (k, p) for k in ("L", "R") for p in (2, 4)}})
"""


def test_a_masked_datasets_study_tabulates_accuracy_by_its_axis(tmp_path, capsys):
    """MQAR runs get their final val accuracy (eval.py's, the queried values only), in the main table and
    in the axis table (series x pairs); a malformed axis is refused before anything trains."""
    import eval as evaluation
    from conftest import run_main

    for pairs in (2, 4):
        made = run_main("data/mqar/prepare.py", f"--pairs={pairs}", "--keys=8", "--values=8", "--train=40", "--val=10",
                        f"--out_dir={tmp_path / f'mqar{pairs}'}")
        assert made.returncode == 0, made.stderr
    study = tmp_path / "study.py"
    study.write_text(MQAR_STUDY.format(root=str(tmp_path)))
    ablate.main([str(study), f"--out_dir={tmp_path / 'out'}"])
    table = (tmp_path / "out" / "results.md").read_text()
    assert "| final val accuracy |" in table and "by pairs:" in table
    for k in ("L", "R"):
        scores = [evaluation.evaluate(evaluation.EvalConfig(out_dir=str(tmp_path / "out" / f"{k.lower()}-{p}-pairs" / "seed1")))
                  ["accuracy"] for p in (2, 4)]
        assert f"| {k} | {scores[0]:.4f} | {scores[1]:.4f} |" in table  # the axis table: the eval.py figures
        assert f"| {k}, 4 pairs |" in table and f"| {scores[1]:.4f} |" in table.split(f"| {k}, 4 pairs |")[1].split("\n")[0]
    capsys.readouterr()
    study.write_text(MQAR_STUDY.format(root=str(tmp_path)).replace("(k, p) for", "k for"))
    with pytest.raises(SystemExit):
        ablate.main([str(study), f"--out_dir={tmp_path / 'bad'}"])
    assert "axis must be dict(label=..., points={variant: (series, x), ...})" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
