"""
Exports a train.py checkpoint as a Hugging Face model directory that transformers loads:
config.json + model.safetensors (AutoModelForCausalLM) and the tokenizer (AutoTokenizer; sample.py
--init_from=DIR reads it too). Or, with --gguf=FILE.gguf, as one GGUF file that llama.cpp (Ollama, LM
Studio) runs: --gguf_type=f32|f16|bf16|q8_0 (gguf_file.py says which shapes and tokenizers it carries).

Only architectures transformers has can be exported (docs/guide.md: Hugging Face weights): GPT-2-shaped
configs as GPT2LMHeadModel, Llama-shaped ones (pos_emb=rope, norm=rmsnorm, mlp=swiglu, bias=False) as
LlamaForCausalLM, and their Mistral (sliding windows), Qwen3 (QK-norm) and Arcee (mlp=relu2, the Quick
start's) variants. Anything else is refused in one line that names the keys to change.

GPT-2 BPE models get tokenizer.json, vocab.json and merges.txt that encode exactly as tiktoken's gpt2;
character models a tokenizer.json over their characters, with [UNK] for any other when the model has a
padding row (--vocab_size above the characters). A model fine-tuned on conversations also gets its chat
template (Jinja, in tokenizer_config.json) and the template's tokens as special tokens at our ids, with
<|end|> as the end of sequence: transformers' apply_chat_template(messages, add_generation_prompt=True)
gives our prompt ids, and its generate() stops where our replies do.
"""

import os
from dataclasses import dataclass

from checkpoint import load_any
from configurator import ConfigError, cli_main, parse_config
from gguf_file import FTYPES, arch_of, gguf_vocab, write_gguf
from hf import hf_family, save_tokenizer
from hf_encoders import save_image_processor
from tokenizer import tokenizer_from_meta


@dataclass
class ExportConfig:
    out_dir: str = "out"  # the training run whose ckpt.pt to export
    hf_dir: str = "hf-export"  # the Hugging Face directory to write
    overwrite: bool = False  # hf_dir holds files already: False refuses, True replaces the files an export writes
    gguf: str = ""  # write this GGUF file (llama.cpp) instead of hf_dir; "" = the Hugging Face directory
    gguf_type: str = "f32"  # the GGUF's weights: f32 | f16 | bf16 | q8_0 (norms and biases stay f32)


# what an export writes (hf.save_pretrained, hf.save_tokenizer): replaced together with overwrite=True, so
# no file of an earlier export (a chat template, GPT-2's merges) outlives it beside the new one
EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def check_target(hf_dir, overwrite):
    """Refuses an hf_dir that is a file, or a folder with files in it unless overwrite; with overwrite,
    removes an earlier export's files there (the folder's other files stay)."""
    if os.path.exists(hf_dir) and not os.path.isdir(hf_dir):
        raise ConfigError(f"hf_dir={hf_dir} is a file; give a folder to write the export into")
    held = sorted(os.listdir(hf_dir)) if os.path.isdir(hf_dir) else []
    if held and not overwrite:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise ConfigError(f"hf_dir={hf_dir} is not empty (it holds {shown}): --overwrite=True replaces an export "
                          "there, or give another --hf_dir")
    for name in EXPORT_FILES:
        if name in held:
            os.remove(os.path.join(hf_dir, name))


def export_gguf(c, model, state):
    """The GGUF file, written whole beside its name and then renamed: a refusal or a failure leaves nothing."""
    if c.gguf_type not in FTYPES:
        raise ConfigError(f"gguf_type={c.gguf_type!r}: use one of {', '.join(FTYPES)}")
    if os.path.isdir(c.gguf):
        raise ConfigError(f"gguf={c.gguf} is a folder; give the file to write, e.g. --gguf=model.gguf")
    folder = os.path.dirname(os.path.abspath(c.gguf))
    if not os.path.isdir(folder):
        raise ConfigError(f"gguf={c.gguf}: the folder {folder} does not exist; create it or give another path")
    if os.path.exists(c.gguf) and not c.overwrite:
        raise ConfigError(f"gguf={c.gguf} exists: --overwrite=True replaces it, or give another --gguf")
    arch_of(model.config)  # a shape or tokenizer llama.cpp cannot run stops here, before any file
    special = gguf_vocab(state["tokenizer"], model.config.vocab_size)[3]
    partial = f"{c.gguf}.partial"
    try:
        arch = write_gguf(model, state["tokenizer"], partial, c.gguf_type)
        os.replace(partial, c.gguf)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    size = os.path.getsize(c.gguf) / 2**20
    print(f"wrote {c.gguf} ({arch}, {c.gguf_type}, {model.get_num_params():,} parameters, {size:.1f} MB): "
          f"llama-cli -m {c.gguf}, or Ollama with FROM ./{os.path.basename(c.gguf)} in a Modelfile")
    if "eos" not in special:
        print("note: this vocabulary has no end-of-text token, and llama.cpp then ends text at id 11 (a character "
              "here): run it with --ignore-eos (a model trained with --vocab_size above its characters has one)")


def main(argv=None):
    def command(argv):
        c, explicit = parse_config(ExportConfig, argv, "python export.py --out_dir=DIR (--hf_dir=DIR | --gguf=FILE.gguf) "
                            "[--overwrite=True]", __doc__.strip().splitlines()[0])
        model, _, state = load_any(c.out_dir)
        if state is None:
            raise ConfigError(f"out_dir={c.out_dir} is a Hugging Face model already; export takes a training run's out_dir")
        tokenizer_from_meta(state["tokenizer"])  # a tokenizer that cannot load (tiktoken offline) stops it here, before any file
        if c.gguf:
            if "hf_dir" in explicit:
                raise ConfigError("give --gguf or --hf_dir, not both: an export writes one of them (a GGUF file or a Hugging Face folder)")
            return export_gguf(c, model, state)
        hf_family(model.config)  # so does a shape transformers has no class for
        check_target(c.hf_dir, c.overwrite)
        model.save_pretrained(c.hf_dir)
        if state["tokenizer"].get("kind") == "images":  # a vision transformer: its image processor instead
            note = save_image_processor(state["tokenizer"], c.hf_dir)
        else:
            note = save_tokenizer(state["tokenizer"], c.hf_dir, model.config.block_size)
        print(f"wrote {c.hf_dir} ({model.get_num_params():,} parameters); {note}")

    cli_main(command, argv)


if __name__ == "__main__":
    main()
