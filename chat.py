"""
Talks to a model fine-tuned on conversations (a chat template's tokens: data/prepare.py CHATS.jsonl, then
train.py --init_from=BASE_RUN --dataset=NAME), turn after turn in the terminal, the reply streamed.

  python chat.py --out_dir=out-chat
  python chat.py --out_dir=out-chat --system="Answer in one word." --temperature=0
  python chat.py --out_dir=out-chat --prompt="reverse king"    # one turn: the reply alone on stdout

Typed lines are your turns; /clear starts a new conversation, /exit (or Ctrl-D) ends. The KV cache is kept
from turn to turn, so each turn runs only its new tokens through the model (the reply's, then yours),
and greedy replies equal a fresh run over the whole conversation. When a conversation outgrows the
model's context, its oldest exchanges are dropped (the system turn stays), and chat.py says so; a reply
ends at max_new_tokens or at the context's end.
"""

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from checkpoint import ContextKeys, load_for
from configurator import ConfigError, checked, command_line, keys_of
from device import DEVICES, pick_device
from generate import Sampling, check_max_new_tokens, sample_next
from quantize import WEIGHTS_DTYPES, for_inference, precision_line
from tokenizer import chat_tokenizer, continuation


@dataclass
class ChatConfig(ContextKeys):
    out_dir: str = "out"  # the fine-tuned run's directory (init_from=resume)
    init_from: str = "resume"  # resume (out_dir/ckpt.pt) | a Hugging Face model directory exported from one
    system: str = ""  # the system turn that starts every conversation; "" = none
    prompt: Optional[str] = None  # answer this one turn, print the reply alone on stdout and exit
    max_new_tokens: int = 256  # at most this many tokens per reply (it ends earlier at <|end|>)
    temperature: float = 0.8  # 0 = greedy
    top_k: Optional[int] = 200  # sample among the k most likely tokens only; None = all
    top_p: Optional[float] = None  # sample from the smallest set of tokens whose probability reaches p; None = off
    seed: int = 1337  # the conversation's random stream
    device: str = "auto"  # auto | cpu | cuda | mps
    weights_dtype: str = "auto"  # auto (bf16 on a GPU with bf16, else float32) | float32 | bfloat16 | float16 | int8


CHAT_CHOICES = {"device": DEVICES, "weights_dtype": WEIGHTS_DTYPES, **ContextKeys.CHOICES}


class Conversation:
    """One conversation with a model: its messages, their tokens (the chat template's rendering) and the
    KV cache holding a prefix of them. reply() appends a user turn and streams the assistant's."""

    def __init__(self, model, tokenizer, sampling, seed, system="", device="cpu"):
        self.model, self.tokenizer, self.sampling, self.device = model, chat_tokenizer(tokenizer), sampling, device
        self.system, self.seed = system, seed
        self.clear()

    def clear(self):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids = self.tokenizer.render(self.messages)[0]  # the conversation so far, every turn closed
        self.cache = self.model.new_cache()
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    def fit(self, turn, max_new_tokens, notes):
        """Drops the oldest exchanges (a user turn and what follows it; the system turn stays) until the
        conversation, this turn and room for its reply fit in the model's context (room: max_new_tokens,
        or half the context if that is less); the cache then starts over. Returns the most tokens the
        reply can have there (it ends at the context's end, as a reply that runs out of max_new_tokens)."""
        limit = self.model.config.context_limit
        if limit is None:
            return max_new_tokens
        room = min(max_new_tokens, limit // 2)
        dropped = 0
        while len(self.ids) + len(turn) + room > limit + 1:  # (the reply's last token is never an input)
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            users = [i for i, m in enumerate(self.messages) if m["role"] == "user" and i >= first]
            if len(self.messages) == first:
                raise ConfigError(f"this turn ({len(turn)} tokens) and room for a reply do not fit in the model's "
                                  f"context of {limit} tokens; shorten it")
            del self.messages[first : users[1] if len(users) > 1 else len(self.messages)]
            self.ids = self.tokenizer.render(self.messages)[0]
            dropped += 1
        if dropped:
            notes(f"note: the conversation outgrew the context of {limit} tokens; dropped its {dropped} oldest exchange(s)")
            self.cache = self.model.new_cache()
        return min(max_new_tokens, limit + 1 - len(self.ids) - len(turn))

    @torch.no_grad()
    def reply(self, text, max_new_tokens, write=lambda s: None, notes=lambda s: None):
        """The assistant's reply to the user's text, written as it arrives; the turn is then part of the
        conversation (closed with <|end|> also when it ran out of max_new_tokens or began another turn). The conversation's
        tokens are the ones the model saw and sampled, so the next turn's prefix is the cache's."""
        turn = self.tokenizer.render([{"role": "user", "content": text}], add_generation_prompt=True)[0]
        max_new_tokens = self.fit(turn, max_new_tokens, notes)
        self.messages.append({"role": "user", "content": text})
        prompt = self.ids + turn
        new = prompt[self.cache.length :]  # what the cache has not seen: this turn (and the last reply's end)
        out, shown, token = [], "", None
        while len(out) < max_new_tokens:
            logits = self.model.forward_cached(torch.tensor([new], device=self.device), self.cache)[:, -1]
            token = int(sample_next(logits.float(), self.sampling, self.generator))
            if token in self.tokenizer.names:  # <|end|>, or a turn's start: the reply is over either way
                break
            out.append(token)
            new = [token]
            so_far = continuation(self.tokenizer, prompt[-1:], out)  # after <|assistant|>: the reply's own text
            if not so_far.endswith("\ufffd") and len(so_far) > len(shown):
                write(so_far[len(shown) :])
                shown = so_far
        reply = continuation(self.tokenizer, prompt[-1:], out)
        write(reply[len(shown) :])
        self.messages.append({"role": "assistant", "content": reply})
        self.ids = prompt + out + [self.tokenizer.end_token]  # the cache holds all but the last one or two
        return reply


def load_chat(c):
    checked(check_max_new_tokens, c.max_new_tokens)
    sampling = checked(Sampling, c.temperature, c.top_k, c.top_p)
    device = pick_device(c.device)
    model, tokenizer, _ = load_for(c)
    if model.config.family != "decoder":
        raise ConfigError(f"chat.py talks with a decoder fine-tuned on conversations; this model is family={model.config.family!r}")
    chat_tokenizer(tokenizer)  # a base model: refused before its weights are converted
    model = checked(for_inference, model.to(device=device), c.weights_dtype)
    print(precision_line(c.weights_dtype, device), file=sys.stderr)
    return Conversation(model, tokenizer, sampling, c.seed, c.system, device), device


def chat(c):
    conversation, _ = load_chat(c)
    notes = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if c.prompt is not None:
        print(conversation.reply(c.prompt, c.max_new_tokens, notes=notes))
        return
    print("chat: type a message; /clear starts over, /exit ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/clear":
            conversation.clear()
            print("(a new conversation)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        conversation.reply(line, c.max_new_tokens, lambda s: print(s, end="", flush=True), notes)
        print()


main = command_line(ChatConfig, "python chat.py [config_file ...] [--key=value ...]",
                    __doc__.strip().splitlines()[0], chat,
                    keys_of(ChatConfig, CHAT_CHOICES, base=ContextKeys))


if __name__ == "__main__":
    main()
