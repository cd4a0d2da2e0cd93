"""
Exports a train.py checkpoint as a Hugging Face model directory that transformers loads:
config.json + model.safetensors (AutoModelForCausalLM) and the tokenizer (AutoTokenizer; sample.py
--init_from=DIR reads it too).

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

from dataclasses import dataclass

from checkpoint import load_any
from configurator import ConfigError, cli_main, parse_config
from dataset import tokenizer_from_meta
from hf import save_tokenizer


@dataclass
class ExportConfig:
    out_dir: str = "out"  # the training run whose ckpt.pt to export
    hf_dir: str = "hf-export"  # the Hugging Face directory to write


def main(argv=None):
    def command(argv):
        c, _ = parse_config(ExportConfig, argv, "python export.py --out_dir=DIR --hf_dir=DIR",
                            __doc__.strip().splitlines()[0])
        model, _, state = load_any(c.out_dir)
        if state is None:
            raise ConfigError(f"out_dir={c.out_dir} is a Hugging Face model already; export takes a training run's out_dir")
        tokenizer_from_meta(state["tokenizer"])  # a tokenizer that cannot load (tiktoken offline) stops it here, before any file
        model.save_pretrained(c.hf_dir)
        note = save_tokenizer(state["tokenizer"], c.hf_dir, model.config.block_size)
        print(f"wrote {c.hf_dir} ({model.get_num_params():,} parameters); {note}")

    cli_main(command, argv)


if __name__ == "__main__":
    main()
