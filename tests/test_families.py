"""The chapter's three families from one block: encoders (BERT, ViT) and the encoder-decoder (T5), pinned
to transformers both ways, and the one-line errors for inputs a family does not take."""

import json
import os

import numpy as np
import pytest
import torch

import train
from checkpoint import load_checkpoint, read_metrics
from conftest import make_text, run_main
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="parity tests need transformers (requirements-dev.txt)")

ATOL = 1e-4


def hf_random(cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # every weight random, not the init's zeros and ones, so each mapping is checked
        for name, p in model.named_parameters():
            if p.dim() == 1 or any(k in name for k in ("relative_attention_bias", "cls_token", "position_embeddings")):
                noise = torch.randn_like(p) * (0.5 if "relative" in name else 0.1)
                p.copy_(1 + noise if p.dim() == 1 and name.endswith("weight") else noise)
    return model


def round_trip(hf_model, tmp_path):
    """transformers -> ours (from_pretrained) -> transformers (save_pretrained): (ours, the re-read copy)."""
    hf_model.save_pretrained(tmp_path / "theirs")
    ours = GPT.from_pretrained(str(tmp_path / "theirs")).eval()
    ours.save_pretrained(str(tmp_path / "back"))
    back = type(hf_model).from_pretrained(str(tmp_path / "back")).eval()
    return ours, back


BERT_SHAPES = [
    dict(hidden_act="gelu", layer_norm_eps=1e-12, type_vocab_size=2, num_hidden_layers=2),
    dict(hidden_act="gelu_new", layer_norm_eps=1e-5, type_vocab_size=3, num_hidden_layers=3),
    dict(hidden_act="relu", layer_norm_eps=1e-6, type_vocab_size=1, num_hidden_layers=1, tie_word_embeddings=False),
]


def bert_config(**keys):
    return transformers.BertConfig(vocab_size=61, hidden_size=32, num_attention_heads=4, intermediate_size=48,
                                   max_position_embeddings=24, **keys)


@pytest.mark.parametrize("shape", BERT_SHAPES, ids=["gelu", "gelu_new", "relu-untied"])
def test_bert_masked_lm_logits_equal_transformers_both_ways(tmp_path, shape):
    theirs = hf_random(transformers.BertForMaskedLM, bert_config(**shape))
    ours, back = round_trip(theirs, tmp_path)
    assert ours.config.family == "encoder" and ours.config.head == "mlm"
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 61, (3, 20), generator=g)
    types = torch.randint(0, shape["type_vocab_size"], (3, 20), generator=g)
    pad = torch.ones(3, 20, dtype=torch.long)
    pad[1, 13:], pad[2, 5:] = 0, 0  # batches of different lengths
    want = theirs(input_ids=idx, attention_mask=pad, token_type_ids=types).logits
    got = ours(idx, pad_mask=pad.bool(), token_types=types)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    torch.testing.assert_close(back(input_ids=idx, attention_mask=pad, token_type_ids=types).logits, want, rtol=0, atol=ATOL)


def test_bert_classifier_logits_equal_transformers_both_ways(tmp_path):
    theirs = hf_random(transformers.BertForSequenceClassification, bert_config(num_labels=3, num_hidden_layers=2))
    ours, back = round_trip(theirs, tmp_path)
    assert ours.config.head == "classify" and ours.config.n_classes == 3 and ours.config.pooler
    idx = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(2))
    pad = torch.ones(4, 16, dtype=torch.long)
    pad[0, 9:] = 0
    want = theirs(input_ids=idx, attention_mask=pad).logits
    torch.testing.assert_close(ours(idx, pad_mask=pad.bool())[0], want, rtol=0, atol=ATOL)
    torch.testing.assert_close(back(input_ids=idx, attention_mask=pad).logits, want, rtol=0, atol=ATOL)


VIT_SHAPES = [
    dict(image_size=8, patch_size=2, num_channels=1, hidden_act="gelu", layer_norm_eps=1e-12, num_hidden_layers=2),
    dict(image_size=12, patch_size=4, num_channels=3, hidden_act="gelu_new", layer_norm_eps=1e-6, num_hidden_layers=3,
         qkv_bias=False),
]


@pytest.mark.parametrize("shape", VIT_SHAPES, ids=["1x8x8-patch2", "3x12x12-patch4-noqkvbias"])
def test_vit_logits_equal_transformers_both_ways(tmp_path, shape):
    config = transformers.ViTConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_labels=10, **shape)
    theirs = hf_random(transformers.ViTForImageClassification, config)
    ours, back = round_trip(theirs, tmp_path)
    size, channels = shape["image_size"], shape["num_channels"]
    assert ours.config.block_size == (size // shape["patch_size"]) ** 2 + 1 and ours.config.channels == channels
    pixels = torch.randn(5, channels, size, size, generator=torch.Generator().manual_seed(3))
    want = theirs(pixel_values=pixels).logits
    torch.testing.assert_close(ours(pixels)[0], want, rtol=0, atol=ATOL)
    torch.testing.assert_close(back(pixel_values=pixels).logits, want, rtol=0, atol=ATOL)


T5_SHAPES = [  # v1.0: ReLU, tied head (scaled by d_model^-0.5); v1.1: gated GELU, untied; stacks of different depth
    dict(feed_forward_proj="relu", tie_word_embeddings=True, num_layers=2, num_decoder_layers=3, layer_norm_epsilon=1e-6),
    dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_layers=3, num_decoder_layers=2,
         layer_norm_epsilon=1e-5, relative_attention_num_buckets=16, relative_attention_max_distance=20),
]


def t5(shape, tmp_path):
    config = transformers.T5Config(vocab_size=53, d_model=32, d_kv=8, d_ff=48, num_heads=4, **shape)
    theirs = hf_random(transformers.T5ForConditionalGeneration, config)
    return theirs, *round_trip(theirs, tmp_path)


@pytest.mark.parametrize("shape", T5_SHAPES, ids=["v1.0", "v1.1"])
def test_t5_logits_equal_transformers_both_ways(tmp_path, shape):
    theirs, ours, back = t5(shape, tmp_path)
    assert ours.config.family == "encoder-decoder" and ours.config.n_encoder_layer == shape["num_layers"]
    g = torch.Generator().manual_seed(4)
    source, target = torch.randint(2, 53, (3, 30), generator=g), torch.randint(2, 53, (3, 9), generator=g)
    pad = torch.ones(3, 30, dtype=torch.long)
    pad[1, 17:] = 0
    want = theirs(input_ids=source, attention_mask=pad, decoder_input_ids=target).logits
    torch.testing.assert_close(ours(target, source=source, pad_mask=pad.bool())[0], want, rtol=0, atol=ATOL)
    got = back(input_ids=source, attention_mask=pad, decoder_input_ids=target).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize("shape", T5_SHAPES, ids=["v1.0", "v1.1"])
def test_t5_cached_greedy_equals_an_argmax_loop_over_transformers(tmp_path, shape):
    """generate(source=...) runs the encoder once and keeps the cross-attention keys; each token equals
    the argmax of transformers' whole forward over the tokens so far."""
    import generate

    theirs, ours, _ = t5(shape, tmp_path)
    source = torch.randint(2, 53, (2, 11), generator=torch.Generator().manual_seed(5))
    seq = torch.zeros(2, 1, dtype=torch.long)  # T5's decoder starts at the pad id, 0
    with torch.no_grad():
        for _ in range(12):
            nxt = theirs(input_ids=source, decoder_input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    start = torch.zeros(2, 1, dtype=torch.long)
    calls = []
    encode = ours.encode
    ours.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    got = generate.generate(ours, start, 12, generate.Sampling(temperature=0), source=source)
    assert torch.equal(got, seq) and len(calls) == 1  # the encoder ran once for the whole generation
    uncached = generate.generate(ours, start, 12, generate.Sampling(temperature=0), source=source, use_cache=False)
    assert torch.equal(uncached, seq)


def test_each_family_refuses_what_it_does_not_take_in_one_line():
    text = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16))
    vit = GPT(GPTConfig(block_size=5, vocab_size=1, n_layer=1, n_head=2, n_embd=16, family="encoder", head="classify",
                        n_classes=3, image_size=4, patch_size=2, channels=1))
    seq2seq = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=1, n_head=2, n_embd=16, family="encoder-decoder",
                            n_encoder_layer=1))
    ids = torch.zeros(1, 4, dtype=torch.long)
    cases = [
        (lambda: text(torch.rand(1, 1, 4, 4)), "takes token ids.*images need image_size"),  # pixels to a text model
        (lambda: vit(ids), r"takes pixels \(batch, 1, 4, 4\)"),
        (lambda: text(ids, source=ids), "source= is an encoder-decoder's"),  # a source to a decoder-only model
        (lambda: seq2seq(ids), "needs source="),
        (lambda: GPTConfig(family="encoder", head="mlm", attn_pattern="LR"), "attends both ways.*R .*only causally"),
        (lambda: GPTConfig(family="encoder", head="lm"), "an encoder's head is 'mlm' or 'classify'"),
        (lambda: GPTConfig(family="encoder", head="classify", n_classes=10, image_size=8, patch_size=2, channels=1),
         "set block_size=17"),
        (lambda: vit.new_cache(), "generates nothing"),
        (lambda: GPTConfig(emb_norm=True), "emb_norm=True: an encoder's"),
        (lambda: seq2seq(ids, source=ids, pad_mask=torch.ones(1, 5, dtype=torch.bool)), "pad_mask is .B, T. of an encoder's"),
        (lambda: text(ids, token_types=ids), "token_types .B, T. with type_vocab_size > 0"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            call()
        assert "\n" not in str(error.value)


def test_an_encoder_decoder_decodes_past_its_context_and_from_padded_sources_as_its_uncached_loop():
    """Past block_size the decoder's window runs afresh with the source (its cache is stale there), and a
    batch of sources of different lengths (pad_mask) decodes each row as that source alone does."""
    import generate

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=20, n_layer=2, n_head=2, n_embd=16, family="encoder-decoder",
                          n_encoder_layer=1, pos_emb="t5", norm="rmsnorm", bias=False)).eval()
    source = torch.randint(1, 20, (2, 7))
    pad = torch.ones(2, 7, dtype=torch.bool)
    pad[1, 4:] = False
    start, greedy = torch.zeros(2, 1, dtype=torch.long), generate.Sampling(temperature=0)
    cached = generate.generate(model, start, 14, greedy, source=source, pad_mask=pad)  # 15 tokens: past block_size 8
    assert torch.equal(cached, generate.generate(model, start, 14, greedy, source=source, pad_mask=pad, use_cache=False))
    alone = generate.generate(model, start[1:], 14, greedy, source=source[1:, :4])
    assert torch.equal(cached[1:], alone)


def test_a_bert_pretraining_checkpoint_loads_its_masked_token_head(tmp_path):
    """bert-base-uncased's kind of file: BertForPreTraining, with a pooler and a next-sentence head that a
    masked-token model does not use (skipped), and LayerNorm weights named gamma and beta (old files)."""
    from safetensors.torch import load_file, save_file

    theirs = hf_random(transformers.BertForPreTraining, bert_config(num_hidden_layers=2))
    theirs.save_pretrained(tmp_path)
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in load_file(tmp_path / "model.safetensors").items()}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = GPT.from_pretrained(str(tmp_path)).eval()
    assert ours.config.head == "mlm" and not hasattr(ours, "pooler")  # (its pooler and next-sentence head skipped)
    idx = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(ours(idx)[0], theirs(input_ids=idx).prediction_logits, rtol=0, atol=ATOL)


def test_decoder_only_models_keep_their_parameters_and_init():
    """The families' switches build nothing for a decoder: the same state dict names and initial weights."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=20, n_layer=2, n_head=2, n_embd=16))
    assert [name for name, _ in model.named_parameters()] == [
        "tok_emb.weight", "positions.wpe.weight", *[f"blocks.{i}.{p}" for i in range(2) for p in (
            "norm1.weight", "norm1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
            "norm2.weight", "norm2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias")],
        "norm_f.weight", "norm_f.bias"]


# ----------------------------------------------------------------------------------------------------
# Training, evaluating, exporting and sampling each family through the command lines

STEPS = ["--batch_size=8", "--eval_interval=4", "--log_interval=1", "--warmup_iters=2", "--learning_rate=3e-3",
         "--min_lr=3e-4", "--dtype=float32", "--device=cpu"]
SMALL = ["--n_layer=2", "--n_head=2", "--n_embd=32", *STEPS]
VIT = ["--family=encoder", "--head=classify", "--n_classes=10", "--image_size=8", "--patch_size=4", "--channels=1", "--block_size=5",
       "--mlp=gelu_exact"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    pytest.importorskip("sklearn", reason="the digits come with scikit-learn")
    out = tmp_path_factory.mktemp("data") / "digits"
    result = run_main("data/images/prepare.py", "digits", f"--out={out}")
    assert result.returncode == 0, result.stderr
    assert "1,437 train and 360 val images, 1 x 8 x 8, 10 classes" in result.stdout
    return str(out)


def weights(run):
    return load_checkpoint(os.path.join(run, "ckpt.pt"))["model"]


def test_a_vit_trains_on_digits_resumes_exactly_and_its_export_classifies_as_the_run_reported(tmp_path, digits):
    """The acceptance's path in small: train.py on the digits (shifted), eval.py's held-out accuracy equals
    the run's last evaluation, and transformers' pipeline on the export (its image processor, the raw
    0..16 pixels) gets the same accuracy on the same 360 images."""
    common = [*SMALL, *VIT, f"--dataset={digits}", "--eval_iters=45", "--image_shift=1", "--dropout=0.1", "--lr_decay_iters=8"]
    train.main([*common, f"--out_dir={tmp_path / 'straight'}", "--max_iters=8"])
    train.main([*common, f"--out_dir={tmp_path / 'split'}", "--max_iters=4"])
    train.main([*common, f"--out_dir={tmp_path / 'split'}", "--max_iters=8", "--init_from=resume"])
    straight, split = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert all(torch.equal(straight[k], split[k]) for k in straight)  # shifts and dropout resumed too
    reported = [r for r in read_metrics(tmp_path / "straight") if "val_accuracy" in r][-1]["val_accuracy"]
    result = run_main("eval.py", f"--out_dir={tmp_path / 'straight'}", f"--json={tmp_path / 'eval.json'}")
    assert result.returncode == 0, result.stderr
    scored = json.loads((tmp_path / "eval.json").read_text())
    assert scored["examples"] == 360 and scored["accuracy"] == pytest.approx(reported, abs=1e-9)
    result = run_main("export.py", f"--out_dir={tmp_path / 'straight'}", f"--hf_dir={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    from sklearn.datasets import load_digits

    data = load_digits()
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")
    theirs = transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "hf").eval()
    inputs = processor([im[:, :, None].astype(np.float32) for im in data.images[-360:]], return_tensors="pt",
                       input_data_format="channels_last")
    with torch.no_grad():
        predicted = theirs(**inputs).logits.argmax(-1).numpy()
    assert (predicted == data.target[-360:]).mean() == pytest.approx(reported, abs=1e-9)
    assert theirs.config.id2label[0] == "0"
    from checkpoint import load_any

    model, tokenizer, _ = load_any(str(tmp_path / "hf"))  # pixels, no tokenizer; and a fine-tune's start
    assert tokenizer is None and model.config.image_size == 8
    train.main([*STEPS, f"--dataset={digits}", f"--out_dir={tmp_path / 'from-hf'}", f"--init_from={tmp_path / 'hf'}",
                "--max_iters=2", "--eval_iters=45"])
    start = [r for r in read_metrics(tmp_path / "from-hf") if "val_accuracy" in r][0]["val_accuracy"]
    assert start == pytest.approx(reported, abs=1e-9)  # step 0 is the exported model itself
    result = run_main("interpret.py", f"--out_dir={tmp_path / 'straight'}", "--image=2", "--images=20",
                      f"--png={tmp_path / 'maps.png'}")
    assert result.returncode == 0, result.stderr
    assert "mean attention distance" in result.stdout and (tmp_path / "maps.png").exists()


def test_an_image_folder_prepares_with_a_held_out_share_per_class(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="an image folder is read with Pillow")
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (tmp_path / "pets" / name).mkdir(parents=True)
        for i in range(10):
            Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(tmp_path / "pets" / name / f"{i}.png")
    result = run_main("data/images/prepare.py", str(tmp_path / "pets"), "--size=12", f"--out={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr
    assert "18 train and 2 val images, 3 x 12 x 12, 2 classes" in result.stdout
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"]["classes"] == ["cat", "dog"]
    assert np.load(tmp_path / "out" / "val_images.npy").max() <= 1.0


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "numbers"
    result = run_main("data/numbers/prepare.py", "--train=300", "--val=20", f"--out={out}")
    assert result.returncode == 0, result.stderr
    return str(out)


def test_an_encoder_decoder_trains_on_pairs_then_eval_and_sample_decode_from_a_source(tmp_path, numbers):
    from data.numbers.prepare import words

    assert words(40213) == "forty thousand two hundred thirteen" and words(90) == "ninety"
    out = tmp_path / "seq2seq"
    train.main([*SMALL, f"--dataset={numbers}", f"--out_dir={out}", "--family=encoder-decoder", "--n_encoder_layer=1",
                "--pos_emb=t5", "--norm=rmsnorm", "--bias=False", "--mlp=geglu", "--block_size=48", "--max_iters=6",
                "--eval_iters=3"])
    evals = [r["val_loss"] for r in read_metrics(out) if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.2  # the targets are trained on
    result = run_main("eval.py", f"--out_dir={out}", f"--json={tmp_path / 'eval.json'}")
    assert result.returncode == 0, result.stderr
    assert "exact match" in result.stdout and json.loads((tmp_path / "eval.json").read_text())["examples"] == 20
    result = run_main("sample.py", f"--out_dir={out}", "--source=40213", "--num_samples=2", "--temperature=0",
                      "--max_new_tokens=10")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("---------------\n")[:2]
    assert first == second and len(first) <= 11  # greedy twice, at most 10 characters
    for args, message in ((["--start=hi"], "writes from --source"), (["--source=1", "--stream=True", "--num_samples=1"], "no stream")):
        result = run_main("sample.py", f"--out_dir={out}", *args)
        assert result.returncode == 2 and message in result.stderr
    # exported as a T5 with its tokenizer: transformers' generate writes what sample.py writes, and so do we from the export
    result = run_main("export.py", f"--out_dir={out}", f"--hf_dir={tmp_path / 'hf'}")
    assert result.returncode == 0, result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokenizer("40213", add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("[SEP]")]
    with torch.no_grad():
        # (use_cache=False: transformers 5.25's generate sizes its cache by the encoder's depth, and this decoder is deeper)
        out_ids = theirs.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, use_cache=False)[0, 1:]
    assert tokenizer.decode(out_ids, skip_special_tokens=True).replace(" ", "") == first.strip().replace(" ", "")
    result = run_main("export.py", f"--out_dir={out}", f"--gguf={tmp_path / 'x.gguf'}")
    assert result.returncode == 2 and "GGUF export writes decoder-only models" in result.stderr
    result = run_main("sample.py", f"--init_from={tmp_path / 'hf'}", "--source=40213", "--num_samples=1",
                      "--temperature=0", "--max_new_tokens=10")
    assert result.returncode == 0 and result.stdout.split("---------------\n")[0] == first, result.stderr


def test_bert_masking_is_15_percent_of_which_80_10_10(char_dataset):
    """Over 64 x 255 = 16,320 positions: 15% chosen (binomial sd 0.0028, so +-0.012 is over 4 sd); of the
    ~2,450 chosen, 80/10/10 (sd 0.008 and 0.006: +-0.03 over 3.5 sd). The loss sees the chosen positions only."""
    from dataset import BatchSampler, open_split, read_meta
    from labeled import MaskedTokens
    from tokenizer import EncoderTokenizer, tokenizer_from_meta

    tok = EncoderTokenizer(tokenizer_from_meta(read_meta(char_dataset)["tokenizer"]))
    windows = BatchSampler(open_split(char_dataset, "train", tok.base.vocab_size), 255, seed=0)
    masked = MaskedTokens(windows, tok)
    x, y = masked.sample(64)
    windows.generator.manual_seed(0)
    original, _ = windows.sample(64)
    assert (x[:, 0] == tok.special["[CLS]"]).all() and (y[:, 0] == -1).all()
    x, y = x[:, 1:], y[:, 1:]
    chosen = y != -1
    assert torch.equal(y[chosen], original[chosen]) and torch.equal(x[~chosen], original[~chosen])
    assert abs(chosen.float().mean() - 0.15) < 0.012
    share = lambda m: float((m & chosen).sum() / chosen.sum())  # noqa: E731
    assert abs(share(x == tok.special["[MASK]"]) - 0.8) < 0.03
    assert abs(share((x != original) & (x != tok.special["[MASK]"])) - 0.1 * (1 - 1 / tok.base.vocab_size)) < 0.03


def test_a_masked_lm_run_fine_tunes_into_a_classifier_of_labelled_text(tmp_path, char_dataset):
    """BERT's path: masked tokens on a text dataset, then --head=classify on a .jsonl of {"text", "label"}
    prepared with the run's tokenizer; eval.py reports the held-out accuracy."""
    mlm = tmp_path / "mlm"
    train.main([*SMALL, f"--dataset={char_dataset}", f"--out_dir={mlm}", "--family=encoder", "--head=mlm",
                "--norm_placement=post", "--emb_norm=True", "--block_size=32", "--max_iters=4", "--eval_iters=2"])
    state = load_checkpoint(str(mlm / "ckpt.pt"))
    assert state["tokenizer"]["kind"] == "encoder" and state["model_config"]["vocab_size"] == len(
        read_meta_chars(char_dataset)) + 4
    text = make_text(6000, seed=3)
    lines = [line for line in text.splitlines() if line]
    (tmp_path / "tone.jsonl").write_text("".join(json.dumps({"text": line, "label": "loud" if line.endswith("!") else "calm"}) + "\n"
                                                 for line in lines))
    result = run_main("data/prepare.py", str(tmp_path / "tone.jsonl"), f"--out={tmp_path / 'tone'}", f"--tokenizer_from={mlm}")
    assert result.returncode == 0, result.stderr
    assert "2 labels (calm, loud)" in result.stdout
    tuned = tmp_path / "tuned"
    train.main([*STEPS, f"--dataset={tmp_path / 'tone'}", f"--out_dir={tuned}", f"--init_from={mlm}", "--head=classify",
                "--pooler=True", "--max_iters=4", "--eval_iters=4"])
    result = run_main("eval.py", f"--out_dir={mlm}", f"--json={tmp_path / 'mlm.json'}")  # BERT's objective over val, in order
    assert result.returncode == 0 and "masked tokens" in result.stdout, result.stderr
    scored = json.loads((tmp_path / "mlm.json").read_text())
    assert scored["masked_tokens"] > 0 and 0 <= scored["accuracy"] <= 1
    for script, message in (("sample.py", "it fills masks or classifies"), ("chat.py", "this model is family='encoder'")):
        result = run_main(script, f"--out_dir={mlm}")
        assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    result = run_main("export.py", f"--out_dir={mlm}", f"--hf_dir={tmp_path / 'bert'}")  # a BertForMaskedLM and its tokenizer
    assert result.returncode == 0 and "BERT's 4 tokens" in result.stdout, result.stderr
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "bert")
    bert = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "bert").eval()
    ids = tokenizer("[CLS]the [MASK]ing", add_special_tokens=False)["input_ids"]
    from checkpoint import load_any

    ours, ours_tokenizer, _ = load_any(str(mlm))
    assert ids == ours_tokenizer.wrap("the ")[:-1] + [ours_tokenizer.special["[MASK]"]] + ours_tokenizer.encode("ing")
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(torch.tensor([ids]))[0], bert(torch.tensor([ids])).logits, rtol=0, atol=1e-4)
    base, fine = weights(mlm), weights(tuned)
    assert fine["classifier.weight"].shape == (2, 32) and "lm_head.bias" not in fine
    result = run_main("eval.py", f"--out_dir={tuned}", f"--json={tmp_path / 'eval.json'}")
    assert result.returncode == 0, result.stderr
    assert 0 <= json.loads((tmp_path / "eval.json").read_text())["accuracy"] <= 1
    assert base["tok_emb.weight"].shape == fine["tok_emb.weight"].shape


def read_meta_chars(dataset):
    from dataset import read_meta

    return read_meta(dataset)["tokenizer"]["chars"]


def test_a_dataset_the_family_cannot_read_gets_one_line(tmp_path, char_dataset, numbers, capsys):
    cases = [
        ([f"--dataset={char_dataset}", *VIT], "holds text, but image_size=8"),
        ([f"--dataset={numbers}"], "holds source/target pairs: train an encoder-decoder"),
        ([f"--dataset={char_dataset}", "--family=encoder-decoder", "--n_encoder_layer=1"], "holds plain text"),
    ]
    for args, message in cases:
        with pytest.raises(SystemExit) as exit:
            train.main([*SMALL, f"--out_dir={tmp_path / 'x'}", "--max_iters=2", *args])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_serve_answers_an_encoder_decoder_from_its_source_through_the_openai_client(tmp_path, numbers):
    """serve.py reads a completion's prompt as the source; each choice equals sample.py's greedy decode,
    rows of different sources decoded in one batch (GPT.decode_rows with each row's cross-attention)."""
    pytest.importorskip("fastapi", reason="serve.py needs FastAPI and uvicorn (requirements-serve.txt)")
    openai = pytest.importorskip("openai", reason="the openai package is a test dependency (requirements-dev.txt)")
    from test_serve import Server

    out = tmp_path / "seq2seq"
    train.main([*SMALL, f"--dataset={numbers}", f"--out_dir={out}", "--family=encoder-decoder", "--n_encoder_layer=1",
                "--pos_emb=t5", "--norm=rmsnorm", "--bias=False", "--block_size=48", "--max_iters=30",
                "--eval_interval=30", "--eval_iters=1"])
    server = Server(str(out), max_batch=4)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        sources = ["40213", "7", "123", "99999"]
        reply = client.completions.create(model="tiny", prompt=sources, max_tokens=12, temperature=0)
        texts = [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]
        for source, text in zip(sources, texts):
            result = run_main("sample.py", f"--out_dir={out}", f"--source={source}", "--num_samples=1",
                              "--temperature=0", "--max_new_tokens=12")
            assert result.returncode == 0, result.stderr
            assert text == result.stdout.split("\n---------------")[0]
        status, body = server.post({"prompt": "1", "echo": True})
        assert status == 400 and "'echo'" in body["error"]["message"]
    finally:
        server.stop()


def test_the_authors_task_draws_held_out_snippets_from_each_texts_last_tenth(tmp_path):
    """data/authors/prepare.py: snippets labelled by their text, War and Peace in Shakespeare's characters,
    val snippets only from the last 10% of each (what shakespeare_char's masked-token run never saw)."""
    shakespeare = make_text(20_000, seed=1)
    tolstoy = "".join(ch.upper() if i % 7 else "é" for i, ch in enumerate(make_text(20_000, seed=2)))  # é: not Shakespeare's
    (tmp_path / "s.txt").write_text(shakespeare)
    (tmp_path / "t.txt").write_text(tolstoy)
    result = run_main("data/authors/prepare.py", f"--shakespeare={tmp_path / 's.txt'}", f"--tolstoy={tmp_path / 't.txt'}",
                      "--train=40", "--val=10", f"--out={tmp_path / 'out'}")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "authors.jsonl").read_text().splitlines()]
    assert len(records) == 50 and {r["label"] for r in records} == {"shakespeare", "tolstoy"}
    tolstoy_known = "".join(ch for ch in tolstoy if ch in set(shakespeare))  # the script keeps these
    for r in records[-10:]:  # val: the last ten, each from its text's last tenth
        text = shakespeare if r["label"] == "shakespeare" else tolstoy_known
        assert r["text"] in text[int(len(text) * 0.9):] and "é" not in r["text"]
