"""
Samples text from a trained model (or GPT-2 / a Hugging Face model directory) with the KV cache.

  python sample.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:" --num_samples=3
  python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --stream=True
  python sample.py --out_dir=out-seq2seq --source=40213 --temperature=0   # an encoder-decoder
  python sample.py --help

The num_samples samples run as one batch; sample i draws from its own generator seeded with seed + i,
so sample i of a batch is exactly what a run with --seed=<seed + i> --num_samples=1 prints.
"""

import sys
from dataclasses import dataclass, replace
from typing import Optional

import torch

import generate
import speculative
from checkpoint import ContextKeys, load_for
from configurator import ConfigError, DataError, checked, command_line, keys_of, read_prompt, unescape
from device import DEVICES, pick_device
from generate import Sampling, check_max_new_tokens
from quantize import WEIGHTS_DTYPES, for_inference, precision_line
from tokenizer import EOT, continuation, decoder_start, source_end, source_ids


@dataclass
class SampleConfig(ContextKeys):
    out_dir: str = "out"  # the training run's directory (init_from=resume)
    init_from: str = "resume"  # resume (out_dir/ckpt.pt) | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face model directory
    start: str = "\n"  # the prompt (\n, \t, \\ are a newline, a tab, a backslash), or FILE:path to read it from a file
    num_samples: int = 3  # samples, generated together as one batch
    max_new_tokens: int = 500  # tokens to generate per sample
    temperature: float = 0.8  # 0 = greedy; below 1 sharper, above 1 more random
    top_k: Optional[int] = 200  # sample among the k most likely tokens only; None = all
    top_p: Optional[float] = None  # sample from the smallest set of tokens whose probability reaches p; None = off
    seed: int = 1337  # sample i uses seed + i
    device: str = "auto"  # auto | cpu | cuda | mps
    weights_dtype: str = "auto"  # weights for inference: auto (bf16 on a GPU with bf16, else float32) | float32 | bfloat16 | float16 | int8 (CPU; quantised, see docs/guide.md)
    stream: bool = False  # print text as tokens arrive (needs num_samples=1)
    stop: Optional[str] = None  # end each sample before this string (\n, \t, \\ as in start); <|endoftext|> = the end-of-text token
    draft: str = ""  # speculative decoding: ngram (prompt lookup) | a smaller model's out_dir or Hugging Face name/directory; "" = off
    num_draft: Optional[int] = None  # tokens the draft proposes per step; None = 4 for ngram, 2 for a model
    crop_prompt: str = "no"  # a prompt longer than block_size: no (refused) | left (keep its last block_size tokens, as nanoGPT)
    compile: bool = False  # decode through static caches with a torch.compile'd step (CUDA graphs on a GPU) where it measures faster than eager here; the same tokens but for float rounding
    source: str = ""  # an encoder-decoder's input (FILE:path reads a file): the encoder reads it, the decoder writes from its start token


SAMPLE_CHOICES = {"device": DEVICES, "weights_dtype": WEIGHTS_DTYPES, "crop_prompt": ("no", "left"), **ContextKeys.CHOICES}
RENAMED = {"dtype": "weights_dtype"}  # the weight format, named as in bench.py (dtype is the compute dtype)


def encode_prompt(tokenizer, text, limit, crop="no"):
    """The prompt's token ids; limit: the model's context_limit (None: a model that runs any length).
    Longer than limit: refused, or with crop="left" its last limit tokens (what the model can see)."""
    ids = tokenizer.encode(text)
    if not ids:
        if tokenizer.eot_token is None:
            raise ConfigError("the prompt is empty; give some text with --start")
        ids = [tokenizer.eot_token]  # GPT-2's unconditional start
    if limit is not None and len(ids) > limit:
        if crop == "left":
            print(f"note: the prompt is {len(ids)} tokens; its first {len(ids) - limit} are dropped (crop_prompt=left)",
                  file=sys.stderr)
            return ids[-limit:]
        raise ConfigError(f"the prompt is {len(ids)} tokens, longer than the model's context (block_size="
                          f"{limit}); shorten it, or pass --crop_prompt=left to keep its last {limit} tokens")
    return ids


def stop_token(tokenizer, stop):
    """The token id that ends generation early, when the stop string is one token."""
    if stop is None:
        return None
    if stop == EOT:
        if tokenizer.eot_token is None:
            raise ConfigError(f"stop={EOT}: this tokenizer has no end-of-text token")
        return tokenizer.eot_token
    try:
        ids = tokenizer.encode(stop)
    except DataError:
        return None  # it cannot occur in this vocabulary: only the text cut applies, and never matches
    return ids[0] if len(ids) == 1 else None


def cut_at_stop(text, stop):
    if stop is None or stop == EOT:
        return text
    at = text.find(stop)
    return text if at < 0 else text[:at]


def decode(tokenizer, prompt_ids, ids, stop):
    if stop == EOT and tokenizer.eot_token in ids:
        ids = ids[: ids.index(tokenizer.eot_token)]
    return cut_at_stop(continuation(tokenizer, prompt_ids, ids), stop)


def log_precision(c, device, ids, config):
    """One line on stderr, once the input has passed its checks (bad input gets its error line alone), and
    the notes on the run's length (length_notes)."""
    print(precision_line(c.weights_dtype, device), file=sys.stderr)
    for note in length_notes(c, len(ids), config):
        print(note, file=sys.stderr, flush=True)


def compiled_step(model, c, idx, generators):
    """compile=True: the compiled step where it measures faster than eager here (generate.faster_static_step)."""
    if not c.compile:
        return None
    step, line = checked(generate.faster_static_step, model, idx, c.max_new_tokens, sampling_of(c))
    print(line, file=sys.stderr, flush=True)
    if step is not None:
        step.generator = generators
    return step


def sampling_of(c):
    return checked(Sampling, c.temperature, c.top_k, c.top_p)


def generate_texts(model, tokenizer, prompt, c, device, draft=None):
    """The generated continuations (prompt excluded), one per sample."""
    ids = encode_prompt(tokenizer, prompt, model.config.context_limit, c.crop_prompt)
    idx = torch.tensor([ids] * c.num_samples, dtype=torch.long, device=device)
    generators = [torch.Generator(device=device).manual_seed(c.seed + i) for i in range(c.num_samples)]
    eos = stop_token(tokenizer, c.stop)
    log_precision(c, device, ids, model.config)
    if draft is None:
        out = generate.generate(model, idx, c.max_new_tokens, sampling_of(c), eos_token_id=eos, generator=generators,
                                step=compiled_step(model, c, idx, generators))
    else:
        out = speculative.generate(model, idx, c.max_new_tokens, sampling_of(c), draft, eos, generators)
    return [decode(tokenizer, ids, row[len(ids) :].tolist(), c.stop) for row in out]


def seq2seq_texts(model, tokenizer, source, c, device):
    """An encoder-decoder's outputs for one source, one per sample: the encoder runs once, the decoder
    writes from its start token until its end token."""
    ids = source_ids(tokenizer, source)
    if len(ids) > model.config.block_size:
        raise ConfigError(f"the source is {len(ids)} tokens, longer than the model's block_size={model.config.block_size}")
    src = torch.tensor([ids] * c.num_samples, dtype=torch.long, device=device)
    idx = torch.full((c.num_samples, 1), decoder_start(tokenizer), dtype=torch.long, device=device)
    generators = [torch.Generator(device=device).manual_seed(c.seed + i) for i in range(c.num_samples)]
    end = source_end(tokenizer)
    new = min(c.max_new_tokens, model.config.block_size - 1)  # the decoder's context: its start and `new` tokens
    log_precision(replace(c, max_new_tokens=new), device, [0], model.config)
    out = generate.generate(model, idx, new, sampling_of(c), eos_token_id=end, generator=generators, source=src)
    rows = [row[1:].tolist() for row in out]
    return [tokenizer.decode(row[: row.index(end)] if end in row else row) for row in rows]


def stream_text(model, tokenizer, prompt, c, device, write, draft=None):
    """One sample, written as it arrives after the prompt; returns the sample (prompt excluded). Text that
    could be the start of the stop string is held back until it is clear it is not; a token that ends
    inside a multi-byte character waits for the rest."""
    ids = encode_prompt(tokenizer, prompt, model.config.context_limit, c.crop_prompt)
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    generator = [torch.Generator(device=device).manual_seed(c.seed)]
    stop = c.stop
    hold = 0 if stop in (None, EOT) else len(stop) - 1
    new, shown = [], ""
    eos = stop_token(tokenizer, stop)
    log_precision(c, device, ids, model.config)
    write(prompt)  # as batch mode prints it: the prompt, then the sample
    if draft is None:
        columns = generate.stream(model, idx, c.max_new_tokens, sampling_of(c), eos_token_id=eos, generator=generator,
                                  step=compiled_step(model, c, idx, generator))
    else:
        columns = speculative.stream(model, idx, c.max_new_tokens, sampling_of(c), draft, eos, generator)
    for column in columns:
        new.append(int(column[0, 0]))
        text = decode(tokenizer, ids, new, stop)
        ended = len(text) < len(continuation(tokenizer, ids, new))  # the stop string (or token) has appeared
        ready = text if ended else text[: len(text) - hold]
        if ready.endswith("\ufffd") and not ended:
            continue
        if len(ready) > len(shown):
            write(ready[len(shown) :])
            shown = ready
        if ended:
            break
    write(text[len(shown) :])  # whatever was held back
    return text


LONG_RUN = 10_000  # new tokens per sample from which a batch that prints only at its end gets a note


def length_notes(c, prompt_tokens, config):
    """Lines for stderr before generating (the prompt, as cropped, of prompt_tokens): a run past the context (every token then recomputes the last
    block_size, as serve.py does too), and a long one that prints nothing until it ends."""
    notes = []
    limit = config.context_limit
    if limit is not None and prompt_tokens + c.max_new_tokens - 1 > limit:  # the last token comes from P + N - 1
        notes.append(f"note: {prompt_tokens} prompt + {c.max_new_tokens:,} new tokens pass block_size={limit}: from "
                     f"there each token runs the last {limit} afresh (no cache), slower per token")
    if c.max_new_tokens >= LONG_RUN and not c.stream:
        notes.append(f"note: {c.max_new_tokens:,} new tokens per sample print only when all {c.num_samples} are done; "
                     "--stream=True --num_samples=1 prints them as they come, Ctrl-C stops")
    return notes


def sample(c):
    """Prints c.num_samples samples (or streams one); the draft's statistics on stderr."""
    checked(check_max_new_tokens, c.max_new_tokens)
    sampling_of(c)
    if c.num_samples < 1:
        raise ConfigError(f"num_samples={c.num_samples} must be >= 1")
    if c.stream and c.num_samples != 1:
        raise ConfigError("stream=True prints one sample as it arrives: set num_samples=1")
    if c.compile and c.draft:
        raise ConfigError("compile=True compiles the plain decode step; speculative decoding (draft) runs eager: "
                          "leave one of them off")
    device = pick_device(c.device)
    draft = speculative.load_draft(c.draft, c.num_draft) if c.draft else None  # a bad num_draft fails here
    model, tokenizer, _ = load_for(c)
    seq2seq = model.config.family == "encoder-decoder"
    if model.config.family == "encoder":
        raise ConfigError("this model is an encoder (family='encoder'): it fills masks or classifies, it does not sample "
                          "text; score it with eval.py")
    if seq2seq != bool(c.source) or (seq2seq and (c.stream or c.draft or c.compile)):
        raise ConfigError("an encoder-decoder writes from --source=TEXT (no stream, draft or compile)" if seq2seq else
                          "--source is an encoder-decoder's input; this model continues --start")
    model = checked(for_inference, model.to(device=device), c.weights_dtype)
    if draft is not None:
        draft.check(model.config, tokenizer)
        draft.for_inference(device, c.weights_dtype)
    prompt = read_prompt(c.start)
    c = replace(c, stop=None if c.stop is None else unescape(c.stop))
    try:
        if seq2seq:
            for text in seq2seq_texts(model, tokenizer, read_prompt(c.source), c, device):
                print(text)
                print("---------------")
        elif c.stream:
            stream_text(model, tokenizer, prompt, c, device, lambda s: print(s, end="", flush=True), draft)
            print()
        else:
            for text in generate_texts(model, tokenizer, prompt, c, device, draft):
                print(prompt + text)
                print("---------------")
    except KeyboardInterrupt:  # samples print whole or not at all (a streamed one stops where it was)
        print("\nerror: interrupted" if c.stream else "error: interrupted; nothing printed", file=sys.stderr)
        sys.exit(130)
    if draft is not None and draft.checks:
        print(draft.summary(), file=sys.stderr)


main = command_line(SampleConfig, "python sample.py [config_file ...] [--key=value ...]",
                    __doc__.strip().splitlines()[0], sample,
                    keys_of(SampleConfig, SAMPLE_CHOICES, base=ContextKeys), RENAMED)


if __name__ == "__main__":
    main()
