"""sample.py: seeded text, batches, stop strings, streaming, prompts from files, refused input in one line."""

import pytest

import sample
from checkpoint import load_any
from conftest import fails, run_main


def sample_config(**overrides):
    c = {k.name: k.default for k in sample.keys_of(sample.SampleConfig)}
    c.update(max_new_tokens=40, num_samples=1, device="cpu")
    c.update(overrides)
    return sample.SampleConfig(**c)


@pytest.fixture(scope="module")
def loaded(trained_run):
    model, tokenizer, _ = load_any(trained_run)
    return model.eval(), tokenizer


def texts(loaded, prompt="The ", **overrides):
    model, tokenizer = loaded
    return sample.generate_texts(model, tokenizer, prompt, sample_config(**overrides), "cpu")


def test_same_seed_same_text(loaded):
    assert texts(loaded, seed=7) == texts(loaded, seed=7)
    assert texts(loaded, seed=7) != texts(loaded, seed=8)


def test_batch_equals_single_runs_with_seed_plus_i(loaded):
    batch = texts(loaded, seed=100, num_samples=4)
    singles = [texts(loaded, seed=100 + i, num_samples=1)[0] for i in range(4)]
    assert batch == singles
    assert len(set(batch)) > 1


def test_stop_string_cuts_before_it(loaded):
    free = texts(loaded, seed=3, max_new_tokens=80)[0]
    for stop in ("e", "th", "o "):
        assert stop in free, "the test needs the stop string in the free-running text"
        cut = texts(loaded, seed=3, max_new_tokens=80, stop=stop)[0]
        assert cut == free[: free.index(stop)]


def test_stream_prints_the_same_text(loaded):
    model, tokenizer = loaded
    for stop in (None, "th"):
        pieces = []
        c = sample_config(seed=5, max_new_tokens=60, stop=stop)
        streamed = sample.stream_text(model, tokenizer, "The ", c, "cpu", pieces.append)
        assert "".join(pieces) == "The " + streamed and streamed == texts(loaded, seed=5, max_new_tokens=60, stop=stop)[0]
        assert len(pieces) > 5  # it arrived in pieces


def test_stream_prints_the_prompt_as_batch_mode_does(trained_run):
    args = [f"--out_dir={trained_run}", "--start=The king", "--num_samples=1", "--seed=3", "--max_new_tokens=30",
            "--device=cpu"]
    batch, stream = run_main("sample.py", *args), run_main("sample.py", *args, "--stream=True")
    assert batch.returncode == 0 and stream.returncode == 0, batch.stderr + stream.stderr
    assert stream.stdout.startswith("The king")
    assert stream.stdout == batch.stdout.replace("---------------\n", "")


def test_cli_prints_prompt_and_samples(trained_run):
    result = run_main("sample.py", f"--out_dir={trained_run}", "--start=The king", "--num_samples=2",
                        "--max_new_tokens=20", "--device=cpu")
    assert result.returncode == 0, result.stderr
    samples = result.stdout.split("---------------\n")
    assert len(samples) == 3 and samples[-1] == ""
    assert all(s.startswith("The king") and len(s) >= len("The king") + 20 for s in samples[:2])


def test_int8_weights_sample(trained_run):
    result = run_main("sample.py", f"--out_dir={trained_run}", "--start=The king", "--num_samples=2",
                        "--max_new_tokens=20", "--device=cpu", "--weights_dtype=int8")
    assert result.returncode == 0, result.stderr
    assert [s.startswith("The king") for s in result.stdout.split("---------------\n")] == [True, True, False]


def test_backslash_escapes_in_stop_and_start(trained_run):
    """--stop='\\n' as a shell passes it (a backslash and an n) means a newline, as in --help."""
    result = run_main("sample.py", f"--out_dir={trained_run}", "--start=The\\nking", "--stop=\\n", "--num_samples=1",
                        "--temperature=0", "--max_new_tokens=200", "--device=cpu")
    assert result.returncode == 0, result.stderr
    sample = result.stdout.split("\n---------------\n")[0]
    assert sample.startswith("The\nking") and "\\" not in sample
    assert "\n" not in sample[len("The\nking") :]  # cut before the first newline it generated


def test_file_prompt(trained_run, tmp_path, loaded):
    (tmp_path / "prompt.txt").write_text("The queen\n")
    result = run_main("sample.py", f"--out_dir={trained_run}", f"--start=FILE:{tmp_path / 'prompt.txt'}",
                        "--num_samples=1", "--max_new_tokens=15", "--seed=9", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The queen\n" + texts(loaded, "The queen\n", seed=9, max_new_tokens=15)[0] + "\n---------------\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--start=The king \u00a7\u00e9!"], "characters not in the vocabulary: '\u00a7\u00e9'"),
        (["--start=FILE:/nonexistent/prompt.txt"], "start=FILE:/nonexistent/prompt.txt: cannot read the prompt file"),
        (["--start=" + "e" * 40], "the prompt is 40 tokens, longer than the model's context (block_size=32); shorten it, or pass --crop_prompt=left"),
        (["--top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
        (["--temperature=-1"], "temperature=-1.0 must be >= 0"),
        (["--max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
        (["--stream=True", "--num_samples=2"], "set num_samples=1"),
        (["--stop=<|endoftext|>"], "this tokenizer has no end-of-text token"),
        (["--temprature=0.5"], "unknown key 'temprature'; did you mean temperature"),
        (["--dtype=int8"], "key 'dtype' was renamed 'weights_dtype'; use --weights_dtype=..."),
    ],
)
def test_bad_input_exits_2(trained_run, args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        sample.main([f"--out_dir={trained_run}", "--device=cpu", "--max_new_tokens=5", *args])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top_p=0"], "top_p=0.0 must be in (0, 1]"),
        (["--top_p=1.01"], "top_p=1.01 must be in (0, 1]"),
        (["--temperature=-0.1"], "temperature=-0.1 must be >= 0"),
        (["--max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
        (["--num_samples=0"], "num_samples=0 must be >= 1"),
        (["--start=\u00bfQu\u00e9?"], "characters not in the vocabulary: '\u00bf\u00e9'"),
    ],
)
def test_invalid_sampling_values(capsys, trained_run, args, message):
    code, err = fails(capsys, sample.main, f"--out_dir={trained_run}", "--device=cpu", *args)
    assert code == 2 and message in err


def test_crop_prompt_left_keeps_the_last_block_size_tokens(trained_run, loaded):
    """A prompt longer than block_size (32) samples, with --crop_prompt=left, what its last 32 characters do."""
    long = "The king hath spoken, and the queen doth weep at night.\n"
    assert len(long) > 32
    result = run_main("sample.py", f"--out_dir={trained_run}", f"--start={long}", "--crop_prompt=left",
                      "--num_samples=1", "--max_new_tokens=15", "--seed=3", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert f"the prompt is {len(long)} tokens; its first {len(long) - 32} are dropped" in result.stderr
    assert result.stdout == long + texts(loaded, long[-32:], seed=3, max_new_tokens=15)[0] + "\n---------------\n"


def test_llama_directory_with_its_tokenizer(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<eos>"] + sorted(set("the king and queen speak of love and death".split())) + ["[UNK]"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    config = transformers.LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, eos_token_id=0, bos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    sample.main([f"--init_from={tmp_path}", "--start=the king", "--num_samples=1", "--max_new_tokens=8",
                 "--device=cpu", "--temperature=0"])
    out = capsys.readouterr().out
    assert out.startswith("the king ") and out.endswith("---------------\n")  # spaced as after the prompt
    assert set(out.split("---")[0].split()) <= set(words)


def test_a_long_or_past_the_context_run_says_so_before_it_starts(trained_run):
    """sample.py past block_size (32 here) slides, as serve.py does; it says so on stderr before it runs,
    and a run long enough to print nothing for a long while says how to see tokens as they come."""
    from types import SimpleNamespace

    from model import GPTConfig

    result = run_main("sample.py", f"--out_dir={trained_run}", "--max_new_tokens=40", "--num_samples=1", "--device=cpu")
    assert result.returncode == 0, result.stderr
    assert "note: 1 prompt + 40 new tokens pass block_size=32: from there each token runs the last 32 afresh" in result.stderr
    c = SimpleNamespace(max_new_tokens=100_000_000, stream=False, num_samples=3)
    notes = sample.length_notes(c, 1, GPTConfig(block_size=32, vocab_size=61, n_layer=1, n_head=2, n_embd=16))
    assert len(notes) == 2 and "100,000,000 new tokens per sample print only when all 3 are done" in notes[1]
    config = GPTConfig(block_size=32, vocab_size=61, n_layer=1, n_head=2, n_embd=16)
    fits = sample.length_notes(SimpleNamespace(max_new_tokens=32, stream=False, num_samples=1), 1, config)
    assert fits == []  # the 32nd new token is drawn from 32 tokens: still inside the context
    assert len(sample.length_notes(SimpleNamespace(max_new_tokens=33, stream=False, num_samples=1), 1, config)) == 1


def test_compile_true_samples_the_eager_text(trained_run, monkeypatch):
    """sample.py --compile=True (static caches, a step traced whole: fullgraph=True): the same sampled text as
    without it. Traced with dynamo's eager backend (inductor's C++ costs 15-20 s cold here; the GPU tier
    and bench.py --compare=compiled run inductor)."""
    import torch

    import generate

    monkeypatch.setattr(generate, "STATIC_BACKEND", "eager")
    torch._dynamo.reset()
    args = ["sample.py", f"--out_dir={trained_run}", "--start=The king", "--num_samples=2", "--max_new_tokens=30",
            "--device=cpu"]
    plain, compiled = run_main(*args), run_main(*args, "--compile=True")
    assert plain.returncode == compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == plain.stdout and "The king" in plain.stdout
    refused = run_main(*args, "--compile=True", "--draft=ngram")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: compile=True compiles the plain decode step; speculative decoding (draft) runs eager: leave one of them off"]
