"""engine.py: continuous batching without HTTP. Rows at their own lengths decode each as alone, a prompt's
chunk rides the rows' pass, each row samples as it would alone, and a job's text is greedy's alone."""

import pytest
import torch

from checkpoint import load_any
from conftest import build
from engine import RIDE_MIN, Engine, Job, sample_rows
from generate import BatchRows, DynamicRows, Sampling, row_batch, sample_next


def test_rows_sample_as_each_would_alone():
    """sample_rows draws row i with its own Sampling and generator exactly as sample_next draws it alone,
    though rows sharing a setting are drawn in one call."""
    logits = torch.randn(5, 61, generator=torch.Generator().manual_seed(0))
    samplings = [Sampling(temperature=0), Sampling(temperature=1.0, top_k=5), Sampling(temperature=0.7, top_p=0.9),
                 Sampling(temperature=1.0, top_k=5), Sampling(temperature=0)]
    for seed in range(20):
        together = sample_rows(logits, samplings, [torch.Generator().manual_seed(seed + i) for i in range(5)])
        alone = [sample_next(logits[i : i + 1], s, [torch.Generator().manual_seed(seed + i)]).item()
                 for i, s in enumerate(samplings)]
        assert together.tolist() == alone


def test_the_engine_imports_no_http_package():
    """engine.py stands below serve.py: no module it imports, itself or through others, imports an HTTP package
    (the imports read from the code, lazy ones included, as tools/imports.py reads them)."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "tools"))
    import imports

    edges, files = imports.graph(), imports.modules()
    reached, todo = set(), ["engine"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += edges[name]
    assert "serve" not in reached and "generate" in reached
    http = {name: imports.imported_names(f) & {"fastapi", "uvicorn", "starlette", "http"} for name in reached for f in files[name]}
    assert not any(http.values()), http


@pytest.mark.parametrize("case", [{}, dict(pos_emb="alibi"), dict(pos_emb="rope", attn_pattern="RS", attn_window=5),
                                  "no static step"], ids=["learned", "alibi", "linear and window", "decode_rows"])
def test_a_batch_of_rows_at_their_own_lengths_decodes_each_as_alone(case):
    """row_batch (a server's batch): rows of different lengths join, step together and leave (the
    last row moving into the freed place); every step's logits of each row are its own cache's, alone."""
    import attention

    class Plain(attention.LinearAttention):  # no StaticCache: DynamicRows, decode_rows row by row
        letter, description = "Q", "a test's linear attention without a static step"

    if case == "no static step":
        attention.register(Plain)
        case = dict(pos_emb="rope", attn_pattern="Q")
    try:
        model = build(**case)
        batch = row_batch(model, max_rows=4)
        assert isinstance(batch, DynamicRows if "Q" in case.get("attn_pattern", "") else BatchRows)
        g = torch.Generator().manual_seed(0)
        rows, worst, done = [], 0.0, 0
        with torch.no_grad():
            for n, steps in ((3, 6), (9, 14), (5, 4), (12, 9)):  # (prompt length, steps): they leave in turn
                prompt = torch.randint(0, 61, (1, n), generator=g)
                cache, alone = model.new_cache(), model.new_cache()
                model.forward_cached(prompt, cache), model.forward_cached(prompt, alone)
                batch.add(cache)
                rows.append(dict(alone=alone, length=n, steps=steps))
                if len(rows) == 2:  # one step before the last two join
                    worst = max(worst, step_rows(model, batch, rows, g))
            while rows:
                worst = max(worst, step_rows(model, batch, rows, g))
                for j in reversed(range(len(rows))):
                    if rows[j]["steps"] == 0:
                        done += 1
                        batch.remove(j)
                        last = rows.pop()
                        if j < len(rows):
                            rows[j] = last
        assert done == 4 and worst < 1e-5
    finally:
        attention.KINDS.pop("Q", None)


@pytest.mark.parametrize("case", [{}, dict(pos_emb="alibi"), dict(pos_emb="t5"), dict(pos_emb="rope", n_kv_head=2, qk_norm=True),
                                  dict(pos_emb="rope", attn_pattern="SRDNM", n_layer=5, attn_window=4)],
                         ids=["learned", "alibi", "t5", "gqa", "every bounded kind"])
def test_a_prompt_chunk_in_the_batchs_pass_equals_its_own_prefill(case):
    """BatchRows.decode_and_prefill (GPT.decode_and_prefill: the rows' step and a joining prompt's chunk as
    rows of one pass): the rows' logits are step()'s, the chunk's are forward_cached's, and both caches
    go on as if each had run alone."""
    import copy

    model = build(**case)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        batch, lengths = row_batch(model, max_rows=4), [3, 9, 5]
        for n in lengths:
            cache = model.new_cache()
            model.forward_cached(torch.randint(0, 61, (1, n), generator=g), cache)
            batch.add(cache)
        alone_batch = copy.deepcopy(batch)
        tokens, prompt = torch.randint(0, 61, (3, 1), generator=g), torch.randint(0, 61, (1, 7), generator=g)
        mixed, alone = model.new_cache(), model.new_cache()
        model.forward_cached(prompt[:, :2], mixed), model.forward_cached(prompt[:, :2], alone)  # a chunk came before
        rows, chunk = batch.decode_and_prefill(tokens, lengths, prompt[:, 2:], mixed, last=5)
        assert rows.shape == (3, 61) and chunk.shape == (1, 5, 61) and mixed.length == 7
        assert torch.allclose(rows, alone_batch.decode(tokens, lengths), atol=1e-5)
        assert torch.allclose(chunk, model.forward_cached(prompt[:, 2:], alone, last=5), atol=1e-5)
        after, lengths = torch.randint(0, 61, (3, 1), generator=g), [n + 1 for n in lengths]
        assert torch.allclose(batch.decode(after, lengths), alone_batch.decode(after, lengths), atol=1e-5)
        assert torch.allclose(model.forward_cached(after[:1], mixed), model.forward_cached(after[:1], alone), atol=1e-5)


def step_rows(model, batch, rows, g):
    """One batch step of random tokens, each row's logits against its own cache's: the largest difference."""
    tokens = torch.randint(0, 61, (len(rows), 1), generator=g)
    logits = batch.decode(tokens, [r["length"] for r in rows])
    worst = 0.0
    for r, token, row in zip(rows, tokens, logits):
        worst = max(worst, (model.forward_cached(token[None], r["alone"])[0, -1] - row).abs().max().item())
        r["length"], r["steps"] = r["length"] + 1, r["steps"] - 1
    return worst


def test_a_long_prompt_rides_the_running_rows_pass_in_chunks_no_longer_than_them(trained_run):
    """A joining prompt's chunk rides in the decode pass (decode_and_prefill) with at most max(RIDE_MIN, rows)
    tokens, so a long prompt at most about doubles the running streams' step (without the bound: one chunk
    of 29 tokens beside 2 rows); its text is still greedy's alone, and so are the rows'."""
    model, tokenizer, _ = load_any(trained_run)
    model.eval()
    engine = Engine(model, max_batch=4, max_queue=4, prefill_chunk=64, thread=False)
    passes = []
    decode_and_prefill = engine.batch.decode_and_prefill

    def spy(tokens, positions, idx, cache, last=1):
        passes.append((tokens.size(0), idx.size(1)))
        return decode_and_prefill(tokens, positions, idx, cache, last)

    engine.batch.decode_and_prefill = spy
    texts, prompts = {}, ["The", "Fair", "The king hath sent to Fair and"]
    greedy = Sampling(temperature=0)

    def job(i, max_tokens):
        texts[i] = []
        send = lambda event: texts[i].append(event)  # noqa: E731
        return Job(tokenizer.encode(prompts[i]), max_tokens, greedy, tokenizer=tokenizer, send=send)

    engine.submit([job(0, 20), job(1, 20)])
    engine.run(lambda: engine.steps >= 2)  # two rows running
    engine.submit([job(2, 3)])
    engine.run(lambda: all(t and t[-1][0] == "done" for t in texts.values()))
    long = [chunk for rows, chunk in passes if rows == 2]
    assert sum(long) == len(tokenizer.encode(prompts[2])) and all(chunk <= RIDE_MIN for chunk in long), passes
    for i, events in texts.items():
        ids = tokenizer.encode(prompts[i])
        alone = model.generate(torch.tensor([ids]), events[-1][2], greedy)[0, len(ids) :].tolist()  # ("done", why, n)
        assert "".join(e[1] for e in events if e[0] == "text") == tokenizer.decode(alone)
