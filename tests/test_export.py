"""export.py: a run as a Hugging Face folder that transformers loads, with our tokenizer, greedy text and scores."""

import json
import os

import pytest
import torch

from conftest import ROOT, TINY_RUN, gpt2_or_skip, max_logit_diff, run_main, run_script

transformers = pytest.importorskip("transformers", reason="export tests need transformers (requirements-dev.txt)")

VOCAB = 97


@pytest.fixture
def idx():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


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
    from dataset import prepare_text
    from tokenizer import TiktokenTokenizer

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
    assert "raises 'Missing [UNK] token' on any other character (train with --vocab_size=" in exported.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    from checkpoint import load_model
    from tokenizer import tokenizer_from_meta

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


def test_export_of_a_padded_character_model_reads_other_characters_as_unk(tmp_path, char_dataset):
    """With a padding row (vocab_size above the characters), transformers' tokenizer reads a character
    outside the vocabulary as [UNK] (it raised 'Missing [UNK] token'); our own loaders still refuse it."""
    from checkpoint import load_model
    from dataset import read_meta

    chars = read_meta(char_dataset)["tokenizer"]["chars"]
    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    trained = run_main("train.py", *TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={run}", "--max_iters=2",
                       f"--vocab_size={len(chars) + 3}")
    assert trained.returncode == 0, trained.stderr
    exported = run_main("export.py", f"--out_dir={run}", f"--hf_dir={hf_dir}")
    assert exported.returncode == 0 and f"reads as [UNK] (id {len(chars)}" in exported.stdout, exported.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer("The \u00bf king", add_special_tokens=False).input_ids
    assert ids == [chars.index(c) for c in "The "] + [len(chars)] + [chars.index(c) for c in " king"]
    assert tokenizer.unk_token == "[UNK]" and tokenizer.decode(ids[:4]) == "The "
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ours = load_model(str(run))[0].eval()
    assert max_logit_diff(ours, model, torch.tensor([ids])) < 1e-4  # the run's model, [UNK]'s row included
    refused = run_main("sample.py", f"--init_from={hf_dir}", "--start=The \u00bf", "--max_new_tokens=5", "--device=cpu")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"error: characters not in the vocabulary: '\u00bf'; a character-level model knows only the {len(chars)} "
        "characters of its training text"], refused.stderr
    assert_export_scores_as_run(tmp_path, hf_dir, run, f"--dataset={char_dataset}")


def test_own_bpe_end_to_end(tmp_path, bpe_run):
    """data/prepare.py --tokenizer=bpe:N -> train -> sample -> eval's bits per byte -> export: transformers'
    tokenizer gives our ids and the export our greedy text and figures."""
    transformers = pytest.importorskip("transformers")
    from checkpoint import load_model
    from dataset import read_meta
    from tokenizer import BPETokenizer, tokenizer_from_meta

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


def test_export_of_a_trained_checkpoint(tmp_path, trained_run, idx):
    import export
    from checkpoint import load_checkpoint, model_from_checkpoint

    export.main([f"--out_dir={trained_run}", f"--hf_dir={tmp_path / 'hf'}"])
    ours = model_from_checkpoint(load_checkpoint(f"{trained_run}/ckpt.pt"), trained_run).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    small = idx % ours.config.vocab_size
    assert max_logit_diff(ours, theirs, small) <= 1e-4


def test_export_refuses_an_inexpressible_model(tmp_path, capsys, char_dataset):
    import export
    import train
    from conftest import TINY_RUN

    train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                "--warmup_iters=0", "--pos_emb=alibi"])
    with pytest.raises(SystemExit) as exit:
        export.main([f"--out_dir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}"])
    assert exit.value.code == 2 and "no Hugging Face equivalent" in capsys.readouterr().err


ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "arcee": "ArceeForCausalLM", "vit": "ViTForImageClassification",
                 "t5": "T5ForConditionalGeneration", "bert": ("BertForMaskedLM", "BertForSequenceClassification")}


def tiny_of(keys, **more):
    """A tiny model of the shape a config's model keys describe (every weight perturbed, so a norm gain or
    a q/k swap that conversion got wrong shows in the logits)."""
    from model import MODEL_KEYS, GPT, GPTConfig

    keys = {k: v for k, v in keys.items() if k in MODEL_KEYS} | more
    shape = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": keys["block_size"] if keys.get("image_size") else 32,
             "vocab_size": VOCAB, "mlp_hidden": None, "dropout": 0.0, "n_kv_head": 2 if keys.get("n_kv_head") else None,
             "attn_window": 8 if keys.get("attn_window") else None}
    if keys.get("head") == "classify" and not keys.get("n_classes"):  # (a fine-tune's: its dataset's)
        shape["n_classes"] = 3
    torch.manual_seed(0)
    model = GPT(GPTConfig(**keys | shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("path", sorted((ROOT / "config").glob("*.py")), ids=lambda p: p.stem)
def test_every_configs_shape_exports_and_matches_transformers(tmp_path, path, idx):
    """Each config in config/ (a tiny model of its shape): export, transformers' own class loads it, logits
    within 1e-4, and it loads back as the same model. The Quick start's ReLU² model is Arcee, the modern
    recipe's QK-norm + SwiGLU is Qwen3; the other families' configs are BERT, ViT and T5."""
    from configurator import read_config_file
    from hf import family
    from model import GPT

    keys = read_config_file(str(path))
    if keys.get("init_from", "scratch") != "scratch":
        pytest.skip("a fine-tune's shape is its base run's, whose own config is checked here")
    model = tiny_of(keys)
    kind = family(model.config)
    assert kind is not None, f"{path.name} has no transformers equivalent"
    model.save_pretrained(str(tmp_path / "hf"))
    c, inputs = model.config, {"idx": idx}
    if c.image_size:  # the other families: their Auto class, and what they read
        inputs = {"idx": torch.randn(2, c.channels, c.image_size, c.image_size), "pixel_values": None}
    elif c.family == "encoder-decoder":
        inputs = {"idx": idx[:, :5], "source": idx}
    auto = {"vit": transformers.AutoModelForImageClassification, "t5": transformers.AutoModelForSeq2SeqLM,
            "bert": transformers.AutoModelForSequenceClassification if c.head == "classify" else transformers.AutoModelForMaskedLM}
    theirs = auto.get(kind, transformers.AutoModelForCausalLM).from_pretrained(str(tmp_path / "hf")).eval()
    assert type(theirs).__name__ in ARCHITECTURES[kind]
    ours = lambda m: m(inputs["idx"], source=inputs.get("source"))[0] if "source" in inputs else m(inputs["idx"])[0]  # noqa: E731
    with torch.no_grad():
        if kind in ("vit", "t5", "bert"):
            theirs_logits = theirs(**({"pixel_values": inputs["idx"]} if c.image_size else
                                      {"input_ids": idx, "decoder_input_ids": idx[:, :5]} if "source" in inputs else
                                      {"input_ids": idx})).logits
            assert (ours(model) - theirs_logits).abs().max() <= 1e-4
        else:
            assert max_logit_diff(model, theirs, idx) <= 1e-4
        back = GPT.from_pretrained(str(tmp_path / "hf")).eval()  # (T5's queries are scaled by sqrt(8) and back)
        assert (ours(model) - ours(back)).abs().max() <= (1e-5 if kind == "t5" else 1e-6)


@pytest.mark.parametrize("keys, change", [
    (dict(pos_emb="rope", norm="rmsnorm", mlp="relu2", bias=False, qk_norm=True), "Qwen3 (Llama with QK-norm), which needs mlp='swiglu'"),
    (dict(pos_emb="alibi", norm="rmsnorm", mlp="relu2", bias=False), "Arcee (Llama with a non-gated ReLU² MLP), which needs pos_emb='rope'"),
    (dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, norm_placement="post"), "which needs norm_placement='pre'"),
    (dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False, attn_pattern="R"), "every layer full attention"),
])  # fmt: skip
def test_a_config_without_an_equivalent_is_told_which_key_to_change(tmp_path, capsys, keys, change):
    from hf import PretrainedError

    with pytest.raises(PretrainedError) as err:
        tiny_of(keys).save_pretrained(str(tmp_path / "hf"))
    message = str(err.value)
    assert "no Hugging Face equivalent: the nearest is" in message and change in message and "\n" not in message
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------------
# A chat model's export: transformers' apply_chat_template renders our ids, and its greedy reply is ours

TEMPLATE_TESTS = [  # a system turn, several turns, a reply already given
    [{"role": "user", "content": "the king"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sweet love"}],
    [{"role": "user", "content": "good night"}, {"role": "assistant", "content": "good"}, {"role": "user", "content": "fair"}],
]


def chat_base(kind, tmp_path, trained_run, bpe_run):
    """A base run with each tokenizer kind we have (GPT-2's BPE: a tiny model of its 50,257 tokens)."""
    if kind == "char":
        return trained_run
    if kind == "bpe":
        return bpe_run[1]
    gpt2_or_skip()
    from conftest import make_text

    (tmp_path / "text.txt").write_text(make_text(6000))
    assert run_main("data/prepare.py", str(tmp_path / "text.txt"), f"--out={tmp_path / 'gpt2data'}", "--tokenizer=gpt2").returncode == 0
    base = tmp_path / "gpt2base"
    assert run_main("train.py", *TINY_RUN, f"--dataset={tmp_path / 'gpt2data'}", f"--out_dir={base}", "--max_iters=2").returncode == 0
    return str(base)


@pytest.mark.parametrize("kind", ["char", "bpe", "gpt2"])
def test_a_chat_models_export_renders_our_prompt_ids_and_replies_as_we_do(tmp_path, kind, trained_run, bpe_run):
    from chat import Conversation
    from checkpoint import load_any
    from conftest import SFT_RUN, conversations
    from generate import Sampling
    from quantize import for_inference

    base = chat_base(kind, tmp_path, trained_run, bpe_run)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations(30)))
    assert run_main("data/prepare.py", str(tmp_path / "chats.jsonl"), f"--out={tmp_path / 'chats'}", f"--tokenizer_from={base}").returncode == 0
    sft, hf_dir = tmp_path / "sft", tmp_path / "hf"
    trained = run_main("train.py", *SFT_RUN, f"--init_from={base}", f"--dataset={tmp_path / 'chats'}", f"--out_dir={sft}",
                       "--max_iters=3", "--eval_interval=3")
    assert trained.returncode == 0, trained.stderr
    exported = run_main("export.py", f"--out_dir={sft}", f"--hf_dir={hf_dir}")
    assert exported.returncode == 0 and "the chat template and its 4 tokens" in exported.stdout, exported.stdout + exported.stderr
    model, tokenizer, _ = load_any(str(sft))
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for messages in TEMPLATE_TESTS + [c["messages"] for c in conversations(8, seed=1)]:
        rendered = theirs.apply_chat_template(messages, add_generation_prompt=True)
        rendered = rendered["input_ids"] if not isinstance(rendered, list) else rendered
        assert rendered == tokenizer.render(messages, add_generation_prompt=True)[0], messages
        assert theirs.apply_chat_template(messages, tokenize=False) == tokenizer.decode(tokenizer.render(messages)[0])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    messages = TEMPLATE_TESTS[1]
    prompt = tokenizer.render(messages, add_generation_prompt=True)[0]
    out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.end_token)[0, len(prompt):].tolist()
    assert hf_model.generation_config.eos_token_id == tokenizer.end_token or hf_model.config.eos_token_id == tokenizer.end_token
    out = out[: next((i for i, t in enumerate(out) if t in tokenizer.names), len(out))]
    conversation = Conversation(for_inference(model, "float32"), tokenizer, Sampling(temperature=0), 0, system="be brief")
    assert tokenizer.decode(out) == conversation.reply("sweet love", 6)


def test_export_refuses_a_folder_with_files_unless_overwrite(tmp_path, trained_run, capsys):
    """An export into a folder that holds files (another model's, a chat template) is refused in one line,
    exit 2, nothing written; --overwrite=True replaces an earlier export's files, keeping the folder's others."""
    import export

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "tokenizer_config.json").write_text('{"chat_template": "another model\'s"}')
    (hf_dir / "README.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in hf_dir.iterdir()}
    with pytest.raises(SystemExit) as exit:
        export.main([f"--out_dir={trained_run}", f"--hf_dir={hf_dir}"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1, err
    assert "is not empty (it holds README.md, tokenizer_config.json): --overwrite=True" in err
    assert {p.name: p.read_bytes() for p in hf_dir.iterdir()} == before  # nothing written
    export.main([f"--out_dir={trained_run}", f"--hf_dir={hf_dir}", "--overwrite=True"])
    assert (hf_dir / "README.md").read_text() == "mine" and (hf_dir / "model.safetensors").exists()
    assert "another model's" not in (hf_dir / "tokenizer_config.json").read_text()
    with pytest.raises(SystemExit):  # a file where the folder should be
        export.main([f"--out_dir={trained_run}", f"--hf_dir={hf_dir / 'README.md'}", "--overwrite=True"])
    assert "is a file" in capsys.readouterr().err
