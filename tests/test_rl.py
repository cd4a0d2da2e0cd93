"""rl.py: rewards, GRPO's groups and update (against a naive loop), exact resume, a user's own task, bad input."""

import dataclasses
import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from conftest import WORDS, build, one_error_line, run_main

import rl

# ----------------------------------------------------------------------------------------------------
# The pieces


def test_rewards_score_exact_match_and_characters_in_place():
    assert rl.exact(" nezarb ", "nezarb", []) == 1.0 and rl.exact("nezar", "nezarb", []) == 0.0
    assert rl.chars("nezarb", "nezarb", []) == 1.0
    assert rl.chars("nezaXb", "nezarb", []) == pytest.approx(5 / 6)
    assert rl.chars("nezarbbb", "nezarb", []) == pytest.approx(6 / 8)  # extra characters cost
    assert rl.chars("", "", []) == 1.0 and rl.chars("x", "", []) == 0.0


def test_advantages_are_measured_within_each_group_and_only_mixed_groups_count():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1]])
    adv, mixed = rl.advantages(rewards, scale=False)
    assert mixed.tolist() == [True, False, True, False]  # (0.1 four times: a float32 std of ~7e-9, not a mixed group)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5])) and adv[1].abs().sum() == 0
    assert torch.allclose(adv[2], torch.tensor([0.375, -0.125, -0.125, -0.125])) and adv[3].abs().sum() == 0
    scaled, _ = rl.advantages(rewards, scale=True)
    assert torch.allclose(scaled[0], torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.75 ** 0.5)  # / the sample std, (1/3) ** 0.5
    assert scaled[3].abs().sum() == 0
    same, mixed = rl.advantages(torch.full((1, 16), 5 / 6), scale=True)  # (a float32 std of 6e-8: was "mixed")
    assert not mixed.any() and same.abs().sum() == 0


def naive_loss(model, rows, temperature):
    """-(advantage x log p) over each reply's tokens, one row at a time, over the number of reply tokens."""
    total, count = 0.0, 0
    for prompt, reply, advantage in rows:
        seq = torch.tensor([prompt + reply])
        logits, _ = model(seq[:, :-1])
        logp = F.log_softmax(logits[0] / temperature, dim=-1)
        for j, token in enumerate(reply):
            total = total - advantage * logp[len(prompt) - 1 + j, token]
            count += 1
    return total / count


def test_the_update_is_the_advantage_weighted_log_likelihood_of_the_replies_alone():
    model = build(vocab_size=40)
    rows = [([1, 2, 3], [4, 5], 0.75), ([7, 8, 9, 10, 11], [12], -0.25), ([3], [2, 6, 6, 1], -0.5)]
    c = rl.RLConfig(temperature=0.7)
    loss, logged = rl.policy_loss(model, None, rows, c, "cpu")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = naive_loss(model, rows, 0.7)
    naive = torch.autograd.grad(expected, list(model.parameters()))
    assert torch.allclose(loss, expected, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, naive))
    assert logged["entropy"] > 0 and "kl" not in logged
    # the KL term: zero against itself, positive against another model, and it adds kl_coef x itself
    kl = dataclasses.replace(c, kl_coef=0.5)
    same, logged = rl.policy_loss(model, model, rows, kl, "cpu")
    assert logged["kl"] == pytest.approx(0.0, abs=1e-7) and torch.allclose(same, loss, atol=1e-6)
    other, logged = rl.policy_loss(model, build(seed=1, vocab_size=40), rows, kl, "cpu")
    assert logged["kl"] > 0.01 and torch.allclose(other, loss + 0.5 * logged["kl"], atol=1e-5)


def test_prompts_are_drawn_in_a_seeded_order_that_resumes():
    items = [("t", i) for i in range(5)]
    a = rl.Prompts(items, seed=3)
    first = a.take(7)  # a pass and two of the next
    assert sorted(x[1] for x in first[:5]) == list(range(5))
    b = rl.Prompts(items, seed=3)
    b.load_state_dict(a.state_dict())
    assert a.take(6) == b.take(6)
    with pytest.raises(rl.ConfigError, match="resume with the file it ran on"):
        rl.Prompts(items[:4], seed=3).load_state_dict(a.state_dict())


# ----------------------------------------------------------------------------------------------------
# Runs: a user's task with its own reward, exact resume, what reads the result


SPELL_REWARD = '''
import os, signal
calls = {"n": 0}

def spell(reply, reference, messages):
    """A user's reward for "spell WORD with dots": the fraction of the reference's characters in place."""
    assert messages[-1]["role"] == "user" and messages[-1]["content"].startswith("spell ")
    calls["n"] += 1
    if calls["n"] == int(os.environ.get("STOP_AT_CALL", "0")):  # a stop request mid-run (SIGINT, as Ctrl-C)
        os.kill(os.getpid(), signal.SIGINT)
    if calls["n"] == int(os.environ.get("KILL_AT_CALL", "0")):  # killed: nothing saved since the last checkpoint
        raise SystemExit(137)
    right = sum(a == b for a, b in zip(reply.strip(), reference))
    return right / max(len(reply.strip()), len(reference))
'''


def spell_conversations(words, path):
    with open(path, "w") as f:
        for w in words:
            f.write(json.dumps({"task": "spell", "messages": [{"role": "user", "content": f"spell {w}"},
                                                              {"role": "assistant", "content": ".".join(w)}]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def spell_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("spell")
    (root / "my_rewards.py").write_text(SPELL_REWARD)
    short = [w for w in WORDS if len(w) <= 5]
    return (root, spell_conversations(short[::2], root / "rl.jsonl"), spell_conversations(short[1::2], root / "val.jsonl"))


def rl_args(sft_run, spell_task, out, *extra):
    root, prompts, val = spell_task
    return [f"--init_from={sft_run}", f"--out_dir={out}", f"--prompts={prompts}", f"--eval_chats={val}",
            f"--rewards=spell={root / 'my_rewards.py'}:spell", "--group_size=8", "--prompts_per_step=4",
            "--max_new_tokens=12", "--learning_rate=3e-3", "--min_lr=3e-3", "--eval_interval=2", "--pass_per_task=2",
            "--device=cpu", *extra]


def metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_a_run_stopped_or_killed_mid_step_resumes_exactly(sft_run, spell_task, tmp_path, monkeypatch):
    """A run stopped by SIGINT mid-step (the reward sends it: it saves after the step), resumed, then killed
    mid-step (the reward exits: the last checkpoint is the evaluation's) and resumed again ends with the
    weights and metrics of an uninterrupted run."""
    whole = tmp_path / "whole"
    assert run_main("rl.py", *rl_args(sft_run, spell_task, whole, "--max_iters=4")).returncode == 0
    monkeypatch.setenv("STOP_AT_CALL", str(4 * 8 + 5))  # inside the second step's scoring
    handlers = {s: signal.getsignal(s) for s in rl.StopRequest.SIGNALS}
    try:
        stopped = run_main("rl.py", *rl_args(sft_run, spell_task, tmp_path / "split", "--max_iters=4"))
    finally:  # (after a stop request the command line leaves handlers that end the process: pytest's own)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert stopped.returncode == 128 + signal.SIGINT and "continue with --init_from=resume" in stopped.stdout
    monkeypatch.delenv("STOP_AT_CALL")
    monkeypatch.setenv("KILL_AT_CALL", str(4 * 8 + 5))  # (calls count from the resumed process's start) step 3's scoring
    assert run_main("rl.py", f"--out_dir={tmp_path / 'split'}", "--init_from=resume").returncode == 137
    monkeypatch.delenv("KILL_AT_CALL")
    resumed = run_main("rl.py", f"--out_dir={tmp_path / 'split'}", "--init_from=resume")
    assert resumed.returncode == 0, resumed.stderr
    a, b = (torch.load(p / "ckpt.pt", weights_only=True) for p in (whole, tmp_path / "split"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    drop = lambda records: [{k: v for k, v in r.items() if k != "elapsed"} for r in records]  # noqa: E731
    assert drop(metrics(whole)) == drop(metrics(tmp_path / "split"))
    steps = [r for r in metrics(whole) if "reward" in r]
    assert [r["iter"] for r in steps] == list(range(4)) and "reward_spell" in steps[0] and "pass_spell" in metrics(whole)[0]
    assert a["iter_num"] == 4 and a["rl_config"]["rewards"].startswith("spell=")


def test_rl_raises_the_reward_of_a_users_task(sft_run, spell_task, tmp_path):
    """The guide's example: "spell WORD" (here with dots: the test model's characters have no dash), added with
    a reward function of the user's (a file, partial credit per character in place). The tiny model answers
    nothing like it (reward ~0.02); a few steps at a high rate (here 6) learn the reply's shape, dots between
    letters (~0.27: the dots alone are 3/7 of "k.i.n.g")."""
    out = tmp_path / "learn"
    result = run_main("rl.py", *rl_args(sft_run, spell_task, out, "--max_iters=14", "--eval_interval=14",
                                        "--pass_per_task=0", "--learning_rate=0.1", "--min_lr=0.1"))
    assert result.returncode == 0, result.stderr
    rewards = [r["reward_spell"] for r in metrics(out) if "reward" in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards


def test_the_result_is_a_chat_model_that_eval_chat_and_export_read(sft_run, spell_task, tmp_path):
    out = tmp_path / "run"
    assert run_main("rl.py", *rl_args(sft_run, spell_task, out, "--max_iters=1", "--pass_per_task=0")).returncode == 0
    scored = run_main("eval.py", f"--out_dir={out}", f"--chats={spell_task[2]}", "--device=cpu", f"--json={tmp_path / 'e.json'}")
    assert scored.returncode == 0, scored.stderr
    held = [r for r in metrics(out) if "exact_match" in r]
    assert held[-1]["exact_match"] == json.loads((tmp_path / "e.json").read_text())["exact_match"]  # rl.py's figure is eval.py's
    again = run_main("train.py", f"--out_dir={out}", "--init_from=resume")
    assert again.returncode == 2 and "written by rl.py" in one_error_line(again)
    drawn = run_main("plot.py", str(out), f"--out={tmp_path / 'rl.png'}")  # nine panels; the summary per task
    assert drawn.returncode == 0 and "held-out exact match" in drawn.stdout and "spell 0.000 -> " in drawn.stdout, drawn.stderr
    assert (tmp_path / "rl.png").stat().st_size > 10_000 or "matplotlib is not installed" in drawn.stdout
    mixed = run_main("plot.py", str(out), sft_run)
    assert mixed.returncode == 2 and "plot them separately" in one_error_line(mixed)


@pytest.mark.parametrize("extra, message", [
    (["--temperature=0"], "temperature=0"),
    (["--group_size=1"], "group_size=1"),
    (["--reward=nope"], "reward 'nope'"),
    (["--rewards=spell"], "is not task=reward"),
    (["--rewards=spell=missing.py:spell"], "no file missing.py"),
    (["--rewards=spell=json:nothing"], "json has no function nothing"),
    (["--rewards=spell=builtins:slice"], "a reward is a number in [0, 1]"),
    (["--rewards=spel=chars"], "no conversation of task 'spel'"),
    (["--rewards=spell=operator:truediv"], "the reward of task 'spell' raised TypeError"),
    (["--tasks=count"], "tasks: count not in"),
])  # fmt: skip
def test_bad_input_is_one_line(sft_run, spell_task, tmp_path, extra, message):
    result = run_main("rl.py", *rl_args(sft_run, spell_task, tmp_path / "bad", "--max_iters=1", *extra))
    assert result.returncode == 2 and message in one_error_line(result)


def test_it_starts_from_a_chat_model_and_resumes_only_its_own_runs(trained_run, sft_run, spell_task, tmp_path):
    data = [f"--prompts={spell_task[1]}", f"--eval_chats={spell_task[2]}"]
    long = spell_conversations(["king", "queen " * 8], tmp_path / "long.jsonl")  # a prompt past block_size (32)
    result = run_main("rl.py", f"--init_from={sft_run}", f"--prompts={long}", f"--eval_chats={spell_task[2]}",
                      f"--out_dir={tmp_path / 'x'}")
    assert result.returncode == 2 and "long.jsonl: conversation 1 (task 'spell') has a prompt of" in one_error_line(result)
    for args, message in ((["--init_from="], "init_from: give the chat run"),
                          ([f"--init_from={trained_run}"], "is not a chat model"),
                          ([f"--init_from={sft_run}", f"--out_dir={sft_run}"], "exists: continue it"),
                          (["--init_from=resume", f"--out_dir={sft_run}"], "written by train.py, not rl.py"),
                          ([f"--init_from={tmp_path}"], "no such checkpoint")):
        result = run_main("rl.py", *data, *args)
        assert result.returncode == 2 and message in one_error_line(result), (args, result.stderr)
