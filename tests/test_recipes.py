"""tools/recipes.py: its commands are the documentation's own, each figure it checks is stated, and the fast
tier of the chat recipe (a short fine-tune, its held-out exact match) runs in the suite."""

import importlib.util
import json
import random

import pytest

from conftest import ROOT, SFT_RUN, WORDS, run_main

spec = importlib.util.spec_from_file_location("recipes", ROOT / "tools" / "recipes.py")
recipes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipes)


@pytest.mark.parametrize("name", recipes.RECIPES)
def test_a_recipes_commands_are_printed_in_its_document_and_its_figure_is_stated(name):
    """What the tool runs is what a reader copies: each command verbatim in the README (an eval line less
    the --json the tool reads its figure from), and the figure it compares with is still stated."""
    recipe = recipes.RECIPES[name]
    readme = (ROOT / "README.md").read_text()
    documents = readme + (ROOT / recipe.source).read_text()
    for command in recipe.commands:
        assert recipes.JSON_FLAG.sub("", command) in documents, command
    low, high = recipes.documented(recipe)
    assert 0 < low <= high


def test_recipes_refuses_an_unknown_recipe_in_one_line():
    result = run_main("tools/recipes.py", "quick")
    assert result.returncode == 2 and result.stderr == "error: no recipe quick: choose from quickstart, chat, lora, rl, speedrun, vit, mlm, authors, seq2seq\n"


def copy_first_word(n, seed):
    """Conversations of the chat recipe's kind, small enough for the suite: the user gives one to three
    words, the assistant answers the first (a rule over characters it can see, as shout and reverse are)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
        out.append({"task": "copy", "messages": [{"role": "user", "content": " ".join(words)},
                                                 {"role": "assistant", "content": words[0]}]})
    return out


def test_the_chat_recipes_fast_tier_a_short_fine_tune_answers_held_out_conversations(tmp_path, trained_run):
    """The chat recipe's commands at the suite's size: data/prepare.py on conversations, train.py's
    fine-tune (300 steps of 16, 2 s), eval.py --chats on 60 held-out ones: 0.77-0.78 exact match here
    (2-core Xeon, 1 or 2 threads). With the loss mask shifted by one (the targets' mask taken from the
    inputs' positions, ConversationSampler.sample) it scores 0.000, and its val loss, scored under the
    same wrong mask, still falls (0.14): the exact match is what catches it."""
    import train

    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in copy_first_word(400, seed=0)))
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(c) + "\n" for c in copy_first_word(60, seed=1)))
    made = run_main("data/prepare.py", str(tmp_path / "chats.jsonl"), f"--out={tmp_path / 'data'}",
                    f"--tokenizer_from={trained_run}")
    assert made.returncode == 0, made.stderr
    train.main([*SFT_RUN, f"--init_from={trained_run}", f"--dataset={tmp_path / 'data'}", f"--out_dir={tmp_path / 'sft'}",
                "--max_iters=300", "--eval_interval=100", "--batch_size=16", "--learning_rate=1e-2", "--log_interval=100"])
    result = run_main("eval.py", f"--out_dir={tmp_path / 'sft'}", f"--chats={tmp_path / 'held.jsonl'}", "--device=cpu",
                      "--max_new_tokens=12", f"--json={tmp_path / 'score.json'}")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "score.json").read_text())["exact_match"] >= 0.5, result.stdout
