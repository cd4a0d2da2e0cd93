"""Conversations: the chat template and its loss mask, supervised fine-tuning through train.py, chat.py (LoRA:
test_lora.py)."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import SFT_RUN, WORDS, build, conversations, one_error_line, read_metrics, run_main

from dataset import ConversationSampler, read_meta
from model import lm_loss
from tokenizer import CHAT_TOKENS, CharTokenizer, ChatTokenizer, tokenizer_from_meta


def expected(tokenizer, messages):
    """The template written out independently of ChatTokenizer.render: (ids, trained)."""
    V = tokenizer.base.vocab_size
    ids, trained = [], []
    for m in messages:
        content = tokenizer.base.encode(m["content"])
        ids += [V + CHAT_TOKENS.index(f"<|{m['role']}|>"), *content, V + 3]
        trained += [0] + [int(m["role"] == "assistant")] * (len(content) + 1)
    return ids, trained


def test_the_mask_trains_the_assistants_tokens_and_nothing_else(chat_data):
    path, data = chat_data
    meta = read_meta(data)
    tokenizer = tokenizer_from_meta(meta["tokenizer"])
    assert isinstance(tokenizer, ChatTokenizer) and meta["vocab_size"] == tokenizer.base.vocab_size + 4
    train_part = [json.loads(line)["messages"] for line in path.read_text().splitlines()][: meta["sequences"]["train"]["conversations"]]
    rows = {}
    for messages in train_part:
        ids, trained = expected(tokenizer, messages)
        assert tokenizer.render(messages) == (ids, trained)
        rows[tuple(ids[:-1])] = [t if k else -1 for t, k in zip(ids[1:], trained[1:])]
    sampler = ConversationSampler(data, "train", 64, seed=0, vocab_size=meta["vocab_size"])
    x, y = sampler.sample(40)
    assert x.shape[1] == 64  # padded to the longest, rounded up to 64
    for xr, yr in zip(x.tolist(), y.tolist()):
        key = max((k for k in rows if tuple(xr[: len(k)]) == k), key=len)  # the conversation this row holds
        assert yr[: len(key)] == rows[key] and set(yr[len(key) :]) <= {-1}
        user_noise = [t for t, target in zip(xr[1:], yr) if target == -1]
        assert user_noise  # system, user and role tokens are inputs only


def test_fine_tuning_reports_the_loss_over_trained_tokens_of_the_whole_step(chat_data, trained_run, tmp_path):
    """Iteration 0's logged loss = the summed cross-entropy over the trained targets of both micro-batches,
    divided by their count (not the mean of the two micro-batch means, which differs here)."""
    import train
    from checkpoint import load_model

    data = chat_data[1]
    train.main([*SFT_RUN, f"--init_from={trained_run}", f"--dataset={data}", f"--out_dir={tmp_path}", "--max_iters=1",
                "--eval_interval=1", "--gradient_accumulation_steps=2", "--batch_size=3", "--warmup_iters=0"])
    logged = read_metrics(str(tmp_path))[1]["loss"]
    model = load_model(trained_run)[0]
    base = model.config.vocab_size
    model.add_tokens(base, list(range(base, base + 4)))
    meta = read_meta(data)
    x, y = ConversationSampler(data, "train", model.config.block_size, 1337, meta["vocab_size"]).sample(6)
    with torch.no_grad():
        logits = model(x)[0]
    nll = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, reduction="none").view(y.shape)
    counts = [(y[r] != -1).sum() for r in (slice(0, 3), slice(3, 6))]
    assert counts[0] != counts[1]
    whole = (nll.sum() / (y != -1).sum()).item()
    mean_of_means = sum(nll[r].sum() / n for r, n in zip((slice(0, 3), slice(3, 6)), counts)).item() / 2
    assert logged == pytest.approx(whole, abs=1e-5) and abs(whole - mean_of_means) > 1e-4
    assert read_metrics(str(tmp_path))[0]["val_loss"] > 0


def test_a_micro_batch_with_nothing_trained_gives_zero_not_nan():
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.full((2, 5), -1)
    loss, ce = lm_loss(logits, targets, normalizer=torch.tensor(3.0))
    loss.backward()
    assert loss.item() == 0.0 and ce.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    assert math.isnan(lm_loss(logits, targets)[0].item())  # what a plain mean gives
    smoothed = lm_loss(logits, targets, z_loss=1e-4, label_smoothing=0.1, normalizer=torch.tensor(3.0))[0]
    assert smoothed.item() == 0.0


def test_the_chat_tokens_rows_start_at_the_mean_and_old_logits_stay():
    model = build(vocab_size=61)
    idx = torch.randint(61, (1, 9))
    before = model(idx)[0]
    model.add_tokens(60, [60, 61, 62, 63])  # row 60 a padding row, 61-63 new
    assert model.config.vocab_size == 64 and model.lm_head.weight is model.tok_emb.weight
    mean = model.tok_emb.weight[:60].mean(0)
    assert all(torch.equal(model.tok_emb.weight[i], mean) for i in (60, 61, 62, 63))
    after = model(idx)[0]
    assert torch.allclose(after[..., :60], before[..., :60], atol=1e-6)


def test_fine_tuning_adds_the_chat_tokens_and_chat_answers_one_turn(sft_run, trained_run):
    from checkpoint import load_model

    model, state = load_model(sft_run)
    assert state["tokenizer"]["kind"] == "chat" and model.config.vocab_size == load_model(trained_run)[0].config.vocab_size + 4
    result = run_main("chat.py", f"--out_dir={sft_run}", "--prompt=the king", "--temperature=0", "--max_new_tokens=6",
                      "--device=cpu")
    assert result.returncode == 0, result.stderr
    from chat import Conversation
    from generate import Sampling
    from quantize import for_inference

    conversation = Conversation(for_inference(model, "float32"), tokenizer_from_meta(state["tokenizer"]), Sampling(temperature=0), 0)
    assert result.stdout == conversation.reply("the king", 6) + "\n"  # the reply alone


def test_chat_refuses_a_base_model(trained_run):
    result = run_main("chat.py", f"--out_dir={trained_run}", "--prompt=hi", "--device=cpu")
    assert result.returncode == 2 and "no chat template" in one_error_line(result)


def test_a_second_turn_runs_only_its_new_tokens_and_equals_a_fresh_run():
    import generate
    from chat import Conversation

    base = CharTokenizer("".join(sorted(set(" ".join(WORDS)))))
    tokenizer = ChatTokenizer(base)
    model = build(vocab_size=tokenizer.vocab_size, block_size=96)
    conversation = Conversation(model, tokenizer, generate.Sampling(temperature=0), 0, system="be brief")
    conversation.reply("the king", 8)
    fed = []
    forward = model.forward_cached
    model.forward_cached = lambda idx, cache=None, last=1: (fed.append(idx.size(1)), forward(idx, cache, last))[1]
    before = list(conversation.ids)
    reply = conversation.reply("sweet love", 8)
    turn = tokenizer.render([{"role": "user", "content": "sweet love"}], add_generation_prompt=True)[0]
    assert fed[0] <= len(turn) + 2 and all(n == 1 for n in fed[1:])  # the new turn (and the last reply's end), then one each
    del model.forward_cached
    assert conversation.ids[: len(before)] == before
    messages = conversation.messages[:-1]
    prompt = tokenizer.render(messages, add_generation_prompt=True)[0]
    fresh = generate.generate(model, torch.tensor([prompt]), 8, generate.Sampling(temperature=0), eos_token_id=tokenizer.end_token,
                              use_cache=False)[0, len(prompt) :].tolist()
    fresh = fresh[: next((i for i, t in enumerate(fresh) if t in tokenizer.names), len(fresh))]  # up to a chat token
    assert tokenizer.decode(fresh) == reply and conversation.messages[-1] == {"role": "assistant", "content": reply}


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}', "chats.jsonl:2: messages[1].role: 'bot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "chats.jsonl:2: messages[0].content: expected a string"),
    ('{"text": "hi"}', "chats.jsonl:2: expected an object with a 'messages' list"),
    ('{"messages": [{"role": "user", "content": "hi"}]', "chats.jsonl:2: not JSON"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "conversation 1: no assistant turn"),
])  # fmt: skip
def test_bad_conversations_name_the_line_and_field(tmp_path, trained_run, line, message):
    good = json.dumps(conversations(1)[0])
    (tmp_path / "chats.jsonl").write_text(good + "\n" + line + "\n" + good + "\n")
    result = run_main("data/prepare.py", str(tmp_path / "chats.jsonl"), f"--out={tmp_path / 'out'}",
                      f"--tokenizer_from={trained_run}")
    assert result.returncode == 2 and message in result.stderr.strip().splitlines()[-1], result.stderr


def test_tokenizer_from_must_be_a_run(tmp_path):
    (tmp_path / "chats.jsonl").write_text(json.dumps(conversations(1)[0]) + "\n")
    result = run_main("data/prepare.py", str(tmp_path / "chats.jsonl"), f"--out={tmp_path / 'out'}", f"--tokenizer_from={tmp_path}")
    assert result.returncode == 2 and "no ckpt.pt there" in result.stderr


# ---------------------------------------------------------------------------------------------------
# Measuring it: eval.py on conversations, and the chat_tasks example


def test_eval_scores_a_chat_split_on_its_trained_tokens(sft_run, chat_data):
    from checkpoint import load_model

    result = run_main("eval.py", f"--out_dir={sft_run}", "--device=cpu")
    assert result.returncode == 0, result.stderr
    model = load_model(sft_run)[0].eval()
    data = chat_data[1]
    meta = read_meta(data)
    val = ConversationSampler(data, "val", 10**6, 0, meta["vocab_size"])
    total = n = 0
    with torch.no_grad():
        for start, length in val.convs:
            length = min(length, model.config.block_size + 1)  # as train.py sees it
            ids = torch.from_numpy(val.tokens.window(start, length))
            trained = torch.from_numpy(val.mask.window(start, length))[1:].bool()
            nll = F.cross_entropy(model(ids[None, :-1])[0][0].double(), ids[1:], reduction="none")
            total, n = total + nll[trained].sum().item(), n + int(trained.sum())
    assert f"{n:,} tokens" in result.stdout and f"loss {total / n:.4f}" in result.stdout, result.stdout


def test_eval_chats_gives_exact_match_per_task(tmp_path, sft_run, monkeypatch):
    from chat import Conversation
    from checkpoint import load_any
    from generate import Sampling
    from quantize import for_inference

    model, tokenizer, _ = load_any(sft_run)
    model = for_inference(model, "float32")
    records = []
    for i, word in enumerate(["the", "king", "love", "night"]):
        reply = Conversation(model, tokenizer, Sampling(temperature=0), 0).reply(word, 8)
        answer = reply if i % 2 == 0 else reply + "x"  # two right, two wrong, by construction
        records.append({"task": "even" if i % 2 == 0 else "odd",
                        "messages": [{"role": "user", "content": word}, {"role": "assistant", "content": answer}]})
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(__import__("configurator"), "PROGRESS_SECONDS", 0.0)  # a line at every conversation
    result = run_main("eval.py", f"--out_dir={sft_run}", f"--chats={tmp_path / 'chats.jsonl'}", "--max_new_tokens=8",
                      "--device=cpu", f"--json={tmp_path / 'out.json'}")
    assert result.returncode == 0, result.stderr
    assert "| even | 2 | 1.000 |" in result.stdout and "| odd | 2 | 0.000 |" in result.stdout and "**0.500**" in result.stdout
    progress = [line for line in result.stderr.splitlines() if line.startswith("answering: ")]  # a log's progress
    assert [line.split(",")[0] for line in progress] == [f"answering: {i} of 4 conversations" for i in (1, 2, 3)]
    assert all(line.endswith(" left") for line in progress), progress
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    bad = run_main("eval.py", f"--out_dir={sft_run}", f"--chats={tmp_path / 'bad.jsonl'}", "--device=cpu")
    assert bad.returncode == 2 and "the last message must be the assistant's reference answer" in one_error_line(bad)


def test_eval_chats_prompts_a_base_model_with_a_transcript(tmp_path, bpe_run):
    from checkpoint import load_any

    trained_run = bpe_run[1]  # a BPE: "User:" and "Assistant:" need characters the verse lacks
    model, tokenizer, _ = load_any(trained_run)
    shot = {"task": "t", "messages": [{"role": "user", "content": "the"}, {"role": "assistant", "content": "king"}]}
    ask = {"task": "t", "messages": [{"role": "user", "content": "love"}, {"role": "assistant", "content": "night"}]}
    for name, record in (("shots", shot), ("ask", ask)):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(record) + "\n")
    result = run_main("eval.py", f"--out_dir={trained_run}", f"--chats={tmp_path / 'ask.jsonl'}", "--chats_fewshot=1",
                      f"--chats_examples={tmp_path / 'shots.jsonl'}", "--max_new_tokens=1", "--device=cpu",
                      f"--json={tmp_path / 'out.json'}")
    assert result.returncode == 0, result.stderr
    from eval import chat_prompt

    prompt = chat_prompt(tokenizer, shot["messages"] + ask["messages"][:-1])
    assert tokenizer.decode(prompt) == "User: the\nAssistant: king\nUser: love\nAssistant:"
    out = model.eval().generate(torch.tensor([prompt]), 1, __import__("generate").Sampling(temperature=0))
    expected = tokenizer.decode(out[0, len(prompt):].tolist()).split("\n")[0].strip()
    assert json.loads((tmp_path / "out.json").read_text())["replies"][0]["reply"] == expected


PLAY = """KING:
The night is long and full of dread,
Yet love shall keep the crown.

QUEEN:
Speak softly, for the king is weary.
Good night, sweet lord of mine.

"""


def test_chat_tasks_are_right_by_construction_and_hold_out_their_val(tmp_path):
    import importlib.util

    (tmp_path / "play.txt").write_text(PLAY * 40 + PLAY.replace("KING", "FOOL").replace("QUEEN", "KING") * 4)
    result = run_main("data/chat_tasks/prepare.py", f"--input={tmp_path / 'play.txt'}", f"--out_dir={tmp_path}",
                      "--train=200", "--val=50")
    assert result.returncode == 0, result.stderr
    spec = importlib.util.spec_from_file_location("chat_tasks", str(__import__("conftest").ROOT / "data/chat_tasks/prepare.py"))
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    splits = {s: [json.loads(line) for line in (tmp_path / f"{s}.jsonl").read_text().splitlines()] for s in ("train", "val")}
    assert len(splits["train"]) == 200 and len(splits["val"]) == 50
    seen = {}
    for split, records in splits.items():
        for r in records:
            question, answer = r["messages"][-2]["content"], r["messages"][-1]["content"]
            task = r["task"]
            if task == "reverse":
                word = question.split()[1]
                assert answer == word[::-1]
                seen.setdefault((split, "word"), set()).add(word)
            elif task == "shout":
                assert answer == question.removeprefix("shout ").upper()
            elif task == "add":
                a, b = question.split(" plus ")
                assert tasks.NUMBERS.index(answer) == tasks.NUMBERS.index(a) + tasks.NUMBERS.index(b)
                seen.setdefault((split, "sum"), set()).add(question)
            elif task == "count":
                assert tasks.NUMBERS.index(answer) == len(question.removeprefix("count the words: ").split())
            else:
                assert question.startswith("Who says: ") and answer in ("KING", "QUEEN", "FOOL")
    assert not seen["val", "word"] & seen["train", "word"] and not seen["val", "sum"] & seen["train", "sum"]
    assert {r["messages"][-1]["content"] for r in splits["val"] if r["task"] == "speaker"} <= {"KING", "QUEEN"}  # seen in train (no FOOL)


def test_chat_tasks_find_the_quick_starts_text_offline(tmp_path, monkeypatch):
    """After an offline Quick start (prepare.py --input=PATH: no input.txt beside it), the chat tasks' prepare
    reads the text the Quick start's dataset records; with no such record it fails in one line (exit 2)
    saying to pass --input, and never stops on a traceback."""
    import importlib.util
    import sys

    (tmp_path / "play.txt").write_text(PLAY * 40)
    quick = tmp_path / "shakespeare_char"
    assert run_main("data/shakespeare_char/prepare.py", f"--input={tmp_path / 'play.txt'}", f"--out_dir={quick}").returncode == 0
    assert json.loads((quick / "meta.json").read_text())["source"] == str(tmp_path / "play.txt")
    spec = importlib.util.spec_from_file_location("chat_tasks", str(__import__("conftest").ROOT / "data/chat_tasks/prepare.py"))
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    monkeypatch.setattr(tasks, "QUICK_START", str(quick))
    monkeypatch.setattr(tasks, "HERE", str(tmp_path))  # where a download would land
    monkeypatch.setattr(tasks, "URL", "http://127.0.0.1:9/input.txt")  # nothing listens there: "offline"
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--out_dir={tmp_path / 'chats'}", "--train=20", "--val=5"])
    tasks.main()
    speakers = {json.loads(line)["messages"][-1]["content"] for line in (tmp_path / "chats" / "train.jsonl").open()
                if json.loads(line)["task"] == "speaker"}
    assert speakers <= {"KING", "QUEEN"} and speakers
    (tmp_path / "play.txt").unlink()  # the recorded text is gone: a download is tried, and fails in one line
    with pytest.raises(SystemExit) as exit:
        tasks.main()
    assert exit.value.code == 2


@pytest.mark.parametrize("script, args", [
    ("data/prepare.py", ["no-such-file.txt", "--out=x"]), ("data/shakespeare_char/prepare.py", ["--input=no-such-file.txt"]),
    ("data/shakespeare/prepare.py", ["--input=no-such-file.txt"]), ("data/chat_tasks/prepare.py", ["--input=no-such-file.txt"]),
    ("data/mqar/prepare.py", ["--pairs=0"]), ("data/fineweb/prepare.py", ["--data_files=no-such-file.txt", "--shard_size=0"]),
])  # fmt: skip
def test_every_prepare_script_exits_2_with_one_line_on_bad_input(tmp_path, script, args):
    """As every other command line does (cli_main): 2 and one line, not sys.exit(message)'s 1."""
    result = run_main(script, *args, f"--out_dir={tmp_path / 'out'}" if "--out=x" not in args else f"--out={tmp_path / 'x'}")
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert not (tmp_path / "out" / "meta.json").exists()


def test_conversations_from_a_hugging_face_dataset(tmp_path, trained_run):
    pytest.importorskip("datasets")
    folder = tmp_path / "hub_like"
    folder.mkdir()
    rows = [{"prompt_id": i, **c} for i, c in enumerate(conversations(20))]
    (folder / "train.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "task"}) + "\n" for r in rows))
    result = run_main("data/prepare.py", f"--hf_dataset={folder}", f"--out={tmp_path / 'out'}", f"--tokenizer_from={trained_run}")
    assert result.returncode == 0 and "20 conversations" in result.stdout, result.stderr
    from_file = tmp_path / "chats.jsonl"
    from_file.write_text("".join(json.dumps(c) + "\n" for c in conversations(20)))
    assert run_main("data/prepare.py", str(from_file), f"--out={tmp_path / 'same'}", f"--tokenizer_from={trained_run}").returncode == 0
    assert (tmp_path / "out" / "train.bin").read_bytes() == (tmp_path / "same" / "train.bin").read_bytes()
    offline = run_main("data/prepare.py", "--hf_dataset=HuggingFaceH4/no_robots", f"--out={tmp_path / 'x'}")
    assert offline.returncode == 2 and "cannot read HuggingFaceH4/no_robots from the Hugging Face Hub" in offline.stderr


def test_the_interactive_chat_streams_clears_and_exits(sft_run, monkeypatch, capsys):
    import builtins

    import chat

    lines = iter(["the king", "/clear", "", "the king", "/exit", "never read"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    chat.main([f"--out_dir={sft_run}", "--temperature=0", "--max_new_tokens=6", "--device=cpu"])
    out, err = capsys.readouterr()
    replies = out.split("\n")[:2]
    assert replies[0] == replies[1]  # after /clear the same greedy reply to the same first turn
    assert "(a new conversation)" in err and "/clear starts over, /exit ends" in err
    assert next(lines) == "never read"


def test_chat_tasks_rl_prompts_ask_nothing_training_asked_and_change_no_other_file(tmp_path):
    """--rl=N (issue 57's fresh prompts): questions from the training pools that no training conversation
    asks, answers right by construction, and train.jsonl and val.jsonl as they are without it."""
    (tmp_path / "play.txt").write_text(PLAY * 40)
    for out, extra in (("plain", []), ("rl", ["--rl=40"])):
        result = run_main("data/chat_tasks/prepare.py", f"--input={tmp_path / 'play.txt'}", f"--out_dir={tmp_path / out}",
                          "--train=100", "--val=20", *extra)
        assert result.returncode == 0, result.stderr
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "rl" / name).read_bytes()
    asked = {m["content"] for line in (tmp_path / "rl" / "train.jsonl").open() for m in json.loads(line)["messages"]
             if m["role"] == "user"}
    rl = [json.loads(line) for line in (tmp_path / "rl" / "rl.jsonl").open()]
    assert 0 < len(rl) <= 40 and "RL prompts" in result.stdout
    for r in rl:
        question, answer = r["messages"][-2]["content"], r["messages"][-1]["content"]
        assert question not in asked and len([m for m in r["messages"] if m["role"] == "user"]) == 1
        if r["task"] == "reverse":
            assert answer == question.split()[1][::-1]
    assert len({r["messages"][-2]["content"] for r in rl}) == len(rl)  # each asked once
    bad = run_main("data/chat_tasks/prepare.py", f"--input={tmp_path / 'play.txt'}", f"--out_dir={tmp_path / 'x'}", "--rl=-1")
    assert bad.returncode == 2 and "--rl=-1" in bad.stderr
