"""
Measures training and sampling speed, optionally side by side with Hugging Face transformers.

  python bench.py train [config_file ...] [--key=value ...]   tokens/s, ms/step, MFU, peak memory
  python bench.py sample ...                                   prefill and decode tokens/s, ms/token by context
  python bench.py all ...                                      both
  python bench.py train --compare=hf --threads=1               ours and transformers', interleaved
  python bench.py sample --compare=llama.cpp --weights_dtype=int8   ours and llama.cpp's llama-bench on the GGUF
  python bench.py --help

The model is a random one of the shape the keys give (every GPTConfig field is a key), or a trained one
with --out_dir. With --compare=hf the same weights are loaded into GPT2LMHeadModel or LlamaForCausalLM
and the two are timed in alternation (A, B, A, B, ... for --rounds rounds), so load on the machine hits
both alike; ratios are medians of the per-round ratios.
"""

import copy
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from types import SimpleNamespace
from typing import Optional

import torch

import attention
import generate
import speculative
from checkpoint import load_any
from configurator import ConfigError, checked, cli_main, keys_of, parse_config
from dataset import write_json
from generate import Sampling
from gguf_file import write_gguf
from model import MODEL_CHOICES, GPT, ModelKeys, lm_loss, model_config, model_helps
from optim import OPTIMIZERS, build_optimizers
from quantize import (ROW_PRODUCTS, WEIGHTS_DTYPES, Int8Linear, RowLinear, for_inference, kernel_status, row_product_choices,
                      runs_here, shape_key, use_row_product)
from device import COMPUTE_DTYPES, DEVICES, autocast, cpu_facts, cuda_peak_flops, estimate_mfu, pick_device, pick_dtype, precision


@dataclass
class BenchConfig(ModelKeys):  # and every model key (model.ModelKeys)
    out_dir: str = ""  # benchmark the model in out_dir/ckpt.pt; empty = a random model of the shape keys below
    batch_size: int = 12  # training batch
    dtype: str = "auto"  # training autocast: auto | float32 | bfloat16 | float16 (auto as in train.py)
    weights_dtype: str = "float32"  # sampling: float32 | bfloat16 | float16 | int8 (CPU; quantised weights)
    device: str = "auto"  # auto | cpu | cuda | mps
    compile: bool = False  # train: torch.compile our training step's model (compile time reported apart); sample: decode as sample.py --compile=True does
    optimizer: str = "adamw"  # training step's optimizer: adamw | muon (as train.py builds them)
    threads: int = 0  # torch.set_num_threads; 0 = PyTorch's default
    rounds: int = 5  # interleaved rounds per measurement (at least 5 for --compare)
    steps: int = 3  # training steps timed per round
    warmup: int = 2  # untimed steps or generations first
    prompt_len: int = 512  # sampling: prompt tokens (prefill)
    new_tokens: int = 200  # sampling: generated tokens (greedy)
    contexts: str = "10,100,1000"  # sampling: decode ms per token at these context lengths
    compare: str = ""  # hf: also the same model in transformers; llama.cpp (sample): llama-bench on the same weights as GGUF; float32 (train): ours without autocast; adamw (train): ours with AdamW; row_products (sample, CPU): each one-row product; compiled (sample): also the static-cache compiled decode step
    compare_patterns: str = ""  # train: also these attn_patterns of the same shape, interleaved (e.g. L,R,SL; S layers take attn_window)
    hf_dtype: str = "float32"  # transformers' dtype for --compare=hf (its weights and compute)
    draft: str = ""  # sampling: speculative decoding with ngram (prompt lookup) or a draft model's out_dir; "" = off
    num_draft: Optional[int] = None  # sampling: tokens the draft proposes per step; None = 4 for ngram, 2 for a model
    prompt_file: str = ""  # sampling: the prompt's first prompt_len tokens come from this text (needs out_dir); "" = random tokens
    json: str = ""  # also write the results to this JSON file
    seed: int = 0


BENCH_CHOICES = {"dtype": COMPUTE_DTYPES, "device": DEVICES,
           "weights_dtype": WEIGHTS_DTYPES, "compare": ("", "hf", "llama.cpp", "float32", "adamw", "row_products", "compiled"), "optimizer": tuple(OPTIMIZERS),
           "hf_dtype": ("float32", "bfloat16"), **MODEL_CHOICES}  # fmt: skip
GREEDY = Sampling(temperature=0)


def config_keys():
    return keys_of(BenchConfig, BENCH_CHOICES, helps=model_helps(), base=ModelKeys)


# ----------------------------------------------------------------------------------------------------
# Measuring


def sync(device):
    """Waits for the device's queued work, so a timing is of the work and not of queueing it."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


def seconds(fn, device):
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleave(contenders, rounds):
    """contenders: name -> fn() returning seconds. Calls them in turn, round after round (A, B, A, B...),
    and returns name -> list of seconds."""
    times = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(fn())
    return times


def median_ratio(times, numerator, denominator):
    """Median over rounds of numerator's time / denominator's time: > 1 means the denominator is faster."""
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def matmul_peak(dtype, device, max_n=2048, repeats=5, budget=0.05):
    """FLOP/s of the best of a few n x n x n matmuls: the machine's practical peak at this dtype. n doubles
    from 256 to max_n while one product takes under `budget` seconds, so a dtype the CPU only emulates (bf16
    under AVX2, 30-100x slower than fp32) is measured in seconds, not the minutes n=2048 took."""
    n = 128
    while n < max_n:
        n *= 2
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        a @ b
        took = seconds(lambda: a @ b, device)
        if took > budget:
            break
    best = min(took, *(seconds(lambda: a @ b, device) for _ in range(repeats - 1)))
    return 2 * n**3 / best


def copy_bandwidth(device, n_bytes=1 << 29, repeats=5):
    """Bytes/s moved by a large tensor copy, counting the read and the write: the memory roofline's rate."""
    src = torch.empty(n_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(seconds(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * n_bytes / best


def peak_memory(device):
    if torch.device(device).type == "cuda":
        return {"peak_gpu_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20}
    if torch.device(device).type == "mps":  # the process's RSS says nothing of the GPU's share of memory
        return {"mps_driver_memory_mb": torch.mps.driver_allocated_memory() / 2**20}
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20}


# ----------------------------------------------------------------------------------------------------
# The two sides


def build_model(c, device, with_tokenizer=False):
    """(model, tokenizer): the model in out_dir (a run or a Hugging Face directory; its tokenizer only when
    asked), or a random one of the keys' shape (no tokenizer)."""
    if c.out_dir:
        model, tokenizer, _ = load_any(c.out_dir, with_tokenizer)
        if model.config.family != "decoder":
            raise ConfigError(f"bench.py times decoders; {c.out_dir} is family={model.config.family!r}")
        return model.to(device), tokenizer
    torch.manual_seed(c.seed)
    return GPT(checked(model_config, c)).to(device), None


def hf_twin(model, dtype):
    """The same weights in transformers (GPT2LMHeadModel or LlamaForCausalLM), via save_pretrained."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("--compare=hf needs transformers: pip install transformers") from None
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        twin = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype))
    return twin.to(next(model.parameters()).device)


HYPER = {"weight_decay": 0.1, "learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "muon_momentum": 0.95}


class OurTrainStep:
    def __init__(self, model, c, device, dtype):
        self.model, self.device = model, device
        device_type = torch.device(device).type
        self.optimizers = build_optimizers(model, SimpleNamespace(**HYPER, optimizer=c.optimizer, compile=c.compile), device_type)
        self.autocast = autocast(device_type, dtype)
        self.forward = torch.compile(model) if c.compile else model
        self.z_loss = model.config.z_loss

    def __call__(self, x, y):
        with self.autocast:
            logits, _ = self.forward(x)
        loss = lm_loss(logits, y, self.z_loss)[0]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


class HFTrainStep:
    """transformers' own recipe: its model computes the loss; torch's default AdamW."""

    def __init__(self, model):
        self.model = model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def __call__(self, x, y):
        loss = self.model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------


def bench_train(model, c, device, dtype):
    config = model.config
    if c.compare == "adamw" and c.optimizer == "adamw":
        raise ConfigError("compare=adamw measures another optimizer against AdamW: set optimizer=muon")
    if c.compare == "row_products":
        raise ConfigError("compare=row_products times decoding: use it with bench.py sample")
    B, T = c.batch_size, config.block_size
    g = torch.Generator().manual_seed(c.seed)
    x = torch.randint(config.vocab_size, (B, T), generator=g).to(device)
    y = torch.randint(config.vocab_size, (B, T), generator=g).to(device)
    steps = {"ours": OurTrainStep(model, c, device, dtype)}
    if c.compare == "hf":
        steps["hf"] = HFTrainStep(hf_twin(model, c.hf_dtype))
    elif c.compare == "float32":  # the same model and recipe, autocast off
        steps["float32"] = OurTrainStep(copy.deepcopy(model), replace(c, compile=False), device, "float32")
    elif c.compare == "adamw":  # the same model, autocast and compile, AdamW for every parameter
        steps["adamw"] = OurTrainStep(copy.deepcopy(model), replace(c, optimizer="adamw"), device, dtype)
    for pattern in filter(None, c.compare_patterns.split(",")):  # the same shape, other attention per layer
        other = checked(GPT, checked(attention.with_pattern, config, pattern)).to(device)
        steps[pattern] = OurTrainStep(other, c, device, dtype)
    compile_seconds = seconds(lambda: steps["ours"](x, y), device) if c.compile else None
    for step in steps.values():
        for _ in range(c.warmup):
            step(x, y)

    def timer(step):
        return lambda: seconds(lambda: [step(x, y) for _ in range(c.steps)], device) / c.steps

    times = interleave({name: timer(step) for name, step in steps.items()}, c.rounds)
    ms = statistics.median(times["ours"]) * 1000
    tokens_per_sec = B * T / (ms / 1000)
    device_type = torch.device(device).type
    measured_peak = None if device_type == "cuda" else matmul_peak(getattr(torch, dtype), device)
    peak = cuda_peak_flops(device, dtype) if device_type == "cuda" else measured_peak
    result = {
        "shape": f"{config.n_layer}x{config.n_embd}, T{T}, B{B}", "dtype": dtype, "optimizer": c.optimizer,
        "ms_per_step": ms,
        "tokens_per_sec": tokens_per_sec, "flops_per_token": model.flops_per_token(T),
        "mfu": estimate_mfu(model, tokens_per_sec, T, peak_flops=peak) if peak else None,
        "peak_flops": peak, "peak_source": "measured matmul" if measured_peak else "device table",
        "compile_seconds": compile_seconds, "rounds_ms": [t * 1000 for t in times["ours"]], **peak_memory(device),
    }  # fmt: skip
    if "hf" in times:
        result.update(hf_ms_per_step=statistics.median(times["hf"]) * 1000, hf_dtype=c.hf_dtype,
                      hf_rounds_ms=[t * 1000 for t in times["hf"]], speedup_vs_hf=median_ratio(times, "hf", "ours"))
    for pattern in set(times) - {"ours", "hf", "float32", "adamw"}:
        result.update({f"{pattern}_ms_per_step": statistics.median(times[pattern]) * 1000,
                       f"{pattern}_time_vs_ours": median_ratio(times, pattern, "ours")})
    if "float32" in times:
        result.update(float32_ms_per_step=statistics.median(times["float32"]) * 1000,
                      speedup_vs_float32=median_ratio(times, "float32", "ours"))
    if "adamw" in times:
        result.update(adamw_ms_per_step=statistics.median(times["adamw"]) * 1000,
                      speedup_vs_adamw=median_ratio(times, "adamw", "ours"))
    return result


def decode_step_timer(model, context, device, n=20):
    """(fn, bytes): fn() -> seconds per decode step with `context` tokens cached (the cache as generate()
    uses it), and the bytes the cache holds there. Each call times the same n positions from a copy of the
    cache at `context` (not timed: windows and linear states cannot roll back that far)."""
    config = model.config
    if config.context_limit is not None and context + n > config.context_limit:
        raise ConfigError(f"contexts: {context} + {n} steps exceeds block_size={config.block_size}")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(config.vocab_size, (1, context), generator=g).to(device)
    token = prompt[:, -1:]
    cache = model.new_cache()
    with torch.no_grad():  # the prompt (block_size tokens at a time past block_size), its last token decoded
        generate.next_logits(model, prompt, context - 1, cache)
        model.forward_cached(token, cache)
    held = cache.nbytes()

    @torch.no_grad()
    def steps(cache):
        for _ in range(n):
            model.forward_cached(token, cache).argmax(-1)

    def timed():
        fresh = copy.deepcopy(cache)
        return seconds(lambda: steps(fresh), device) / n

    return timed, held


def bytes_read_per_token(model):
    """Bytes of the weights a decode step reads in full: every parameter (and int8 weight with its
    scales) except embedding tables, of which a step reads one row; a tied head counts, as the head."""
    sizes = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        tensors = [*module.parameters(recurse=False)]
        if isinstance(module, Int8Linear):
            tensors += [t for t in module.buffers(recurse=False) if t is not None]
        sizes.update({id(t): t.numel() * t.element_size() for t in tensors})
    return sum(sizes.values())


def bench_sample(model, tokenizer, c, device):
    config = model.config
    if c.compare in ("float32", "adamw"):
        raise ConfigError(f"compare={c.compare} is for training; sampling compares with compare=hf, row_products or compiled")
    twin = hf_twin(model.eval(), c.hf_dtype).eval() if c.compare == "hf" else None  # from fp32 weights
    llama = llama_bench_runner(model, tokenizer, c, device) if c.compare == "llama.cpp" else None  # (fp32 weights too)
    model = checked(for_inference, model, c.weights_dtype)
    P, N = c.prompt_len, c.new_tokens
    if config.context_limit is not None and P + N > config.block_size:
        raise ConfigError(f"prompt_len + new_tokens = {P + N} exceeds block_size={config.block_size}; "
                          "beyond it every step recomputes the window (see generate.next_logits)")
    prompt = make_prompt(c, config, tokenizer, device)
    if c.draft:
        return bench_speculative(model, twin, tokenizer, prompt, c, device)
    step_line, static_len = None, None
    if c.compile:  # as sample.py --compile=True decodes: the compiled step where it measures faster here
        if c.compare in ("row_products", "compiled"):
            raise ConfigError(f"compare={c.compare} times the eager step against others: drop compile=True")
        static, step_line = checked(generate.faster_static_step, model, prompt, N, GREEDY)
        static_len = None if static is None else static.max_len
        print(step_line, file=sys.stderr)
    fresh_step = (lambda: None) if static_len is None else (lambda: generate.StaticDecode(model, GREEDY, max_len=static_len))
    runs = {
        "prefill": lambda: generate.next_logits(model, prompt, P, model.new_cache()),
        "ours": lambda: generate.generate(model, prompt, N, GREEDY, step=fresh_step()),
    }
    setups = {}  # name -> what runs before each of its timed runs, outside the time
    if c.compare == "row_products":
        rows = [m for m in model.modules() if isinstance(m, RowLinear)]
        if not rows:
            raise ConfigError("compare=row_products: this model has no one-row products to compare (CPU, float weights only)")
        chosen = {shape_key(m.weight): m.product for m in rows}  # "ours" below: each shape's product, as loaded
        one_per_shape = list({shape_key(m.weight): (m.weight.detach(), m.bias) for m in rows}.values())
        products = [name for name in ROW_PRODUCTS if runs_here(name, one_per_shape)]  # bf16 oneDNN may not
        runs.update({f"ours_{name}": runs["ours"] for name in products})
        # each product with its weights laid out for it, re-laid before its run and outside its time
        setups = {f"ours_{name}": (lambda name=name: use_row_product(model, name)) for name in products}
        setups["ours"] = setups["prefill"] = lambda: use_row_product(model, chosen)  # the decode figure is ours less its prefill
    compile_seconds = None
    if c.compare == "compiled":
        checked(generate.check_static, model)
        runs["compiled"] = lambda: generate.generate(model, prompt, N, GREEDY, step=generate.StaticDecode(model, GREEDY))
        with torch.no_grad():
            compile_seconds = seconds(runs["compiled"], device)  # the first call compiles
    if twin is not None:
        mask = torch.ones_like(prompt)
        runs["hf"] = lambda: twin.generate(prompt, attention_mask=mask, max_new_tokens=N, min_new_tokens=N,
                                           do_sample=False, pad_token_id=0)

    def timed(name, run):
        def time_it():
            if name in setups:
                setups[name]()
            return seconds(run, device)
        return time_it

    contenders = {name: timed(name, run) for name, run in runs.items()}
    if llama is not None:  # llama-bench's own time for N tokens from an empty context, one call per round
        contenders["llama.cpp"] = llama
    with torch.no_grad():
        for name, run in contenders.items():
            for _ in range(c.warmup):
                run()
        times = interleave(contenders, c.rounds)
    if c.compare == "row_products":
        use_row_product(model, chosen)  # back in place for the timings by context below
    prefill, total = statistics.median(times["prefill"]), statistics.median(times["ours"])
    weight_bytes = bytes_read_per_token(model)
    bandwidth = copy_bandwidth(device)
    decode_per_token = (total - prefill) / N
    result = {
        "shape": f"{config.n_layer}x{config.n_embd}, vocab {config.vocab_size}", "weights_dtype": c.weights_dtype,
        "prompt_len": P, "new_tokens": N, "prefill_tokens_per_sec": P / prefill, "decode_tokens_per_sec": 1 / decode_per_token,
        "generate_tokens_per_sec": N / total, "weight_bytes": weight_bytes, "copy_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tokens_per_sec": bandwidth / weight_bytes,
        "fraction_of_roofline": (1 / decode_per_token) / (bandwidth / weight_bytes),
        **decode_by_context(model, c, device), **peak_memory(device),
    }  # fmt: skip
    if step_line is not None:
        result["decode_step"] = step_line.split(": ", 1)[1]
    if c.compare == "row_products":
        result.update(row_product={f"{n}x{k}": name for (_, n, k), name in chosen.items()},
                      generate_tokens_per_sec_by_row_product={n: N / statistics.median(times[f"ours_{n}"]) for n in products},
                      chosen_vs_row_product={n: median_ratio(times, f"ours_{n}", "ours") for n in products})
    if "compiled" in times:
        compiled = statistics.median(times["compiled"])
        result.update(compiled_compile_seconds=compile_seconds, compiled_generate_tokens_per_sec=N / compiled,
                      compiled_decode_tokens_per_sec=N / (compiled - prefill), compiled_vs_eager=median_ratio(times, "ours", "compiled"))
    if "llama.cpp" in times:  # per round: our decode (generate less its prefill) against llama-bench's tokens
        ours = [(t - p) / N for t, p in zip(times["ours"], times["prefill"])]
        theirs = [t / N for t in times["llama.cpp"]]
        llama_tps = 1 / statistics.median(theirs)
        result.update(llama_cpp_decode_tokens_per_sec=llama_tps, llama_cpp_gguf_type=GGUF_TYPES[c.weights_dtype],
                      ours_vs_llama_cpp=statistics.median(b / a for a, b in zip(ours, theirs)),
                      llama_cpp_fraction_of_roofline=llama_tps / (bandwidth / weight_bytes))
    if "hf" in times:
        result.update(hf_generate_tokens_per_sec=N / statistics.median(times["hf"]), hf_dtype=c.hf_dtype,
                      speedup_vs_hf=median_ratio(times, "hf", "ours"))
    return result


GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "q8_0"}  # our weights -> llama.cpp's


def llama_bench_binary():
    """llama.cpp's llama-bench: on PATH, in LLAMA_CPP_DIR (or its build/bin), or ../shared/build-llamacpp.sh's
    build (LLAMA_DIR, default ~/.cache/llama.cpp-build); a ConfigError saying how to get it."""
    roots = [os.environ.get("LLAMA_CPP_DIR"), os.path.join(os.path.expanduser(os.environ.get("LLAMA_DIR", "~/.cache/llama.cpp-build")), "src")]
    candidates = [shutil.which("llama-bench")] + [os.path.join(root, *sub, "llama-bench") for root in roots if root
                                                  for sub in ((), ("bin",), ("build", "bin"))]
    found = next((p for p in candidates if p and os.path.isfile(p) and os.access(p, os.X_OK)), None)
    if found is None:
        raise ConfigError("--compare=llama.cpp needs llama.cpp's llama-bench: put it on PATH or set LLAMA_CPP_DIR to a "
                          "llama.cpp checkout built with cmake (../shared/build-llamacpp.sh builds one here)")
    return found


def llama_bench_runner(model, tokenizer, c, device):
    """fn() -> llama-bench's seconds for new_tokens tokens generated from an empty context (its tg test, one
    repetition), on our weights written as GGUF in the type matching weights_dtype, with our thread count."""
    if torch.device(device).type != "cpu":
        raise ConfigError("--compare=llama.cpp times llama.cpp on the CPU: run it with --device=cpu")
    if c.weights_dtype not in GGUF_TYPES:
        raise ConfigError(f"--compare=llama.cpp: weights_dtype={c.weights_dtype!r} has no GGUF twin; use one of {', '.join(GGUF_TYPES)}")
    binary = llama_bench_binary()
    meta = tokenizer.meta() if tokenizer is not None else {"kind": "tiktoken", "encoding": "gpt2"}  # a random model: GPT-2's
    folder = tempfile.TemporaryDirectory(prefix="bench-gguf-")  # removed with run (or at exit): no GGUFs left in /tmp
    path = os.path.join(folder.name, "model.gguf")
    write_gguf(model.float().cpu(), meta, path, GGUF_TYPES[c.weights_dtype])
    threads = c.threads or torch.get_num_threads()
    command = [binary, "-m", path, "-p", "0", "-n", str(c.new_tokens), "-t", str(threads), "-r", "1", "-o", "json"]

    def run(folder=folder):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(f"llama-bench exited {done.returncode}: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
        test = next(t for t in json.loads(done.stdout) if t.get("n_gen") == c.new_tokens)
        return c.new_tokens / test["avg_ts"]

    return run


def make_prompt(c, config, tokenizer, device):
    """prompt_len random tokens, or the first prompt_len tokens of --prompt_file in the model's tokenizer."""
    if not c.prompt_file:
        g = torch.Generator().manual_seed(c.seed)
        return torch.randint(config.vocab_size, (1, c.prompt_len), generator=g).to(device)
    if tokenizer is None:
        raise ConfigError("prompt_file needs a trained model's tokenizer: give --out_dir")
    try:
        with open(c.prompt_file, encoding="utf-8") as f:
            ids = tokenizer.encode(f.read())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"prompt_file={c.prompt_file}: cannot read it as UTF-8 text ({e})") from None
    if len(ids) < c.prompt_len:
        raise ConfigError(f"prompt_file={c.prompt_file} has {len(ids)} tokens, fewer than prompt_len={c.prompt_len}")
    return torch.tensor([ids[: c.prompt_len]], device=device)


def bench_speculative(model, twin, tokenizer, prompt, c, device):
    """Greedy speculative decoding against our plain decode, and with --compare=hf against transformers'
    plain and assisted generation (the same draft weights as assistant_model, or prompt_lookup_num_tokens
    for ngram), interleaved. Every contender must produce the same tokens as our plain decode."""
    draft = speculative.load_draft(c.draft, c.num_draft)
    draft.check(model.config, tokenizer)  # before transformers' twins are built
    N, k = c.new_tokens, draft.num_draft
    draft_twin = None
    if isinstance(draft, speculative.ModelDraft):
        draft_twin = hf_twin(draft.model.to(device), c.hf_dtype).eval() if twin is not None else None
        draft.for_inference(device, c.weights_dtype)
    runs = {
        "ours": lambda: generate.generate(model, prompt, N, GREEDY),
        "ours_speculative": lambda: speculative.generate(model, prompt, N, GREEDY, draft),
    }
    if twin is not None:
        hf = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
        runs["hf"] = lambda: twin.generate(prompt, **hf)
        if draft_twin is None:
            runs["hf_assisted"] = lambda: twin.generate(prompt, prompt_lookup_num_tokens=k,
                                                        max_matching_ngram_size=draft.max_ngram, **hf)
        else:
            runs["hf_assisted"] = lambda: twin.generate(prompt, assistant_model=draft_twin, **hf)
    with torch.no_grad():
        outputs = {name: run()[0, prompt.size(1) :].tolist() for name, run in runs.items()}
        draft.reset_stats()  # count one speculative run
        runs["ours_speculative"]()
        stats = {"acceptance_rate": draft.accepted / max(1, draft.proposed), "drafted_per_check": draft.proposed / max(1, draft.checks),
                 "target_forwards_per_token": (N - draft.accepted) / N}  # fmt: skip
        for run in runs.values():
            for _ in range(c.warmup - 1):
                run()
        times = interleave({name: (lambda run=run: seconds(run, device)) for name, run in runs.items()}, c.rounds)
    result = {"shape": f"{model.config.n_layer}x{model.config.n_embd}, vocab {model.config.vocab_size}",
              "draft": c.draft, "num_draft": k, "prompt_len": prompt.size(1), "new_tokens": N, **stats,
              "same_tokens_as_our_plain_decode": {name: out == outputs["ours"] for name, out in outputs.items() if name != "ours"},
              **{f"{name}_tokens_per_sec": N / statistics.median(t) for name, t in times.items()},
              "speculative_vs_plain": median_ratio(times, "ours", "ours_speculative")}  # fmt: skip
    if twin is not None:
        result.update(speculative_vs_hf=median_ratio(times, "hf", "ours_speculative"),
                      speculative_vs_hf_assisted=median_ratio(times, "hf_assisted", "ours_speculative"))
    return result


def decode_by_context(model, c, device):
    """Decode ms per token and the cache's bytes at each context length, the lengths interleaved round by
    round, and the median ratio of the longest context's time to the shortest's."""
    lengths = contexts(c, model.config)
    timers = {ctx: decode_step_timer(model, ctx, device) for ctx in lengths}
    times = interleave({ctx: timer for ctx, (timer, _) in timers.items()}, c.rounds)
    return {
        "decode_ms_per_token_at_context": {ctx: statistics.median(t) * 1000 for ctx, t in times.items()},
        "cache_mb_at_context": {ctx: held / 2**20 for ctx, (_, held) in timers.items()},
        "decode_longest_vs_shortest_context": median_ratio(times, max(lengths), min(lengths)),
    }


def contexts(c, config):
    """--contexts that fit the model (every one, for a model that runs any length)."""
    out = [int(x) for x in c.contexts.split(",") if x.strip()]
    limit = config.context_limit
    return [ctx for ctx in out if limit is None or ctx + 20 <= limit] or [min(10, config.block_size - 21)]


def machine(device_type):
    """What every figure depends on: the CPU (its instruction set as torch reports it), threads, and
    the precision decision (device.py)."""
    facts = cpu_facts()
    out = {"cpu": facts["name"], "torch_cpu_capability": facts["capability"], "onednn_bf16": facts["onednn_bf16"],
           "bf16_instructions": "+".join(facts["bf16_instructions"]) or "none", "torch_threads": facts["threads"],
           "bf16_fast": precision(device_type).bf16_fast}
    if device_type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def report(results):
    for kind, r in results.items():
        print(f"== {kind}")
        for k, v in r.items():
            if isinstance(v, float):
                v = f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
            elif isinstance(v, dict):
                v = ", ".join(f"{a}: {b:.3f}" if isinstance(b, float) else f"{a}: {b}" for a, b in v.items())
            elif isinstance(v, list):
                v = ", ".join(f"{x:.1f}" for x in v)
            print(f"  {k:<34} {v}")


def main(argv=None):
    return cli_main(run_benchmarks, argv)


def run_benchmarks(argv):
    what = argv[0] if argv and argv[0] in ("train", "sample", "all") else None
    c, _ = parse_config(BenchConfig, argv[1:] if what else argv,
                        "python bench.py train|sample|all [config_file ...] [--key=value ...]",
                        __doc__.strip().splitlines()[0], config_keys())
    if what is None:
        raise ConfigError("say what to measure first: python bench.py train|sample|all ...")
    if c.compare and c.rounds < 5:
        raise ConfigError(f"rounds={c.rounds}: a comparison needs at least 5 interleaved rounds")
    if c.threads > 0:
        torch.set_num_threads(c.threads)
    device = pick_device(c.device)
    dtype = pick_dtype(c.dtype, torch.device(device).type)
    results = {"machine": machine(torch.device(device).type)}
    if what in ("train", "all"):
        results["train"] = bench_train(build_model(c, device)[0], c, device, dtype)
    if what in ("sample", "all"):
        model, tokenizer = build_model(c, device, with_tokenizer=bool(c.prompt_file or c.draft or c.compare == "llama.cpp"))
        results["sample"] = bench_sample(model, tokenizer, c, device)
    results["machine"]["row_products"] = row_product_choices() or "none chosen (no CPU inference)"
    if torch.device(device).type == "cpu" and what in ("sample", "all"):
        results["machine"]["one_row_kernel"] = kernel_status()
    report(results)
    if c.json:
        write_json(c.json, {"config": asdict(c), "results": results})
    return results


if __name__ == "__main__":
    main()
