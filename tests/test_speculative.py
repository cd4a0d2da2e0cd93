"""speculative.py: greedy output token-identical to plain greedy, sampled output distributed as the target's."""

import itertools
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

import speculative
from conftest import ROOT, TINY_RUN, run_main
from generate import Sampling
from model import GPT, GPTConfig
from speculative import ModelDraft, NgramDraft

GREEDY = Sampling(temperature=0)


def tiny(seed, vocab=13, block_size=24, scale=1.0, **overrides):
    """A random GPT; scale multiplies its matrices (GPT-2's small init makes a random model repeat one token)."""
    torch.manual_seed(seed)
    config = dict(vocab_size=vocab, block_size=block_size, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    model = GPT(GPTConfig(**{**config, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale if p.dim() > 1 else 1.0)
    return model


def first_layer_of(target, block_size=16):
    """A draft that agrees with its target often, not always: the target's first block, embeddings and head."""
    draft = GPT(GPTConfig(**{**vars(target.config), "n_layer": 1, "block_size": block_size})).eval()
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("blocks.1.")}
    if "positions.wpe.weight" in state:
        state["positions.wpe.weight"] = state["positions.wpe.weight"][:block_size]
    draft.load_state_dict(state, strict=False)
    return draft


def plain(target, prompt, n):
    return target.generate(prompt, n, GREEDY).tolist()


@pytest.mark.parametrize("pos_emb", ["learned", "rope", "sinusoidal", "alibi", "none"])
def test_greedy_speculation_is_token_identical_to_greedy_generate(pos_emb):
    """Random weights, GQA, every position scheme; past block_size (24 positions, 10 + 40 tokens); k = 1..8,
    with a model draft and with prompt lookup; the drafts are both accepted and rejected."""
    target = tiny(0, pos_emb=pos_emb, scale=10.0)
    drafts = {"model": lambda k: ModelDraft(first_layer_of(target), k), "ngram": NgramDraft}
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    expected = plain(target, prompt, 40)
    accepted = proposed = 0
    for (name, make), k in itertools.product(drafts.items(), (1, 2, 4, 8)):
        draft = make(k)
        assert speculative.generate(target, prompt, 40, GREEDY, draft).tolist() == expected, (name, k)
        accepted, proposed = accepted + draft.accepted, proposed + draft.proposed
    assert 0 < accepted < proposed, (accepted, proposed)  # drafts kept, and drafts rolled back


@pytest.fixture(scope="module")
def draft_run(tmp_path_factory, char_dataset):
    """A one-layer model trained on the conftest's trained_run's text: a draft for it."""
    import train

    out = tmp_path_factory.mktemp("draft")
    train.main([*TINY_RUN, "--n_layer=1", f"--dataset={char_dataset}", f"--out_dir={out}", "--max_iters=30",
                "--eval_interval=30"])
    return str(out)


def test_greedy_speculation_with_a_trained_pair(trained_run, draft_run):
    """The conftest's trained char model as target, draft_run as its draft."""
    from checkpoint import load_model

    target, draft_model = load_model(trained_run)[0].eval(), load_model(draft_run)[0].eval()
    prompt = torch.tensor([[5, 6, 7, 1]])
    expected = plain(target, prompt, 60)
    accepted = 0
    for k in (1, 2, 4, 8):
        draft = ModelDraft(draft_model, k)
        assert speculative.generate(target, prompt, 60, GREEDY, draft).tolist() == expected
        assert speculative.generate(target, prompt, 60, GREEDY, NgramDraft(k)).tolist() == expected
        accepted += draft.accepted
    assert accepted > 0


def test_a_batch_runs_row_by_row_and_stops_at_eos():
    target = tiny(0)
    prompts = torch.tensor([[3, 1, 4], [2, 7, 1], [9, 9, 9]])
    eos = plain(target, prompts[:1], 6)[0][-1]  # row 0 emits it: that row ends early, the others are padded
    expected = target.generate(prompts, 20, GREEDY, eos_token_id=eos)
    assert torch.equal(speculative.generate(target, prompts, 20, GREEDY, NgramDraft(), eos_token_id=eos), expected)


def test_bad_drafts_are_refused():
    target = tiny(0)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="the draft's vocabulary has 17 tokens and the target's 13"):
        speculative.generate(target, prompt, 5, Sampling(), ModelDraft(tiny(1, vocab=17)))
    with pytest.raises(ValueError, match="num_draft=0 must be >= 1"):
        NgramDraft(num_draft=0)
    with pytest.raises(ValueError, match="num_draft=-1 must be >= 1"):
        ModelDraft(tiny(1), num_draft=-1)
    with pytest.raises(ValueError, match="speculative decoding streams one row"):
        next(speculative.stream(target, torch.tensor([[1], [2]]), 5, Sampling(), NgramDraft()))


# ----------------------------------------------------------------------------------------------------
# Sampling: the distribution of the first and the fifth new token over many seeded runs


VOCAB, PROMPT = 4, [0, 1]
# How many seeded runs a chi-square test needs: enough that a deviation of Cohen's effect size w = 0.1 (a
# "small" effect: sqrt(sum (p_wrong - p)^2 / p) = 0.1) fails the test at the 1e-3 level with probability
# 0.99 (power from the noncentral chi-square). A rule that is right fails it with probability 1e-3 per
# p-value, whatever the count; the seeds are fixed, so a given tree passes or fails every time.
ALPHA, POWER, SMALL_EFFECT = 1e-3, 0.99, 0.1


def small(seed):
    return tiny(seed, vocab=VOCAB, block_size=16, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, scale=8.0)


def exact_distributions(target, positions=(1, 5), temperature=1.0):
    """The target's exact distribution of its n-th new token, summed over every prefix of earlier tokens."""
    out = {}
    for n in positions:
        prefixes = torch.tensor([PROMPT + list(p) for p in itertools.product(range(VOCAB), repeat=n - 1)])
        logits = target(prefixes)[0] / temperature
        logp = torch.log_softmax(logits.double(), dim=-1)
        steps = logp[:, len(PROMPT) - 1 : -1].gather(2, prefixes[:, len(PROMPT) :, None])[..., 0].sum(1)  # log P(prefix)
        out[n] = (steps[:, None].exp() * logp[:, -1].exp()).sum(0)
    return out


def chi_square_sf(stat, df):
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square_p(counts, probs):
    expected = probs * counts.sum()
    return chi_square_sf(float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1)


def runs_for_power(effect, df, alpha=ALPHA, power=POWER):
    """The fewest runs n at which a true effect size `effect` gives p < alpha with probability >= power:
    the statistic is then noncentral chi-square with noncentrality n * effect^2 (Cohen 1988, ch. 7),
    whose tail is a Poisson(lambda/2) mixture of central chi-square tails."""
    lo, hi = 0.0, 1e3  # the critical value: chi_square_sf(critical, df) = alpha
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_sf(mid, df) > alpha else (lo, mid)
    critical = hi

    def power_at(n):
        half = n * effect**2 / 2
        return sum(math.exp(j * math.log(half) - half - math.lgamma(j + 1)) * chi_square_sf(critical, df + 2 * j)
                   for j in range(int(half + 10 * math.sqrt(half) + 50)))

    lo, hi = 1, 2  # power_at(lo) < power <= power_at(hi), then bisection
    while power_at(hi) < power:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if power_at(mid) < power else (lo, mid)
    return hi


def test_runs_for_power_matches_cohens_tables():
    """Cohen (1988), Table 7.4.6: power 0.80 at alpha 0.05 needs noncentrality 7.85 at df 1 and 10.90 at
    df 3, so n = 7.85 / 0.3^2 = 87.2 and 10.90 / 0.09 = 121.1 runs for w = 0.3."""
    assert runs_for_power(0.3, 1, alpha=0.05, power=0.80) == 88
    assert runs_for_power(0.3, 3, alpha=0.05, power=0.80) == 122


def accept_every_draft(logits, drafts, q, sampling, generator=None):
    p = sampling.probs(logits)
    return drafts.tolist() + [int(torch.multinomial(p[-1], 1, generator=generator))]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: threads only add overhead
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["leviathan", "broken"])
def test_sampled_tokens_follow_the_targets_exact_distribution(monkeypatch, one_thread, rule):
    target, draft = small(0), ModelDraft(small(1), num_draft=3)
    with torch.no_grad():
        exact = exact_distributions(target)
        drafted = torch.softmax(draft.model(torch.tensor([PROMPT]))[0][0, -1].double(), -1)
    assert (exact[1] - drafted).abs().sum() > 0.3  # the draft's first-token distribution is far from the target's
    if rule == "broken":
        monkeypatch.setattr(speculative, "accept_drafts", accept_every_draft)
    effect = float(((drafted - exact[1]) ** 2 / exact[1]).sum().sqrt())  # the broken rule's first token: the draft's
    runs = runs_for_power(SMALL_EFFECT if rule == "leviathan" else effect, VOCAB - 1)  # 3,794 and 76
    counts = {n: torch.zeros(VOCAB, dtype=torch.float64) for n in exact}
    prompt = torch.tensor([PROMPT])
    for seed in range(runs):
        out = speculative.generate(target, prompt, 5, Sampling(temperature=1.0), draft,
                                   generator=torch.Generator().manual_seed(seed))[0, len(PROMPT) :]
        for n in counts:
            counts[n][out[n - 1]] += 1
    p_values = {n: chi_square_p(counts[n], exact[n]) for n in counts}
    print(rule, runs, "runs, chi-square p-values (first, fifth token):", p_values, "acceptance", draft.accepted / draft.proposed)
    if rule == "leviathan":
        assert min(p_values.values()) > 1e-3, p_values
    else:
        assert p_values[1] < 1e-3, p_values  # the test can fail: accepting every draft gives the draft's tokens


def test_a_certain_proposal_keeps_the_targets_distribution():
    """Prompt lookup's proposals have no q: accepted with probability p(d), else a token drawn from p
    without d. The first returned token is then distributed as p (and a broken rule, never rejecting, is not)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 2
    p = torch.softmax(logits[0].double(), -1)
    drafted = int(p.argmin())  # an unlikely proposal: mostly rejected
    counts = {rule: torch.zeros(6, dtype=torch.float64) for rule in ("leviathan", "broken")}
    for seed in range(runs_for_power(SMALL_EFFECT, len(p) - 1)):
        generator = torch.Generator().manual_seed(seed)
        counts["leviathan"][speculative.accept_drafts(logits, torch.tensor([drafted]), None, Sampling(), generator)[0]] += 1
        counts["broken"][accept_every_draft(logits, torch.tensor([drafted]), None, Sampling(), generator)[0]] += 1
    assert chi_square_p(counts["leviathan"], p) > 1e-3 and chi_square_p(counts["broken"], p) < 1e-3


# ----------------------------------------------------------------------------------------------------
# sample.py --draft


def greedy(*args):
    result = run_main("sample.py", *args, "--start=The ", "--num_samples=2", "--temperature=0", "--max_new_tokens=50",
                        "--device=cpu")
    assert result.returncode == 0, result.stderr
    return result


def test_sample_py_speculates_to_the_same_text(trained_run, draft_run):
    plain_text = greedy(f"--out_dir={trained_run}").stdout
    for draft in ("ngram", draft_run):
        result = greedy(f"--out_dir={trained_run}", f"--draft={draft}", "--num_draft=3")
        assert result.stdout == plain_text and "speculative decoding:" in result.stderr
    streamed = run_main("sample.py", f"--out_dir={trained_run}", f"--draft={draft_run}", "--start=The ", "--stream=True",
                          "--num_samples=1", "--temperature=0", "--max_new_tokens=50", "--device=cpu")
    assert streamed.returncode == 0 and streamed.stdout.strip() == plain_text.split("\n---------------\n")[0].strip()


def test_sample_py_refuses_a_draft_with_another_tokenizer(tmp_path, trained_run):
    import train
    from conftest import make_text
    from dataset import prepare_text
    from tokenizer import char_tokenizer_for

    text = make_text(5000, seed=3).upper()
    prepare_text(text, char_tokenizer_for(text), str(tmp_path / "upper"))
    train.main([*TINY_RUN, f"--dataset={tmp_path / 'upper'}", f"--out_dir={tmp_path / 'other'}", "--max_iters=2"])
    cases = [([f"--draft={tmp_path / 'other'}"], f"draft={tmp_path / 'other'}: its tokenizer ("),
             (["--draft=ngram", "--num_draft=0"], "num_draft=0 must be >= 1")]
    for args, message in cases:
        result = run_main("sample.py", f"--out_dir={trained_run}", *args, "--device=cpu")
        assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    refused = run_main("sample.py", f"--out_dir={trained_run}", *cases[0][0]).stderr
    assert "its tokenizer (30 characters '\\n !,.;?AB" in refused and "is not the target's (48 characters '\\n" in refused


@pytest.mark.slow
def test_an_interrupted_sample_prints_nothing_half_way(trained_run):
    # a shell's background job (as a CI runner may start pytest) ignores SIGINT, and Python keeps an ignored
    # SIGINT ignored: give the child the terminal's default, which Python turns into KeyboardInterrupt
    proc = subprocess.Popen([sys.executable, "sample.py", f"--out_dir={trained_run}", "--draft=ngram", "--device=cpu",
                             "--max_new_tokens=1000000", "--num_samples=2"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stderr.readline().startswith("precision:")  # generation has begun
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()  # never leave a million-token sample running after a failure
    assert proc.returncode == 128 + signal.SIGINT and out == ""
    assert err.strip() == "error: interrupted; nothing printed"


def test_bench_speculative_tokens_match_ours_and_transformers(trained_run, draft_run, tmp_path):
    """bench.py sample --draft: every contender (ours plain and speculative, transformers plain and assisted
    with the same draft weights, or prompt lookup) produces our plain greedy tokens."""
    pytest.importorskip("transformers")
    import bench
    from conftest import make_text

    prompt = tmp_path / "prompt.txt"
    prompt.write_text(make_text(400, seed=5))
    for draft in (draft_run, "ngram"):
        results = bench.main(["sample", f"--out_dir={trained_run}", f"--draft={draft}", "--num_draft=3", "--compare=hf",
                              "--prompt_len=10", "--new_tokens=20", "--rounds=5", "--warmup=1", "--device=cpu",
                              f"--prompt_file={prompt}"])["sample"]
        assert results["same_tokens_as_our_plain_decode"] == {"ours_speculative": True, "hf": True, "hf_assisted": True}
        assert 0 <= results["acceptance_rate"] <= 1 and results["target_forwards_per_token"] <= 1
        assert results["speculative_vs_hf_assisted"] > 0
