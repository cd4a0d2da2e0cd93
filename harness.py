"""
lm-evaluation-harness over our GPT: an lm_eval LM whose three request types score exactly what lm-eval's
own Hugging Face backend (`--model hf`) scores for the same weights, so task numbers compare with any
published hf-backend figure. eval.py imports this file only for --tasks (lm_eval is an optional extra:
pip install -r requirements-eval.txt).

The rules we follow are the hf backend's, request by request:
- loglikelihood: lm-eval's TemplateLM splits context and continuation (trailing spaces of the context move
  to the continuation; an empty context becomes the prefix token). The input is context + continuation
  minus its last token, cut from the left to block_size; the continuation's tokens are scored at the last
  len(continuation) positions, and is_greedy says whether each was the argmax.
- loglikelihood_rolling: lm-eval's disjoint rolling windows of block_size, the first conditioned on the
  prefix token, summed.
- generate_until: the context cut from the left to block_size - max_gen_toks, greedy (or sampled, with
  do_sample) through generate.stream with the KV cache, stopped at the first stop string or the
  end-of-text token, and cut at the first stop string.
"""

import difflib
import functools
import os

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.evaluator import simple_evaluate
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table

from configurator import ConfigError, checked
from generate import Sampling, stream


class GPTHarness(TemplateLM):
    """model: our GPT (eval mode, on device); tokenizer: one of dataset.py's; context: the autocast
    context the forward passes run in."""

    def __init__(self, model, tokenizer, device, batch_size, context):
        super().__init__()
        self.model, self.tokenizer, self._device = model, tokenizer, device
        self._batch_size, self.context = batch_size, context
        self.max_length = model.config.block_size

    @property
    def device(self):
        return self._device

    # The tokenizer, as lm-eval asks for it

    @property
    def eot_token_id(self):
        return self.tokenizer.eot_token

    @property
    def prefix_token_id(self):
        """What an empty context is conditioned on: the end-of-text token (as the hf backend uses for
        GPT-2). A character vocabulary has none; its newline, which separates documents in its training
        text, stands in."""
        if self.tokenizer.eot_token is not None:
            return self.tokenizer.eot_token
        newline = getattr(self.tokenizer, "stoi", {}).get("\n")
        if newline is None:
            raise ConfigError("a request with an empty context needs an end-of-text or newline token to condition "
                             "on, and this tokenizer has neither")
        return newline

    def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
        ids = self.tokenizer.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids):
        return self.tokenizer.decode(ids)

    # Scoring

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
        """requests: (key, context ids, continuation ids) -> (sum of log p, is_greedy) each, in order.
        Longest first, so a batch pads little and an out-of-memory error comes at once."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results = [None] * len(requests)
        for at in range(0, len(order), self._batch_size):
            batch = order[at : at + self._batch_size]
            inputs, continuations = [], []
            for i in batch:
                _, context, cont = requests[i]
                if not context or not cont or len(cont) > self.max_length:
                    raise ConfigError(f"request {i}: {len(context)} context and {len(cont)} continuation tokens; "
                                     f"both must be non-empty and the continuation at most block_size={self.max_length}")
                inputs.append((context + cont)[-(self.max_length + 1) :][:-1])
                continuations.append(cont)
            x = torch.zeros(len(batch), max(map(len, inputs)), dtype=torch.long)
            for row, ids in enumerate(inputs):
                x[row, : len(ids)] = torch.tensor(ids)  # right padding: causal attention never sees it
            with self.context:
                logits, _ = self.model(x.to(self._device))
            for row, (i, ids, cont) in enumerate(zip(batch, inputs, continuations)):
                logp = F.log_softmax(logits[row, len(ids) - len(cont) : len(ids)].float(), dim=-1)
                target = torch.tensor(cont, device=logp.device)
                greedy = bool((logp.argmax(dim=-1) == target).all())
                results[i] = (float(logp.gather(1, target[:, None]).sum()), greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        windows, owner = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            ids = self.tok_encode(text)
            for context, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=ids, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logp
        return totals

    # Generation

    def generate_until(self, requests, disable_tqdm=False):
        """One request at a time: rows of a batch would need padding the hf backend's left-padded batch
        does not match bit for bit, and the harness's generative tasks are small."""
        eos = None if self.eot_token_id is None else self.tok_decode([self.eot_token_id])
        return [self.generate_one(context, gen_kwargs, eos) for context, gen_kwargs in (r.args for r in requests)]

    @torch.no_grad()
    def generate_one(self, context, gen_kwargs, eos):
        kwargs = normalize_gen_kwargs(dict(gen_kwargs), 256)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_gen_toks = kwargs.pop("max_gen_toks")
        if max_gen_toks >= self.max_length:
            raise ConfigError(f"max_gen_toks={max_gen_toks} leaves no room for a context in block_size={self.max_length}")
        temperature = kwargs.get("temperature", 0.0) if kwargs.get("do_sample") else 0.0
        ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen_toks) or [self.prefix_token_id]
        new = []
        with self.context:
            sampling = checked(Sampling, temperature, kwargs.get("top_k"), kwargs.get("top_p"))
            for column in stream(self.model, torch.tensor([ids], device=self._device), max_gen_toks, sampling,
                                            eos_token_id=self.eot_token_id):
                token = int(column[0, 0])
                if token == self.eot_token_id:
                    break
                new.append(token)
                text = self.tok_decode(new)
                if any(stop and stop in text for stop in until):
                    break
        text = self.tok_decode(new)
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


def local_tasks(include_path, tasks):
    """An index of include_path's tasks alone, when every name asked for is a single task there (a group
    might name lm-eval's own tasks); else None."""
    if not include_path:
        return None
    manager = TaskManager(include_path=include_path, include_defaults=False)
    return manager if all(t in manager.all_subtasks for t in tasks) else None


@functools.lru_cache(maxsize=4)
def task_index(include_path=None):
    """lm-eval's index of its own tasks and include_path's: 6-17 s to build (thousands of YAML files), so a
    process builds it once per include_path (a YAML file added to that folder later is not seen)."""
    return TaskManager(include_path=include_path)


def run_tasks(lm, tasks, limit=None, num_fewshot=None, include_path=None, log_samples=False, task_manager=None):
    """lm-eval's simple_evaluate over our LM -> {"results", "n-shot", "versions", "table"} (and "samples",
    per request, with log_samples). Errors are ConfigErrors with one line for the user. task_manager:
    lm-eval's index of tasks; by default include_path's own (a fraction of a second) when it holds every
    task asked for, else task_index's, with lm-eval's tasks too."""
    manager = (task_manager or local_tasks(include_path, tasks)
               or task_index(os.path.abspath(include_path) if include_path else None))  # (the same folder after a chdir)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        close = {t: difflib.get_close_matches(t, manager.all_tasks, n=3) for t in unknown}
        hints = "; ".join(f"{t}: did you mean {', '.join(m)}?" for t, m in close.items() if m)
        raise ConfigError(f"unknown task(s) {', '.join(unknown)}" + (f" ({hints})" if hints else "")
                          + "; `lm-eval ls tasks` lists them, and --include_path adds a folder of your own YAML tasks")
    try:
        out = simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                              log_samples=log_samples, verbosity="ERROR")
    except ConnectionError as e:  # datasets cannot reach the Hub and has no cached copy
        raise ConfigError(f"the data of task(s) {', '.join(tasks)} could not be downloaded ({e}); offline, write the "
                          "task as a YAML file with local data files and pass its folder with --include_path") from None
    keep = {key: out[key] for key in ("results", "n-shot", "versions") if key in out}
    if log_samples:
        keep["samples"] = out["samples"]
    return {**keep, "table": make_table(out)}
