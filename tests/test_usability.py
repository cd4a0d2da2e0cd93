"""What a new user trips over (issue 15): each as a subprocess, where the exit code and the message matter."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, TINY_RUN, run_main, run_script


def one_error_line(result):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    return lines[-1]


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


def test_backslash_escapes_in_stop_and_start(trained_run):
    """--stop='\\n' as a shell passes it (a backslash and an n) means a newline, as in --help."""
    result = run_main("sample.py", f"--out_dir={trained_run}", "--start=The\\nking", "--stop=\\n", "--num_samples=1",
                        "--temperature=0", "--max_new_tokens=200", "--device=cpu")
    assert result.returncode == 0, result.stderr
    sample = result.stdout.split("\n---------------\n")[0]
    assert sample.startswith("The\nking") and "\\" not in sample
    assert "\n" not in sample[len("The\nking") :]  # cut before the first newline it generated


def test_stream_prints_the_prompt_as_batch_mode_does(trained_run):
    args = [f"--out_dir={trained_run}", "--start=The king", "--num_samples=1", "--seed=3", "--max_new_tokens=30",
            "--device=cpu"]
    batch, stream = run_main("sample.py", *args), run_main("sample.py", *args, "--stream=True")
    assert batch.returncode == 0 and stream.returncode == 0, batch.stderr + stream.stderr
    assert stream.stdout.startswith("The king")
    assert stream.stdout == batch.stdout.replace("---------------\n", "")


@pytest.mark.parametrize("script", ["sample.py", "train.py"])
def test_gpt2_offline_is_one_line_naming_hf_download(script, tmp_path, char_dataset):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    extra = [f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'out'}"] if script == "train.py" else []
    result = run_script(script, "--init_from=gpt2", "--device=cpu", *extra, env=env, timeout=120)
    assert result.returncode == 2
    line = one_error_line(result)
    assert "could not download 'gpt2'" in line and "hf download openai-community/gpt2" in line
    assert "huggingface-cli" not in line


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
                          "--eval_interval=1000", env={"OMP_NUM_THREADS": "1"})
    wait_for(proc, "iter 0:")
    time.sleep(0.3)  # inside the step of iteration 1
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc)
    assert proc.returncode == 128 + signal.SIGINT
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("error: interrupted again; stopped at once"), err


def gpt2_or_skip():
    from dataset import TiktokenTokenizer

    try:
        TiktokenTokenizer("gpt2")
    except Exception as e:  # no ../shared tiktoken cache and no network
        pytest.skip(f"tiktoken gpt2 files unavailable: {e}")


def prepare_fineweb(tmp_path, *args, env=None):
    return run_script("data/fineweb/prepare.py", f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}",
                      "--num_proc=1", *args, env=env, timeout=300)


@pytest.mark.slow
def test_one_text_file_is_split_into_documents(tmp_path):
    gpt2_or_skip()
    text = tmp_path / "one.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the king spoke to the queen.\nA second line." for i in range(30)))
    result = prepare_fineweb(tmp_path, "--data_files", str(text), "--val_docs=3")
    assert result.returncode == 0, result.stderr
    counts = [int(s.replace(",", "")) for s in result.stdout.split("train ")[1].split(" tokens")[0:1]]
    assert counts[0] > 0 and "val 0 tokens" not in result.stdout and "complete" in result.stdout
    # all of it held out: refused, with the way out, and no meta.json claiming a dataset
    result = prepare_fineweb(tmp_path / "again", "--data_files", str(text))
    assert result.returncode != 0
    assert "30 documents and --val_docs=2000 would hold out all of them" in result.stderr
    assert not (tmp_path / "again" / "out" / "meta.json").exists()


def test_hub_prepare_without_network_fails_at_once_naming_data_files(tmp_path):
    gpt2_or_skip()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") or k == "HF_HOME"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "data/fineweb/prepare.py", f"--out_dir={tmp_path / 'out'}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env={**env, "HF_HOME": str(tmp_path / "hf")})
    if result.returncode == 0:
        pytest.skip("this machine reaches the Hugging Face Hub")
    assert time.perf_counter() - started < 30
    assert "--data_files" in result.stderr and "Traceback" not in result.stderr


def greedy_sample(*args):
    result = run_main("sample.py", *args, "--start=The king", "--num_samples=1", "--temperature=0",
                        "--max_new_tokens=20", "--device=cpu")
    assert result.returncode == 0, result.stderr
    return result.stdout.split("\n---------------\n")[0]


def assert_export_scores_as_run(tmp_path, hf_dir, run, source):
    """eval.py on the export and on the run it came from, over source (--text=... or --dataset=...): the
    same bytes, and bits per byte equal to 1e-5."""
    scored = {}
    for name, model in (("export", f"--init_from={hf_dir}"), ("run", f"--out_dir={run}")):
        result = run_main("eval.py", model, source, "--device=cpu", "--dtype=float32", f"--json={tmp_path / name}.json")
        assert result.returncode == 0, result.stderr
        scored[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert scored["export"]["bits_per_byte"] == pytest.approx(scored["run"]["bits_per_byte"], rel=1e-5)
    assert scored["export"]["bytes"] == scored["run"]["bytes"] > 0


@pytest.mark.slow
def test_export_round_trip_gpt2_bpe(tmp_path):
    """GPT-2-shaped BPE model -> export.py -> transformers' AutoTokenizer + AutoModelForCausalLM: the same
    greedy text as sample.py, and sample.py --init_from=<export> gives it too."""
    transformers = pytest.importorskip("transformers")
    gpt2_or_skip()
    from conftest import make_text
    from dataset import TiktokenTokenizer, prepare_text

    prepare_text(make_text(20_000), TiktokenTokenizer("gpt2"), str(tmp_path / "data"))
    out, hf_dir = tmp_path / "run", tmp_path / "hf"
    trained = run_main("train.py", *TINY_RUN, f"--dataset={tmp_path / 'data'}", f"--out_dir={out}", "--max_iters=3")
    assert trained.returncode == 0, trained.stderr
    # offline without tiktoken's files: one line and nothing written (it was 50 lines and weights alone)
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty"), "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    refused = run_script("export.py", f"--out_dir={out}", f"--hf_dir={hf_dir}", env=offline)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "TIKTOKEN_CACHE_DIR" in lines[0], refused.stderr[-2000:]
    assert not hf_dir.exists()
    exported = run_main("export.py", f"--out_dir={out}", f"--hf_dir={hf_dir}")
    assert exported.returncode == 0 and "GPT-2's BPE" in exported.stdout, exported.stderr
    ours = greedy_sample(f"--out_dir={out}")
    assert greedy_sample(f"--init_from={hf_dir}") == ours
    text = tmp_path / "text.txt"
    text.write_text(make_text(2_000, seed=3))
    assert_export_scores_as_run(tmp_path, hf_dir, out, f"--text={text}")

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = tokenizer("The king", return_tensors="pt").input_ids
    assert ids[0].tolist() == TiktokenTokenizer("gpt2").encode("The king")
    generated = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=20, min_new_tokens=20,
                               do_sample=False, pad_token_id=0)
    assert tokenizer.decode(generated[0]) == ours


def test_export_of_a_character_model_has_a_tokenizer_transformers_loads(tmp_path, trained_run, char_dataset):
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    exported = run_main("export.py", f"--out_dir={trained_run}", f"--hf_dir={hf_dir}")
    assert exported.returncode == 0 and "character vocabulary" in exported.stdout, exported.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    from checkpoint import load_model
    from dataset import tokenizer_from_meta

    ours = tokenizer_from_meta(load_model(trained_run)[1]["tokenizer"])
    text = "The king speak thou\nnoble heart."
    assert tokenizer.encode(text, add_special_tokens=False) == ours.encode(text) != []
    assert tokenizer.decode(ours.encode(text)) == text
    assert greedy_sample(f"--init_from={hf_dir}") == greedy_sample(f"--out_dir={trained_run}")
    # no end-of-text token in a character vocabulary: none named in config.json (it said GPT-2's 50256)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert (hf_dir / "model.safetensors").stat().st_mode & 0o044 == 0o044  # readable by others, as config.json
    # a character outside the vocabulary: one line, as from the checkpoint (it was a tokenizers traceback)
    for source in (f"--init_from={hf_dir}", f"--out_dir={trained_run}"):
        refused = run_main("sample.py", source, "--start=The \u00bf", "--num_samples=1", "--max_new_tokens=5", "--device=cpu")
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            "error: characters not in the vocabulary: '¿'; a character-level model knows only the "
            f"{ours.vocab_size} characters of its training text"], refused.stderr
    # bits per byte of the export on the run's own dataset: the checkpoint's figure (it was refused)
    assert_export_scores_as_run(tmp_path, hf_dir, trained_run, f"--dataset={char_dataset}")


def test_own_bpe_end_to_end(tmp_path, bpe_run):
    """data/prepare.py --tokenizer=bpe:N -> train -> sample -> eval's bits per byte -> export: transformers'
    tokenizer gives our ids and the export our greedy text and figures."""
    transformers = pytest.importorskip("transformers")
    from checkpoint import load_model
    from dataset import BPETokenizer, read_meta, tokenizer_from_meta

    data, run = bpe_run
    meta = read_meta(data)
    ours = tokenizer_from_meta(meta["tokenizer"])
    assert isinstance(ours, BPETokenizer) and meta["vocab_size"] == ours.vocab_size == 400
    assert open(os.path.join(data, "tokenizer.json")).read() == ours.json
    assert load_model(run)[1]["tokenizer"] == meta["tokenizer"]  # the checkpoint carries the whole tokenizer
    # learned from the train split only: a train word is one token, the val split's words stay in pieces
    from conftest import WORDS

    assert all(len(ours.encode(" " + w)) == 1 for w in WORDS)
    assert all(len(ours.encode(" " + w)) >= 4 for w in ("zebra", "quokka", "axolotl"))
    text = "The king said: \u00bfqu\u00e9?  \U0001F600\n\nend"  # byte-level: no character is unknown
    assert ours.decode(ours.encode(text)) == text

    hf_dir = tmp_path / "hf"
    exported = run_main("export.py", f"--out_dir={run}", f"--hf_dir={hf_dir}")
    assert exported.returncode == 0 and "BPE of 400 tokens" in exported.stdout, exported.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.encode(text, add_special_tokens=False) == ours.encode(text)
    assert tokenizer.decode(ours.encode(text)) == text
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["eos_token_id"] == config["bos_token_id"] == ours.eot_token == 0
    assert greedy_sample(f"--init_from={hf_dir}") == greedy_sample(f"--out_dir={run}") != ""
    assert_export_scores_as_run(tmp_path, hf_dir, run, f"--dataset={data}")


def test_plot_draws_one_png_of_several_runs(tmp_path, trained_run):
    pytest.importorskip("matplotlib")
    out = tmp_path / "runs.png"
    result = run_main("plot.py", trained_run, trained_run, f"--out={out}")
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert result.stdout.count("best val") == 2 and f"wrote {out}" in result.stdout


def test_plot_without_matplotlib_prints_the_summary(tmp_path, trained_run):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "matplotlib.py").write_text("raise ImportError('hidden for this test')\n")
    result = run_script("plot.py", trained_run, f"--out={tmp_path / 'x.png'}", env={"PYTHONPATH": str(shim)})
    assert result.returncode == 0, result.stderr
    assert "best val" in result.stdout and "matplotlib is not installed" in result.stdout
    assert not (tmp_path / "x.png").exists()


def test_plot_of_a_directory_without_metrics_is_one_error_line(tmp_path):
    result = run_main("plot.py", str(tmp_path))
    assert result.returncode == 2 and "no metrics.jsonl" in one_error_line(result)


def test_out_dir_given_as_the_checkpoint_file_names_the_folder(trained_run, capsys):
    import sample

    with pytest.raises(SystemExit) as exit:
        sample.main([f"--out_dir={trained_run}/ckpt.pt", "--device=cpu"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == (f"error: {trained_run}/ckpt.pt is the checkpoint file; out_dir takes its "
                                               f"folder: --out_dir={trained_run}")


def test_init_from_a_run_folder_fine_tunes_it_with_its_own_tokenizer_only(tmp_path, trained_run, char_dataset, capsys):
    import train
    from dataset import char_tokenizer_for, prepare_text

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
