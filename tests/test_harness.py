"""harness.py (eval.py --tasks): our lm-eval adapter against lm-eval's HF backend on the export, request by request."""

import json
import random

import pytest

from conftest import TINY_RUN, WORDS, make_text, run_main

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is an optional extra (requirements-eval.txt)")
pytest.importorskip("transformers")

BLOCK = 32  # TINY_RUN's block_size: some requests below exceed it


def write_tasks(folder):
    """Three local tasks: multiple choice (with contexts past block_size), rolling loglikelihood and greedy
    generation, each a YAML file over a jsonl the harness reads with datasets' json builder."""
    rng = random.Random(0)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    mc = [{"context": sentence(rng.choice([3, 6, 30, 45])).capitalize(),
           "choices": [sentence(rng.randint(1, 4)) for _ in range(4)], "label": rng.randrange(4)} for _ in range(24)]
    mc[0]["context"] = ""  # an empty context: conditioned on the prefix token
    rolling = [{"text": make_text(rng.choice([40, 150, 400]), seed=i)} for i in range(20)]
    gen = [{"context": sentence(rng.choice([2, 5, 40])).capitalize(), "answer": sentence(2)} for _ in range(20)]
    tasks = {
        "tiny_mc": (mc, "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
                        "doc_to_target: \"{{label}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"),
        "tiny_rolling": (rolling, "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                                  "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n"),
        "tiny_gen": (gen, "output_type: generate_until\ndoc_to_text: \"{{context}}\"\ndoc_to_target: \"{{answer}}\"\n"
                          "generation_kwargs:\n  until: [\"\\n\"]\n  do_sample: false\n  max_gen_toks: 12\n"
                          "metric_list:\n  - metric: exact_match\n"),
    }
    for name, (rows, body) in tasks.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                             f"    test: {data}\ntest_split: test\n{body}")
    return list(tasks)


def test_the_guides_task_yaml_loads_without_warnings(tmp_path, caplog):
    """docs/guide.md's example of a task of your own, verbatim but for its data path: lm-eval builds it
    and warns about nothing (it warned twice per metric, at every run, without aggregation and
    higher_is_better)."""
    import logging
    import re

    from conftest import ROOT

    yaml = re.search(r"```yaml\n(.*?)```", (ROOT / "docs" / "guide.md").read_text(), re.S).group(1)
    assert "/abs/path/items.jsonl" in yaml
    (tmp_path / "items.jsonl").write_text(json.dumps({"context": "The king", "choices": [" spoke", " slept"], "label": 0}) + "\n")
    (tmp_path / "my_choice.yaml").write_text(yaml.replace("/abs/path/items.jsonl", str(tmp_path / "items.jsonl")))
    from lm_eval.tasks import TaskManager, get_task_dict

    with caplog.at_level(logging.INFO):
        tasks = get_task_dict(["my_choice"], TaskManager(include_path=str(tmp_path), include_defaults=False))
    assert len(list(tasks["my_choice"].test_docs())) == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


ARCHITECTURES = {
    "gpt2": [],
    "llama": ["--pos_emb=rope", "--norm=rmsnorm", "--mlp=swiglu", "--bias=False", "--n_head=4", "--n_kv_head=2",
              "--tie_embeddings=False"],
}


@pytest.fixture(scope="module")
def bpe_dataset(tmp_path_factory):
    from dataset import prepare_text
    from tokenizer import TiktokenTokenizer

    try:
        tokenizer = TiktokenTokenizer("gpt2")
    except Exception as e:  # no ../shared tiktoken cache and no network
        pytest.skip(f"tiktoken gpt2 files unavailable: {e}")
    out = tmp_path_factory.mktemp("bpe") / "data"
    prepare_text(make_text(30_000), tokenizer, str(out))
    return out


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    return folder, write_tasks(folder)


@pytest.fixture(scope="module")
def manager(task_folder):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_folder[0]), include_defaults=False)


def trained_and_exported(tmp_path, bpe_dataset, arch):
    out, hf_dir = tmp_path / "run", tmp_path / "hf"
    trained = run_main("train.py", *TINY_RUN, *ARCHITECTURES[arch], f"--dataset={bpe_dataset}", f"--out_dir={out}",
                         "--max_iters=120", "--eval_interval=120", "--learning_rate=2e-2", "--batch_size=8")
    assert trained.returncode == 0, trained.stderr
    exported = run_main("export.py", f"--out_dir={out}", f"--hf_dir={hf_dir}")
    assert exported.returncode == 0, exported.stderr
    return out, hf_dir


def by_doc(samples):
    return {s["doc_id"]: s for s in samples}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_request_scores_as_lm_evals_hf_backend_does(tmp_path, bpe_dataset, task_folder, manager, arch):
    import torch
    from lm_eval.evaluator import simple_evaluate

    import harness
    from checkpoint import load_any

    out, hf_dir = trained_and_exported(tmp_path, bpe_dataset, arch)
    _, tasks = task_folder
    model, tokenizer, _ = load_any(str(out))
    lm = harness.GPTHarness(model.eval(), tokenizer, "cpu", batch_size=5, context=torch.autocast("cpu", enabled=False))
    ours = harness.run_tasks(lm, tasks, task_manager=manager, log_samples=True)
    theirs = simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                             tasks=tasks, batch_size=1, task_manager=manager, log_samples=True, verbosity="ERROR")

    # multiple choice: each choice's loglikelihood and is_greedy, then the same accuracy
    mine, hf = by_doc(ours["samples"]["tiny_mc"]), by_doc(theirs["samples"]["tiny_mc"])
    assert len(mine) == len(hf) == 24
    long_contexts, worst = 0, 0.0
    for doc_id, sample in mine.items():
        context = sample["arguments"][0][0]  # the same requests on both sides
        assert [a for a in sample["arguments"]] == [a for a in hf[doc_id]["arguments"]]
        long_contexts += len(tokenizer.encode(context + sample["arguments"][0][1])) > BLOCK
        for (ll, greedy), (hf_ll, hf_greedy) in zip((r[0] for r in sample["resps"]), (r[0] for r in hf[doc_id]["resps"])):
            assert ll == pytest.approx(hf_ll, abs=1e-4) and greedy == hf_greedy
            worst = max(worst, abs(ll - hf_ll))
    assert long_contexts >= 5  # the left truncation rule was exercised
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]

    # rolling loglikelihood: per document, several windows for the long ones
    mine, hf = by_doc(ours["samples"]["tiny_rolling"]), by_doc(theirs["samples"]["tiny_rolling"])
    assert max(len(tokenizer.encode(s["arguments"][0][0])) for s in mine.values()) > 2 * BLOCK
    for doc_id, sample in mine.items():
        assert sample["resps"][0][0] == pytest.approx(hf[doc_id]["resps"][0][0], abs=1e-4)
        worst = max(worst, abs(sample["resps"][0][0] - hf[doc_id]["resps"][0][0]))
    print(f"{arch}: largest loglikelihood difference {worst:.2e}, accuracy {ours['results']['tiny_mc']['acc,none']}")

    # greedy generation: the same text, stop strings applied the same way
    mine, hf = by_doc(ours["samples"]["tiny_gen"]), by_doc(theirs["samples"]["tiny_gen"])
    assert [mine[d]["filtered_resps"] for d in sorted(mine)] == [hf[d]["filtered_resps"] for d in sorted(hf)]
    stopped = [s for s in mine.values() if len(lm.tok_encode(s["filtered_resps"][0])) < 12]
    assert len(stopped) >= 5 and any(s["filtered_resps"][0].strip() for s in stopped)  # text, then a stop string


def test_eval_py_runs_local_tasks_on_a_character_model(tmp_path, trained_run, task_folder):
    """The command line end to end, on a char model (no end-of-text token: the newline is the prefix)."""
    folder, _ = task_folder
    out = tmp_path / "tasks.json"
    result = run_main("eval.py", f"--out_dir={trained_run}", "--tasks=tiny_mc,tiny_rolling,tiny_gen",
                      f"--include_path={folder}", "--limit=6", "--device=cpu", f"--json={out}")
    assert result.returncode == 0, result.stderr
    assert "tiny_mc" in result.stdout and "acc" in result.stdout and "bits_per_byte" in result.stdout
    saved = json.loads(out.read_text())
    assert 0 <= saved["results"]["tiny_mc"]["acc,none"] <= 1 and saved["results"]["tiny_rolling"]["bits_per_byte,none"] > 0


@pytest.mark.parametrize("tasks, message", [
    ("tiny_mcq", "unknown task(s) tiny_mcq (tiny_mcq: did you mean tiny_mc"),
    ("hellaswag", "could not be downloaded"),  # tests run offline: its data is on the Hub
])
def test_a_task_that_cannot_run_is_one_line_and_writes_nothing(tmp_path, trained_run, task_folder, tasks, message):
    import time

    out = tmp_path / "tasks.json"
    started = time.perf_counter()
    result = run_main("eval.py", f"--out_dir={trained_run}", f"--tasks={tasks}", f"--include_path={task_folder[0]}",
                      "--device=cpu", f"--json={out}")
    assert result.returncode == 2, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and message in error[0] and "--include_path" in error[0], result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    assert time.perf_counter() - started < 60  # not datasets' half minute of retries on top of the task index
