"""
Speculative decoding: a draft proposes k tokens, one forward of the target scores them all through its
KV cache, and Leviathan et al. (2023) / Chen et al. (2023)'s rule keeps a prefix, so the output is
distributed exactly as the target's own samples (and equals its greedy output at temperature 0).

  draft = load_draft("ngram")                    prompt lookup: no second model
  draft = load_draft("out-small", num_draft=2)   a smaller model over the same tokenizer (a run or HF)
  tokens = generate(model, idx, 200, Sampling(temperature=0), draft)

generate.stream knows a draft only as a step that may return several tokens (Draft.step); everything else
about drafts is here: their proposals, the acceptance rule, the roll-back of the cache, their statistics.
"""

import torch
import torch.nn.functional as F

import attention
import generate as decoding  # this module's generate and stream wrap its own
from checkpoint import load_any
from configurator import ConfigError
from quantize import for_inference
from tokenizer import describe_tokenizer, same_tokenizer


def accept_drafts(logits, drafts, q, sampling, generator=None):
    """logits (k+1, vocab): the target's at each draft position and one after; drafts (k,); q (k, vocab):
    the draft's distributions, or None for a draft that proposes with certainty (prompt lookup). Returns
    the new tokens (a list): the accepted drafts, then one token of the target's: at the first rejection,
    drawn from norm(max(0, p - q)); after k acceptances, a bonus drawn from p."""
    drafts = drafts.tolist()
    if sampling.temperature == 0:  # greedy: keep drafts while they are the target's argmax
        best = logits.argmax(dim=-1).tolist()
        n = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
        return drafts[:n] + [best[n]]
    p = sampling.probs(logits)
    for i, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[i, d])
        if float(torch.rand(1, generator=generator, device=p.device)) * q_d < float(p[i, d]):
            continue  # accepted with probability min(1, p(d) / q(d))
        residual = p[i].clone()
        if q is None:
            residual[d] = 0
        else:
            residual = (residual - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p <= q everywhere only when p == q, where d is always accepted
            residual = p[i]
        return drafts[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [int(torch.multinomial(p[-1], 1, generator=generator))]


class Draft:
    """A proposer of num_draft tokens per step (propose), and the step that checks them (step). Counts the
    target forwards that checked a proposal, the proposed and the accepted tokens."""

    default_num_draft = 4

    def __init__(self, num_draft=None):
        self.num_draft = self.default_num_draft if num_draft is None else num_draft
        if self.num_draft < 1:
            raise ConfigError(f"num_draft={self.num_draft} must be >= 1 (tokens the draft proposes per step)")
        self.reset_stats()

    def reset_stats(self):
        self.checks = self.proposed = self.accepted = 0

    def summary(self):
        return (f"speculative decoding: {self.accepted} of {self.proposed} drafted tokens accepted "
                f"({self.accepted / max(1, self.proposed):.0%}), {self.checks} checking forwards")

    def check(self, config, tokenizer=None):
        """A ConfigError when this draft cannot serve a target of this config (and tokenizer)."""
        refuse_caches_that_cannot_rewind(config, "the target")

    def for_inference(self, device, weights_dtype):
        return self

    def step(self, model, seq, length, end, cache, sampling, generator):
        """generate.stream's step: the draft proposes k tokens after seq[:, :length] (fewer near end or
        block_size), one forward of model over the cache scores them and one position more, accept_drafts
        keeps a prefix and adds a token of model's, and the cache rolls back to what was kept. Returns the
        new tokens (1, n), or None where there is nothing to propose (an ordinary step then)."""
        k = min(self.num_draft, end - length - 1, (model.config.context_limit or end) - length)
        if k <= 0:
            return None
        drafts, q = self.propose(seq[:, :length], k, sampling, generator)
        if drafts.size(1) == 0:
            return None
        k = drafts.size(1)
        seq[:, length : length + k] = drafts
        logits = model.forward_cached(seq[:, cache.length : length + k], cache, last=k + 1)[0]
        new = accept_drafts(logits, drafts[0], q, sampling, generator)
        cache.rewind(length + len(new) - 1)  # the rejected drafts' keys and values are dropped
        self.checks, self.proposed, self.accepted = self.checks + 1, self.proposed + k, self.accepted + len(new) - 1
        return torch.tensor([new], dtype=seq.dtype, device=seq.device)


class NgramDraft(Draft):
    """Prompt lookup: proposes the k tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n = max_ngram, then shorter) that has k tokens after it, else the latest occurrence's
    fewer; no second model. Its proposals are certain (q is None)."""

    default_num_draft = 4  # the fastest on the code prompts of docs/benchmarks.md

    def __init__(self, num_draft=None, max_ngram=3):
        super().__init__(num_draft)
        self.max_ngram = max_ngram

    def propose(self, seq, k, sampling, generator):
        s = seq[0]
        for n in range(min(self.max_ngram, len(s) - 1), 0, -1):
            earlier = s[:-1].unfold(0, n, 1)  # every n-gram that ends before the last token
            ends = (earlier == s[-n:]).all(dim=1).nonzero()[:, 0] + n  # where each occurrence's successors begin
            if len(ends):
                whole = ends[ends + k <= len(s)]  # in a run (of spaces, say) the latest occurrence has one successor
                begin = int(whole[-1] if len(whole) else ends[-1])
                return s[begin : begin + k][None], None
        return s[:0][None], None


class ModelDraft(Draft):
    """A smaller GPT over the same vocabulary: samples k tokens (greedy at temperature 0) with its own KV
    cache, which keeps whatever prefix still matches the target's sequence between calls."""

    default_num_draft = 2  # a step checking k tokens costs more than one (docs/benchmarks.md): k = 1-2 paid best

    def __init__(self, model, num_draft=None, tokenizer=None, name=None):
        super().__init__(num_draft)
        self.model, self.tokenizer, self.name = model, tokenizer, name  # name: where it came from, for errors
        self.cache = self.fed = None

    def check(self, config, tokenizer=None):
        super().check(config, tokenizer)
        refuse_caches_that_cannot_rewind(self.model.config, "the draft")
        if tokenizer is not None and self.tokenizer is not None and not same_tokenizer(tokenizer, self.tokenizer):
            whose = f"draft={self.name}: its" if self.name else "the draft's"
            raise ConfigError(f"{whose} tokenizer ({describe_tokenizer(self.tokenizer)}) is not the target's "
                              f"({describe_tokenizer(tokenizer)}); a draft must share the target's tokenizer")
        if self.model.config.vocab_size != config.vocab_size:
            raise ConfigError(f"the draft's vocabulary has {self.model.config.vocab_size} tokens and the target's "
                              f"{config.vocab_size}; a draft must share the target's tokenizer")

    def for_inference(self, device, weights_dtype):
        self.model = for_inference(self.model.to(device=device), weights_dtype)
        return self

    @torch.no_grad()
    def propose(self, seq, k, sampling, generator):
        model, L = self.model, seq.size(1)
        if self.cache is None:
            self.cache = model.new_cache()
            self.fed = seq[:, :0]
        m = min(self.fed.size(1), L - 1)  # keep the cached tokens still in the sequence; feed at least one
        keep = int((self.fed[0, :m] == seq[0, :m]).cumprod(0).sum())
        try:
            self.cache.rewind(keep)
        except ValueError:  # a sliding window has dropped what it would need: start over
            self.cache = model.new_cache()
        seq = torch.cat([seq, seq.new_empty(1, k)], dim=1)
        qs = []
        for length in range(L, L + k):
            logits = decoding.next_logits(model, seq, length, self.cache)
            if sampling.temperature == 0:
                seq[0, length] = logits[0].argmax()
            else:
                qs.append(sampling.probs(logits[0]))
                seq[0, length] = torch.multinomial(qs[-1], 1, generator=generator)[0]
        self.fed = seq[:, : self.cache.length]
        return seq[:, L:], torch.stack(qs) if qs else None


def refuse_caches_that_cannot_rewind(config, whose):
    stuck = [letter for letter, kind in attention.kinds_of(config).items() if not kind.Cache.rewinds]
    if stuck:
        able = ", ".join(letter for letter, kind in attention.KINDS.items() if kind.Cache.rewinds)
        raise ConfigError(f"{whose} has {attention.named(stuck)} layers (attn_pattern={config.attn_pattern!r}), "
                          f"whose cache cannot roll back rejected drafts; speculative decoding needs layers whose "
                          f"cache can ({able})")


def load_draft(spec, num_draft=None):
    """sample.py's and bench.py's --draft: ngram (prompt lookup), or a smaller model: a training run's
    out_dir, a Hugging Face directory or a pretrained name (load_any). Check it against the target with
    draft.check(target.config, target_tokenizer)."""
    if spec == "ngram":
        return NgramDraft(num_draft)
    model, tokenizer, _ = load_any(spec)
    return ModelDraft(model.eval(), num_draft, tokenizer, name=spec)


def stream(model, idx, max_new_tokens, sampling, draft, eos_token_id=None, generator=None):
    """generate.stream for one row with a draft (the same arguments; generator: one, or a list of one)."""
    if idx.size(0) != 1:
        raise ValueError("speculative decoding streams one row with the KV cache; generate() runs a batch row by row")
    draft.check(model.config)
    one = row_generator(generator, 0)

    def step(seq, length, end, cache):
        return draft.step(model, seq, length, end, cache, sampling, one)

    return decoding.stream(model, idx, max_new_tokens, sampling, eos_token_id=eos_token_id, generator=generator, step=step)


def row_generator(generator, i):
    """Row i's generator, from None, one shared torch.Generator or a list of one per row."""
    return generator[i] if isinstance(generator, (list, tuple)) else generator


@torch.no_grad()
def generate(model, idx, max_new_tokens, sampling, draft, eos_token_id=None, generator=None):
    """generate.generate with a draft. Rows run one at a time, each through its own cache, since rows accept
    different numbers of tokens per step; a row that stopped early is padded with eos_token_id."""
    rows = []
    for i in range(idx.size(0)):
        row = idx[i : i + 1]
        rows.append(torch.cat([row, *stream(model, row, max_new_tokens, sampling, draft, eos_token_id,
                                            row_generator(generator, i))], dim=1))
    width = max(row.size(1) for row in rows)
    return torch.cat([F.pad(row, (0, width - row.size(1)), value=eos_token_id or 0) for row in rows])
