"""bench.py measures what it says (not how fast it is)."""

import json
import os

import pytest
import torch

import bench
import quantize
from model import GPT, GPTConfig

SHAPE = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--vocab_size=61", "--device=cpu"]


def test_interleave_alternates_and_ratios_are_per_round():
    calls = []
    times = bench.interleave({"a": lambda: calls.append("a") or 1.0, "b": lambda: calls.append("b") or 3.0}, 5)
    assert calls == ["a", "b"] * 5
    assert bench.median_ratio(times, "b", "a") == 3.0
    times = {"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}
    assert bench.median_ratio(times, "b", "a") == 1.0  # median of 2, 1, 0.5


def test_train_figures_are_consistent(tmp_path):
    out = tmp_path / "r.json"
    results = bench.main(["train", *SHAPE, "--rounds=2", "--steps=1", "--warmup=1", "--batch_size=4",
                          "--dtype=float32", f"--json={out}", "--pos_emb=rope", "--compare_patterns=R,SL",
                          "--attn_pattern=S", "--attn_window=8"])
    r = results["train"]
    for pattern in ("R", "SL"):  # timed in the same rounds as ours
        assert r[f"{pattern}_ms_per_step"] > 0 and r[f"{pattern}_time_vs_ours"] > 0
    assert r["tokens_per_sec"] == pytest.approx(4 * 64 / (r["ms_per_step"] / 1000))
    assert r["ms_per_step"] == pytest.approx(sorted(r["rounds_ms"])[len(r["rounds_ms"]) // 2] if len(r["rounds_ms"]) % 2
                                             else sum(sorted(r["rounds_ms"])[:2]) / 2)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61, pos_emb="rope",
                          attn_pattern="S", attn_window=8))
    assert r["flops_per_token"] == model.flops_per_token(64) == 6 * (2 * (32 * 96 + 32 * 32 + 2 * 32 * 128) + 61 * 32) + 2 * 12 * 32 * 8  # window 8, not T=64
    assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"] / r["peak_flops"])
    assert r["peak_source"] == "measured matmul" and r["peak_rss_mb"] > 0
    saved = json.loads(out.read_text())
    assert saved["results"]["train"]["ms_per_step"] == r["ms_per_step"] and saved["config"]["n_layer"] == 2


def test_matmul_peak_counts_two_flops_per_multiply_add(monkeypatch):
    monkeypatch.setattr(bench, "seconds", lambda fn, device: 0.5)  # slower than the budget: stays at n=256
    assert bench.matmul_peak(torch.float32, "cpu") == 2 * 256**3 / 0.5
    assert bench.copy_bandwidth("cpu", n_bytes=1 << 20) == 2 * (1 << 20) / 0.5
    monkeypatch.setattr(bench, "seconds", lambda fn, device: 0.01)  # fast: n doubles up to max_n
    assert bench.matmul_peak(torch.float32, "cpu", max_n=512) == 2 * 512**3 / 0.01


def positions_of_two_calls(timer, model, monkeypatch):
    """Calls the decode timer twice; returns (input shape, cache length) of every forward it ran."""
    starts, hidden_states = [], model.hidden_states

    def recording(idx, kv_cache=None):
        starts.append((idx.shape, kv_cache.length))
        return hidden_states(idx, kv_cache)

    monkeypatch.setattr(model, "hidden_states", recording)
    assert timer() > 0 and timer() > 0
    return starts


def test_decode_timer_times_the_same_positions_after_its_context(monkeypatch):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61)).eval()
    timer, held = bench.decode_step_timer(model, 10, "cpu", n=3)
    assert held == 2 * 2 * 10 * 32 * 4  # keys and values of 10 positions, 2 layers, 32 floats each
    starts = positions_of_two_calls(timer, model, monkeypatch)
    assert starts == [((1, 1), 10), ((1, 1), 11), ((1, 1), 12)] * 2  # one token at a time, rewound each call
    with pytest.raises(bench.ConfigError, match="exceeds block_size"):
        bench.decode_step_timer(model, 62, "cpu", n=3)


def test_decode_timer_past_block_size_for_a_windowed_model(monkeypatch):
    # a window's cache cannot roll back 3 steps: each call starts from a copy of the state at the context
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=61, pos_emb="rope",
                          attn_pattern="S", attn_window=4)).eval()
    timer, held = bench.decode_step_timer(model, 40, "cpu", n=3)
    assert held == 2 * 2 * 4 * 32 * 4  # the window's 4 positions, not 40
    starts = positions_of_two_calls(timer, model, monkeypatch)
    assert starts == [((1, 1), 40), ((1, 1), 41), ((1, 1), 42)] * 2


def test_hf_twin_is_the_same_model():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61)).eval()
    twin = bench.hf_twin(model, "float32").eval()
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        assert (model(idx)[0] - twin(idx).logits).abs().max() < 1e-4


@pytest.mark.slow
def test_compare_and_sample_figures(tmp_path):
    pytest.importorskip("transformers")
    results = bench.main(["all", *SHAPE, "--rounds=5", "--steps=1", "--warmup=1", "--batch_size=2", "--prompt_len=8",
                          "--new_tokens=8", "--contexts=4,30", "--compare=hf", "--dtype=float32"])
    t, s = results["train"], results["sample"]
    assert t["speedup_vs_hf"] > 0 and len(t["hf_rounds_ms"]) == len(t["rounds_ms"]) == 5
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61))
    assert s["weight_bytes"] == (sum(p.numel() for p in model.parameters()) - 64 * 32) * 4  # all but the wpe table
    assert s["roofline_tokens_per_sec"] == pytest.approx(s["copy_bandwidth_gb_s"] * 1e9 / s["weight_bytes"])
    assert s["fraction_of_roofline"] == pytest.approx(s["decode_tokens_per_sec"] / s["roofline_tokens_per_sec"])
    assert set(s["decode_ms_per_token_at_context"]) == {4, 30} and s["speedup_vs_hf"] > 0
    assert s["decode_longest_vs_shortest_context"] > 0


def test_row_products_are_timed_side_by_side_and_named(capsys):
    results = bench.main(["sample", *SHAPE, "--rounds=5", "--warmup=0", "--prompt_len=8", "--new_tokens=8",
                          "--contexts=4", "--compare=row_products", "--dtype=float32"])
    s = results["sample"]
    assert set(s["generate_tokens_per_sec_by_row_product"]) == set(s["chosen_vs_row_product"]) <= set(quantize.ROW_PRODUCTS)
    assert {"linear", "mv", "linear_t", "bags"} <= set(s["chosen_vs_row_product"])  # aten's and fbgemm's run everywhere
    assert all(v > 0 for v in s["generate_tokens_per_sec_by_row_product"].values())
    machine, out = results["machine"]["row_products"], capsys.readouterr().out
    for shape, name in s["row_product"].items():  # each shape's product, named with its figures in the machine lines
        assert name in quantize.ROW_PRODUCTS and machine[f"float32 {shape}"].startswith(name + " (linear ")
        assert f"float32 {shape}: {name} (linear " in out


def test_bytes_per_token_count_what_a_decode_step_reads():
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=61))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # the tied head among them
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    fp32 = 4 * (sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in linears) + norms)
    assert bench.bytes_read_per_token(model) == fp32  # embeddings: a step looks up one row
    blocks = lambda m: -(-m.in_features // 32)  # noqa: E731  (Q8_0: a float16 scale per 32 weights of a row)
    int8 = sum(m.weight.numel() + 2 * m.out_features * blocks(m) + (4 * m.out_features if m.bias is not None else 0)
               for m in linears) + 4 * norms
    results = bench.main(["sample", *SHAPE, "--rounds=1", "--warmup=0", "--prompt_len=8", "--new_tokens=4",
                          "--contexts=4", "--weights_dtype=bfloat16"])
    assert results["sample"]["weight_bytes"] == fp32 // 2
    results = bench.main(["sample", *SHAPE, "--rounds=1", "--warmup=0", "--prompt_len=8", "--new_tokens=4",
                          "--contexts=4", "--weights_dtype=int8"])
    assert results["sample"]["weight_bytes"] == int8


def test_bad_requests(capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["train", *SHAPE, "--compare=hf", "--rounds=3"])
    assert exit.value.code == 2 and "needs at least 5 interleaved rounds" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        bench.main(["sample", *SHAPE, "--compare=row_products", "--compile=True", "--prompt_len=8", "--new_tokens=4"])
    assert exit.value.code == 2 and "compare=row_products times the eager step" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        bench.main(["sample", *SHAPE, "--prompt_len=60", "--new_tokens=10"])
    assert exit.value.code == 2 and "exceeds block_size=64" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        bench.main(["--n_layer=2"])
    assert exit.value.code == 2 and "train|sample|all" in capsys.readouterr().err


def test_float32_comparison_times_the_same_model_without_autocast():
    results = bench.main(["train", *SHAPE, "--rounds=5", "--steps=1", "--warmup=1", "--batch_size=2",
                          "--dtype=bfloat16", "--compare=float32"])
    r = results["train"]
    assert r["dtype"] == "bfloat16" and r["float32_ms_per_step"] > 0 and r["speedup_vs_float32"] > 0


def test_bench_json_is_written_atomically(tmp_path, monkeypatch):
    """A failure while writing --json leaves the previous file whole (the write goes to a temporary file
    that is renamed over it), as eval.py's --json."""
    import bench
    import dataset

    path = tmp_path / "bench.json"
    path.write_text('{"previous": true}')

    def failing_dumps(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dataset.json, "dumps", failing_dumps)
    with pytest.raises(OSError):
        bench.main(["train", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--vocab_size=32",
                    "--batch_size=2", "--rounds=1", "--steps=1", "--warmup=0", "--device=cpu", "--dtype=float32",
                    f"--json={path}"])
    assert path.read_text() == '{"previous": true}' and os.listdir(tmp_path) == ["bench.json"]


def test_compare_llama_cpp_interleaves_llama_bench_on_the_gguf_and_reports_the_ratio(tmp_path, trained_run, monkeypatch,
                                                                                    capsys):
    """--compare=llama.cpp: without llama-bench, one line and exit 2; with one (here a stand-in that checks it
    was given a GGUF file, -p 0 and -n new_tokens, and reports 50 tokens/s), its figure and the median ratio."""
    import sys

    args = ["sample", f"--out_dir={trained_run}", "--compare=llama.cpp", "--prompt_len=1", "--new_tokens=8",
            "--rounds=5", "--warmup=0", "--contexts=10", "--device=cpu"]
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    monkeypatch.setenv("LLAMA_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    with pytest.raises(SystemExit) as exit:
        bench.main(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "needs llama.cpp's llama-bench" in err and err.count("\n") == 1
    fake = tmp_path / "bin" / "llama-bench"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\na = sys.argv\n"
                    "assert open(a[a.index('-m') + 1], 'rb').read(4) == b'GGUF' and a[a.index('-p') + 1] == '0'\n"
                    "print(json.dumps([{'n_prompt': 0, 'n_gen': int(a[a.index('-n') + 1]), 'avg_ts': 50.0}]))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(tmp_path / "bin"))
    r = bench.main(args)["sample"]
    assert r["llama_cpp_decode_tokens_per_sec"] == pytest.approx(50.0) and r["llama_cpp_gguf_type"] == "f32"
    assert r["ours_vs_llama_cpp"] == pytest.approx(r["decode_tokens_per_sec"] / 50.0, rel=0.5)  # per-round medians
