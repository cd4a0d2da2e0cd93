"""The device tier: every user-facing path on a CUDA GPU (train.py with compile, DDP and FSDP2 under torchrun,
each resumed; stability and head logging; sample.py sampled, greedy and with both drafts; engine.py's continuous batching;
fine-tuning on conversations (full and LoRA, compiled, resumed) with chat.py and eval.py --chats; rl.py;
eval.py; interpret.py; bench.py; a GGUF export sampled; the encoder and encoder-decoder families), and no
host synchronisation inside a training step. Skips, saying why, where there is no GPU; ../shared/gpu-check.sh runs it on a lent one. The GPU machine has torch, tiktoken and
transformers but no fastapi, datasets or wandb: nothing here needs them."""

import json

import pytest
import torch

from conftest import SFT_RUN, TINY_RUN, read_metrics, run_main, run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the device tier runs on a GPU "
                                "(../shared/gpu-check.sh)")
CUDA = [a for a in TINY_RUN if not a.startswith(("--device", "--dtype"))] + ["--device=cuda", "--dtype=auto"]
SFT_CUDA = [a for a in SFT_RUN if not a.startswith(("--device", "--dtype"))] + ["--device=cuda", "--dtype=auto"]


def ok(result):
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory, char_dataset):
    """A tiny model trained on the GPU with torch.compile, then resumed: its out_dir."""
    out = tmp_path_factory.mktemp("cuda") / "run"
    first = ok(run_main("train.py", *CUDA, f"--dataset={char_dataset}", f"--out_dir={out}", "--max_iters=10",
                        "--compile=True"))
    assert "cuda" in first.stdout and "precision: " in first.stdout
    ok(run_main("train.py", f"--out_dir={out}", f"--dataset={char_dataset}", "--init_from=resume", "--max_iters=20"))
    assert [r["iter"] for r in read_metrics(out) if "val_loss" in r] == [0, 5, 10, 15, 20]
    return str(out)


def test_compiled_training_resumes_and_logs_stability_and_heads(tmp_path, cuda_run, char_dataset):
    records = read_metrics(cuda_run)
    assert all(r["loss"] == r["loss"] for r in records if "loss" in r)  # finite
    logged = ok(run_main("train.py", *CUDA, f"--dataset={char_dataset}", f"--out_dir={tmp_path / 'logged'}",
                         "--max_iters=4", "--eval_interval=4", "--log_stability=True", "--log_heads=True"))
    last = [r for r in read_metrics(tmp_path / "logged") if "val_loss" in r][-1]
    for key in ("max_attn_logit", "mean_log_z", "induction_score", "icl_score"):
        assert isinstance(last[key], float), (key, logged.stdout[-1000:])


@pytest.mark.parametrize("fsdp", [False, True])
def test_torchrun_one_gpu_with_ddp_and_fsdp_then_resume(tmp_path, char_dataset, fsdp):
    """Compiled: DDP with Muon (its Newton-Schulz compiled and shared out), FSDP2 with each block compiled
    before it is sharded and bf16 gathers (MixedPrecisionPolicy)."""
    optimizer = "adamw" if fsdp else "muon"
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "train.py", *CUDA,
            f"--dataset={char_dataset}", f"--out_dir={tmp_path}", f"--fsdp={fsdp}", "--compile=True",
            f"--optimizer={optimizer}"]
    ok(run_script(*args, "--max_iters=6", "--eval_interval=3"))
    ok(run_script(*args, "--init_from=resume", "--max_iters=9", "--eval_interval=3"))
    assert [r["iter"] for r in read_metrics(tmp_path) if "val_loss" in r] == [0, 3, 6, 9]


@pytest.mark.parametrize("args", [["--temperature=0.8"], ["--temperature=0"], ["--draft=ngram", "--temperature=0"],
                                  ["--draft=DRAFT", "--temperature=0.8"]], ids=["sampled", "greedy", "ngram", "model"])
def test_sample_on_the_gpu(cuda_run, args):
    args = [a.replace("DRAFT", cuda_run) for a in args]  # the model as its own draft: every draft accepted
    result = ok(run_main("sample.py", f"--out_dir={cuda_run}", "--device=cuda", "--num_samples=2",
                         "--max_new_tokens=40", "--start=The king", *args))
    assert result.stdout.count("---------------") == 2


def test_compiled_decoding_on_the_gpu_gives_the_eager_text(cuda_run):
    """sample.py --compile=True: static caches and the step under CUDA graphs (triton.cudagraphs), measured
    against eager first (generate.faster_static_step: its stderr line says which it kept)."""
    args = ["sample.py", f"--out_dir={cuda_run}", "--device=cuda", "--start=The king", "--num_samples=2",
            "--max_new_tokens=40", "--temperature=0", "--weights_dtype=float32"]
    compiled = ok(run_main(*args, "--compile=True"))
    assert compiled.stdout == ok(run_main(*args)).stdout and "compile: the compiled step decodes" in compiled.stderr


def test_greedy_text_on_the_gpu_equals_the_cpus(cuda_run):
    """fp32 weights, greedy: the GPU's text is the CPU's (TF32 may flip a near-tie: compared over 20 tokens)."""
    texts = [ok(run_main("sample.py", f"--out_dir={cuda_run}", f"--device={d}", "--num_samples=1", "--weights_dtype=float32",
                         "--max_new_tokens=20", "--temperature=0", "--start=The king")).stdout for d in ("cpu", "cuda")]
    assert texts[0] == texts[1]


def test_the_engine_on_the_gpu(cuda_run):
    """engine.py's Engine (no FastAPI needed): a greedy request alone equals model.generate (one row each,
    so the same kernels), then a sampled and a greedy one batched together both finish."""
    import threading

    from checkpoint import load_any
    from engine import Engine, Job
    from generate import Sampling

    model, tokenizer, _ = load_any(cuda_run)
    model = model.to("cuda").eval()
    engine = Engine(model, max_batch=4, max_queue=4)
    prompt = tokenizer.encode("The king")

    def serve_all(samplings):
        done, events = threading.Event(), {i: [] for i in range(len(samplings))}

        def sender(i):
            def send(event):
                events[i].append(event)
                if all(e and e[-1][0] in ("done", "error") for e in events.values()):
                    done.set()
            return send

        engine.submit([Job(prompt, 30, s, tokenizer=tokenizer, send=sender(i), seed=i, device=engine.device)
                       for i, s in enumerate(samplings)])
        assert done.wait(120), events
        assert all(e[-1][0] == "done" for e in events.values()), events
        return ["".join(e[1] for e in events[i] if e[0] == "text") for i in events]

    (greedy,) = serve_all([Sampling(temperature=0)])
    expected = model.generate(torch.tensor([prompt], device="cuda"), 30, Sampling(temperature=0))[0, len(prompt):]
    assert greedy == tokenizer.decode(expected.tolist())
    assert all(serve_all([Sampling(temperature=0), Sampling(temperature=1.0, top_k=5)]))


def test_eval_bits_per_byte_on_the_gpu_within_1e_3_of_the_cpus(tmp_path, cuda_run):
    scores = {}
    for device in ("cpu", "cuda"):
        ok(run_main("eval.py", f"--out_dir={cuda_run}", f"--device={device}", "--dtype=float32",
                    f"--json={tmp_path / device}.json"))
        scores[device] = json.loads((tmp_path / f"{device}.json").read_text())["bits_per_byte"]
    assert abs(scores["cuda"] - scores["cpu"]) <= 1e-3, scores
    ok(run_main("eval.py", f"--out_dir={cuda_run}", "--device=cuda", "--weights_dtype=bfloat16", f"--json={tmp_path}/bf16.json"))
    assert abs(json.loads((tmp_path / "bf16.json").read_text())["bits_per_byte"] - scores["cuda"]) <= 0.02
    assert "CPU inference" in run_main("eval.py", f"--out_dir={cuda_run}", "--device=cuda", "--weights_dtype=int8").stderr


def test_a_gguf_of_a_gpu_run_samples_on_the_gpu_as_the_run_does(tmp_path, cuda_run):
    """export.py --gguf from a run trained on the GPU, then sample.py --init_from=FILE.gguf on the GPU: the run's
    greedy text (f32: the file holds its weights bit for bit)."""
    pytest.importorskip("gguf")
    ok(run_main("export.py", f"--out_dir={cuda_run}", f"--gguf={tmp_path / 'run.gguf'}"))
    texts = [ok(run_main("sample.py", where, "--device=cuda", "--weights_dtype=float32", "--num_samples=1",
                         "--max_new_tokens=20", "--temperature=0", "--start=The king")).stdout
             for where in (f"--out_dir={cuda_run}", f"--init_from={tmp_path / 'run.gguf'}")]
    assert texts[0] == texts[1]


def test_interpret_on_the_gpu(tmp_path, cuda_run):
    pytest.importorskip("matplotlib")
    ok(run_main("interpret.py", f"--out_dir={cuda_run}", "--start=The king", f"--png={tmp_path / 'maps.png'}"))
    scored = ok(run_main("interpret.py", f"--out_dir={cuda_run}", "--scores=True"))
    assert "induction" in scored.stdout


@pytest.mark.parametrize("what", ["train", "sample"])
def test_bench_on_the_gpu(tmp_path, what):
    shape = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--vocab_size=65", "--block_size=64", "--device=cuda"]
    extra = ["--steps=3", "--rounds=5"] if what == "train" else ["--prompt_len=8", "--new_tokens=20", "--contexts=10"]
    ok(run_main("bench.py", what, *shape, *extra, f"--json={tmp_path / 'b.json'}"))
    result = json.loads((tmp_path / "b.json").read_text())["results"][what]
    floats = [v for v in result.values() if isinstance(v, float)]
    assert floats and all(v == v and v >= 0 for v in floats), result  # measured, finite


@pytest.mark.parametrize("what", ["pretraining", "fine-tuning"])
def test_a_training_step_makes_no_host_synchronisation(char_dataset, tmp_path, what, request):
    """Between two log lines a step must not wait for the GPU: torch.cuda.set_sync_debug_mode("error")
    raises on any synchronising call (an .item(), a boolean index, a pageable copy). Fine-tuning on
    conversations counts the step's trained tokens on the host and copies the count pinned."""
    import train
    from configurator import parse

    keys = [*CUDA, f"--dataset={char_dataset}"]
    if what == "fine-tuning":
        keys = [*SFT_CUDA, f"--init_from={request.getfixturevalue('trained_run')}", f"--dataset={request.getfixturevalue('chat_data')[1]}"]
    values, explicit = parse(train.config_keys(), [*keys, f"--out_dir={tmp_path}"])
    c = train.TrainConfig(**values)
    run = train.Run(c, explicit, None)
    run.wrap()
    first_bad = torch.full((), -1, dtype=torch.long, device=run.device)
    run.train_step(0, 1e-3, first_bad)  # warm: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for it in range(1, 4):
            first_bad = run.train_step(it, 1e-3, first_bad).first_bad
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(first_bad) == -1


def test_every_script_gets_tf32_from_pick_device():
    from device import pick_device

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    assert pick_device("cuda") == "cuda"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


@pytest.mark.parametrize("case", [dict(attn_pattern="SL", attn_window=16, n_head=2), dict(pos_emb="alibi", n_head=2),
                                  dict(pos_emb="t5", n_head=2, n_kv_head=1)], ids=["window", "alibi", "t5 gqa"])
def test_flex_attention_trains_as_sdpa_with_the_dense_mask(monkeypatch, case):
    """On the GPU, windows and position biases at the training shape go through FlexAttention: the loss
    and every gradient (T5's table included) as SDPA with the dense mask, in fp32."""
    import attention
    from conftest import build

    def loss_and_grads(flex):
        monkeypatch.setattr(attention.kernels, "FLEX_DEVICES", ("cuda",) if flex else ())
        model = build(**case, block_size=64).cuda().train()
        idx = torch.randint(0, 61, (4, 65), generator=torch.Generator().manual_seed(0)).cuda()
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    monkeypatch.setattr(attention.kernels, "attention_flex", lambda *a, real=attention.kernels.attention_flex: calls.append(1) or real(*a))
    dense_loss, dense = loss_and_grads(False)
    assert not calls
    flex_loss, flex = loss_and_grads(True)
    assert calls and abs(flex_loss - dense_loss) < 1e-5
    for name, g in dense.items():
        assert (flex[name] - g).abs().max().item() < 1e-4 * max(1.0, g.abs().max().item()), name


def test_compiled_static_decoding_of_windows_and_linear_layers_gives_the_eager_tokens():
    """generate.StaticDecode under CUDA graphs (mode="reduce-overhead") for a window's ring and a linear
    layer's sums, seeded sampling: the eager loop's tokens (on CPU, tests/test_generate.py checks every kind
    uncompiled and tests/test_sample.py a full layer compiled; a compile there costs 15-20 s cold)."""
    import generate
    from conftest import build
    from generate import Sampling

    model = build(pos_emb="rope", attn_pattern="SR", n_layer=2, n_head=2, attn_window=4).cuda()
    idx = torch.randint(0, 61, (3, 7), generator=torch.Generator().manual_seed(1)).cuda()
    sampling = Sampling(temperature=0.8)
    gens = lambda: [torch.Generator(device="cuda").manual_seed(10 + i) for i in range(3)]  # noqa: E731
    eager = model.generate(idx, 20, sampling, generator=gens())
    g = gens()
    static = generate.generate(model, idx, 20, sampling, generator=g, step=generate.StaticDecode(model, sampling, g))
    assert torch.equal(eager, static)


@pytest.mark.parametrize("lora", [[], ["--lora_rank=4", "--lora_targets=all"]])
def test_fine_tuning_on_conversations_on_the_gpu_compiled_resumed_then_chat(tmp_path, trained_run, chat_data, lora):
    """SFT (and LoRA) on the GPU with torch.compile, resumed exactly; then chat.py and eval.py --chats on the
    GPU give the CPU's greedy replies."""
    keys = [*SFT_CUDA, f"--init_from={trained_run}", f"--dataset={chat_data[1]}", "--compile=True", *lora]
    ok(run_main("train.py", *keys, f"--out_dir={tmp_path / 'whole'}", "--max_iters=6", "--eval_interval=3"))
    ok(run_main("train.py", *keys, f"--out_dir={tmp_path / 'cut'}", "--max_iters=3", "--eval_interval=3", "--lr_decay_iters=6"))
    ok(run_main("train.py", f"--out_dir={tmp_path / 'cut'}", "--init_from=resume", "--max_iters=6"))
    whole, cut = ([r["loss"] for r in read_metrics(tmp_path / d) if "loss" in r] for d in ("whole", "cut"))
    assert max(abs(a - b) for a, b in zip(whole, cut)) <= 1e-4 and len(whole) == len(cut) == 6
    replies = {d: ok(run_main("chat.py", f"--out_dir={tmp_path / 'whole'}", "--prompt=the king", "--temperature=0",
                              "--max_new_tokens=8", f"--device={d}", "--weights_dtype=float32")).stdout for d in ("cuda", "cpu")}
    assert replies["cuda"] == replies["cpu"]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"task": "t", "messages": [{"role": "user", "content": "the king"},
                                                                                  {"role": "assistant", "content": replies["cpu"].strip()}]}) + "\n")
    scored = ok(run_main("eval.py", f"--out_dir={tmp_path / 'whole'}", f"--chats={tmp_path / 'chats.jsonl'}",
                         "--max_new_tokens=8", "--device=cuda"))
    assert "**1.000**" in scored.stdout


def test_rl_on_the_gpu_resumes_exactly_and_its_model_chats(tmp_path, sft_run):
    """rl.py on the GPU (sampling noise from a CUDA generator, prompts of different lengths in one batch, the
    update, a KL reference): a run cut at step 2 and resumed ends with the uninterrupted run's weights (to
    1e-4), and chat.py answers from it; resuming it on the CPU is refused in one line."""
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"task": "first", "messages": [
        {"role": "user", "content": f"{w} the king"}, {"role": "assistant", "content": w}]}) + "\n" for w in ("love", "sword", "night", "day")))
    keys = [f"--init_from={sft_run}", f"--prompts={tmp_path / 'p.jsonl'}", f"--eval_chats={tmp_path / 'p.jsonl'}",
            "--device=cuda", "--group_size=4", "--prompts_per_step=2", "--max_new_tokens=8", "--eval_interval=2",
            "--pass_per_task=2", "--kl_coef=0.1", "--rewards=first=chars"]
    ok(run_main("rl.py", *keys, f"--out_dir={tmp_path / 'whole'}", "--max_iters=4"))
    ok(run_main("rl.py", *keys, f"--out_dir={tmp_path / 'cut'}", "--max_iters=2"))
    ok(run_main("rl.py", f"--out_dir={tmp_path / 'cut'}", "--init_from=resume", "--max_iters=4"))
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=True)["model"] for d in ("whole", "cut"))
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)  # (bit for bit on a CPU; a GPU's backward may round otherwise)
    assert any("kl" in r for r in read_metrics(tmp_path / "whole"))
    ok(run_main("chat.py", f"--out_dir={tmp_path / 'whole'}", "--prompt=love the king", "--device=cuda", "--max_new_tokens=8"))
    moved = run_main("rl.py", f"--out_dir={tmp_path / 'whole'}", "--init_from=resume", "--max_iters=6", "--device=cpu")
    assert moved.returncode == 2 and "resume it there (--device=cuda)" in moved.stderr


def test_the_other_families_train_compiled_evaluate_and_decode_on_the_gpu(tmp_path, char_dataset):
    """An encoder-decoder (compiled, bf16 autocast where the GPU has it) trained on generated pairs, its
    greedy exact match and sample.py --source on the GPU; BERT's masked tokens and eval.py's score of them;
    a ViT on random images (labeled.write_images: no scikit-learn on the GPU machine)."""
    import numpy as np

    from labeled import write_images

    pairs = tmp_path / "numbers"
    ok(run_script("data/numbers/prepare.py", "--train=400", "--val=20", f"--out={pairs}"))
    seq2seq = tmp_path / "seq2seq"
    ok(run_main("train.py", *CUDA, f"--dataset={pairs}", f"--out_dir={seq2seq}", "--family=encoder-decoder",
                "--n_encoder_layer=1", "--pos_emb=t5", "--norm=rmsnorm", "--bias=False", "--block_size=48",
                "--max_iters=10", "--compile=True"))
    assert "exact match" in ok(run_main("eval.py", f"--out_dir={seq2seq}", "--device=cuda")).stdout
    ok(run_main("sample.py", f"--out_dir={seq2seq}", "--source=123", "--device=cuda", "--num_samples=2", "--max_new_tokens=8"))
    mlm = tmp_path / "mlm"
    ok(run_main("train.py", *CUDA, f"--dataset={char_dataset}", f"--out_dir={mlm}", "--family=encoder", "--head=mlm",
                "--norm_placement=post", "--emb_norm=True", "--max_iters=6"))
    assert "masked tokens" in ok(run_main("eval.py", f"--out_dir={mlm}", "--device=cuda")).stdout
    rng = np.random.default_rng(0)
    images = {s: (rng.random((n, 3, 8, 8), dtype=np.float32), rng.integers(0, 3, n)) for s, n in (("train", 64), ("val", 16))}
    write_images(str(tmp_path / "images"), images, ["a", "b", "c"], 1 / 255, "random")
    vit = tmp_path / "vit"
    ok(run_main("train.py", *[a for a in CUDA if not a.startswith("--block_size")], f"--dataset={tmp_path / 'images'}",
                f"--out_dir={vit}", "--family=encoder", "--head=classify", "--image_size=8", "--patch_size=4",
                "--channels=3", "--block_size=5", "--image_shift=1", "--max_iters=6", "--compile=True"))
    ok(run_main("eval.py", f"--out_dir={vit}", "--device=cuda", f"--json={tmp_path / 'e.json'}"))
    assert json.loads((tmp_path / "e.json").read_text())["examples"] == 16
