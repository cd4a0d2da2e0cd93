"""
Runs a model through llama.cpp and compares it with ours: the prompt's token ids, greedy tokens, logits.

  python tools/llamacpp.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:"       # exports a GGUF, then compares
  python tools/llamacpp.py --init_from=model.gguf --start="ROMEO:" --new_tokens=64   # a GGUF file as it is
  python tools/llamacpp.py --out_dir=out-chat-tasks --chat="reverse: stone"           # a chat model, through its template
  python tools/llamacpp.py --out_dir=RUN --text=book.txt                              # token ids on a whole text too

llama.cpp runs through llama-cpp-python: in the Python --python names, LLAMA_CPP_PYTHON, this Python, or the one
../shared/build-llamacpp.sh builds (FOLDER/venv/bin/python, FOLDER = LLAMA_DIR or ~/.cache/llama.cpp-build; its
libllama from FOLDER/env.sh).
Without it, one line says how to get it and the exit status is 2. The comparison keeps llama.cpp's KV cache in
f32 (its default, f16, moves logits by about 1e-3), so f32 weights give our logits to float rounding.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint import load_any  # noqa: E402
from configurator import UserError, fail, unescape  # noqa: E402
from generate import Sampling  # noqa: E402
from gguf_file import write_gguf  # noqa: E402

RUNNER = """
import json, sys
import numpy as np
import llama_cpp
a = json.loads(sys.stdin.read())
llm = llama_cpp.Llama(model_path=a["path"], n_ctx=a["n_ctx"], logits_all=True, verbose=False, n_threads=a["threads"],
                      type_k=0, type_v=0)  # an f32 KV cache (GGML_TYPE_F32): llama.cpp's default f16 rounds keys
ids = llm.tokenize(a["prompt"].encode(), add_bos=False, special=a["special"])
llm.eval(ids)
prompt_logits = np.asarray(llm.scores[: len(ids)]).tolist()
out = []
for _ in range(a["new_tokens"]):
    t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out.append(t)
    if (a["special"] and t == llm.token_eos()) or llm.n_tokens >= a["n_ctx"]:
        break
    llm.eval([t])
text_ids = llm.tokenize(open(a["text"], encoding="utf-8").read().encode(), add_bos=False, special=False) if a["text"] else None
print(json.dumps({"ids": ids, "out": out, "logits": prompt_logits, "text_ids": text_ids}))
"""


BUILD = os.path.expanduser(os.environ.get("LLAMA_DIR", "~/.cache/llama.cpp-build"))  # ../shared/build-llamacpp.sh's


def llama_env():
    """This environment, with LLAMA_CPP_LIB_PATH from the shared build's env.sh where it has one."""
    env = dict(os.environ)
    path = os.path.join(BUILD, "env.sh")
    if "LLAMA_CPP_LIB_PATH" not in env and os.path.exists(path):
        with open(path) as f:
            env["LLAMA_CPP_LIB_PATH"] = f.read().split("=", 1)[1].strip()
    return env


def llama_python(given=""):
    """The Python that imports llama_cpp (given, LLAMA_CPP_PYTHON, this one, the shared build's); a UserError
    saying how to get one."""
    for python in (given, os.environ.get("LLAMA_CPP_PYTHON"), sys.executable, os.path.join(BUILD, "venv", "bin", "python")):
        if python and shutil.which(python) and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True,
                                                              env=llama_env()).returncode == 0:
            return python
    raise UserError("llama.cpp is not found: pip install llama-cpp-python (or ../shared/build-llamacpp.sh, or "
                    "--python=a Python that has it)")


def compare(args):
    python = llama_python(args.python)
    model, tokenizer, state = load_any(args.init_from or args.out_dir)
    model.eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.init_from
        if state is not None:  # a training run: exported as it would be
            path = os.path.join(tmp, "model.gguf")
            write_gguf(model, state["tokenizer"], path, args.gguf_type)
        if args.chat and not hasattr(tokenizer, "render"):
            raise UserError("--chat needs a model fine-tuned on conversations (it has no chat template); use --start")
        if args.chat:
            messages = [{"role": "user", "content": args.chat}]
            ids = tokenizer.render(messages, add_generation_prompt=True)[0]
            prompt = tokenizer.decode(ids)
        else:
            prompt = unescape(args.start)  # \n, \t as sample.py reads them
            ids = tokenizer.encode(prompt)
        request = {"path": path, "n_ctx": model.config.block_size, "threads": args.threads, "prompt": prompt,
                   "special": bool(args.chat), "new_tokens": args.new_tokens, "text": args.text}
        done = subprocess.run([python, "-c", RUNNER], input=json.dumps(request), capture_output=True, text=True,
                              env=llama_env())
        if done.returncode:
            said = [line for line in done.stderr.strip().splitlines() if "rror" in line] or done.stderr.strip().splitlines() or ["-"]
            raise UserError(f"llama.cpp exited with status {done.returncode} on {path}: {said[-1]}")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    end = tokenizer.end_token if args.chat else None  # (llama.cpp stops at the end token only for a chat, too)
    with torch.no_grad():
        ours = model.generate(torch.tensor([ids]), len(theirs["out"]), Sampling(temperature=0), eos_token_id=end)
        logits = model(torch.tensor([ids]))[0][0]
    ours = ours[0, len(ids):].tolist()
    same = sum(a == b for a, b in zip(ours, theirs["out"]))
    diff = (logits - torch.tensor(theirs["logits"])).abs().max().item() if theirs["ids"] == ids else float("nan")
    print(f"prompt: {len(ids)} tokens, ids {'equal' if theirs['ids'] == ids else 'DIFFER'}; teacher-forced logits: max "
          f"difference {diff:.2e}")
    print(f"greedy: {same}/{len(ours)} tokens equal ({len(set(ours))} distinct)")
    print(f"  ours:      {tokenizer.decode(ours)!r}")
    print(f"  llama.cpp: {tokenizer.decode(theirs['out'])!r}")
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            mine = tokenizer.encode(f.read())
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs["text_ids"])) if a != b), None)
        print(f"{args.text}: {len(mine)} tokens ours, {len(theirs['text_ids'])} llama.cpp: "
              + ("equal" if mine == theirs["text_ids"] else f"DIFFER (first at {first})"))
    return 0 if theirs["ids"] == ids and same == len(ours) else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="a training run (exported to a GGUF for the comparison)")
    parser.add_argument("--init_from", default="", help="a GGUF file to compare as it is (instead of --out_dir)")
    parser.add_argument("--start", default="\n", help="the prompt (\\n, \\t as in sample.py)")
    parser.add_argument("--chat", default="", help="a user message: the prompt is the chat template's, with specials")
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--gguf_type", default="f32", help="f32 | f16 | bf16 | q8_0 (the export's weights)")
    parser.add_argument("--text", default="", help="a text file to tokenize both ways")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--python", default="", help="a Python that imports llama_cpp")
    args = parser.parse_args(argv)
    try:
        return compare(args)
    except UserError as e:
        fail(e)


if __name__ == "__main__":
    sys.exit(main())
