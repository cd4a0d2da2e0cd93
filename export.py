"""
Exports a train.py checkpoint as a Hugging Face model directory (config.json + model.safetensors) that
transformers' AutoModelForCausalLM loads: GPT2LMHeadModel for GPT-2-shaped models, LlamaForCausalLM for
Llama-shaped ones. Other architectures are refused with the reason.

  python export.py --out_dir=out-shakespeare-char-cpu --hf_dir=hf-shakespeare
"""

import sys
from dataclasses import dataclass

from checkpoint import CheckpointError, load_model
from configurator import fail, keys_of, parse_or_exit


@dataclass
class ExportConfig:
    out_dir: str = "out"  # the training run whose ckpt.pt to export
    hf_dir: str = "hf-export"  # the Hugging Face directory to write


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    c, _ = parse_or_exit(keys_of(ExportConfig), argv, "python export.py --out_dir=DIR --hf_dir=DIR",
                         __doc__.strip().splitlines()[0])
    try:
        model, state = load_model(c["out_dir"])
        model.save_pretrained(c["hf_dir"])
    except (CheckpointError, ValueError) as e:
        fail(e)
    tokenizer = state["tokenizer"]
    note = ("GPT-2's tokenizer (tiktoken gpt2) applies" if tokenizer == {"kind": "tiktoken", "encoding": "gpt2"}
            else f"its tokenizer ({tokenizer['kind']}) has no Hugging Face file: keep meta.json beside it")
    print(f"wrote {c['hf_dir']} ({model.get_num_params():,} parameters); {note}")


if __name__ == "__main__":
    main()
