"""
Continuous batching: requests in, tokens out, one decode loop.

serve.py puts HTTP in front of it; nothing here knows HTTP, so a test or another front end drives it
directly.

How requests share the model (as Orca, vLLM and llama.cpp's slots do it): the Engine keeps a batch of up
to max_batch rows, one per request (a Job). Each loop turn it lets waiting requests join (a prefill of one
chunk of a prompt into a cache of its own; after its last chunk the request samples its first token and
its cache joins the batch's), then runs one decode step for every row at once (BatchRows: each row at its
own length in one set of static caches, attention for all rows in one call per layer; the weights are
read once for the whole batch, and reading them is what a CPU decode step costs), and samples every row
with its own settings and seed, in one call per setting (sample_rows). A row leaves when its request is
done (length, stop string, end-of-text) or its client has gone, and its place is free at the next step.
"""

import collections
import threading

import torch
import torch.nn.functional as F

from generate import next_logits, row_batch, sample_next
from tokenizer import continuation


class Job:
    """One completion choice: its prompt, how to continue it, and what came of it.

    The engine calls take(logits) once per token; the text, the stop strings and what to send are
    worked out here, and handed to `send` (a thread-safe callable of the HTTP side) as ("text",
    delta, logprobs) and then ("done", finish_reason, tokens generated); with echo and logprobs,
    ("prompt", logprobs) first."""

    def __init__(self, prompt, max_tokens, sampling, *, tokenizer, send, seed=0, stop=(), logprobs=None, echo=False,
                 device="cpu", source=None):
        self.prompt, self.max_tokens, self.sampling, self.stop = prompt, max_tokens, sampling, stop
        self.source = source  # an encoder-decoder's: the source ids (prompt: the decoder's start)
        self.logprobs, self.echo, self.tokenizer, self.send = logprobs, echo, tokenizer, send
        # on the model's device: torch.multinomial refuses a generator of another device (CUDA, MPS)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.tokens, self.cache, self.finish_reason, self.cancelled = [], None, None, False
        self.shown = ""  # text sent so far
        self.hold = max((len(s) - 1 for s in stop), default=0)  # what might be the start of a stop string
        # where a choice ends by itself: end-of-text, or any chat template token (a reply's <|end|>, a new turn)
        self.ends = {tokenizer.eot_token, *getattr(tokenizer, "names", ())} - {None}

    def scored_prompt(self, logits):
        """With echo and logprobs: the prompt's own tokens with their log-probabilities (the first has none)."""
        logp = F.log_softmax(logits[0, :-1].float(), dim=-1)
        entries = [(self.prompt[0], None, None)]
        for i, token in enumerate(self.prompt[1:]):
            entries.append((token, float(logp[i, token]), self.top(logp[i])))
        self.send(("prompt", entries))

    def top(self, logp):
        values, ids = torch.topk(logp, self.logprobs)
        return {self.tokenizer.decode([int(i)]): float(v) for v, i in zip(values, ids)}

    def take(self, logits):
        """logits (1, vocab) of the next position: samples a token and sends what it adds."""
        self.accept(int(sample_next(logits, self.sampling, [self.generator])), logits)

    def accept(self, token, logits):
        """The token drawn from logits (1, vocab) (by the engine's sampling of the whole batch): sends what it adds."""
        self.tokens.append(token)
        entry = None
        if self.logprobs is not None:
            logp = F.log_softmax(logits[0].float(), dim=-1)
            entry = (token, float(logp[token]), self.top(logp))
        if token in self.ends:
            return self.finish("stop", entry)
        text = continuation(self.tokenizer, self.prompt, self.tokens)
        at = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if at >= 0:
            self.emit(text[:at], entry)
            return self.finish("stop")
        if len(self.tokens) == self.max_tokens:
            self.emit(text, entry)
            return self.finish("length")
        ready = text[: len(text) - self.hold]
        if ready.endswith("\ufffd"):  # a token that ends inside a multi-byte character: wait for the rest
            ready = ready[:-1]
        self.emit(ready if len(ready) > len(self.shown) else self.shown, entry)

    def emit(self, text, entry):
        delta, self.shown = text[len(self.shown) :], max(text, self.shown, key=len)
        if delta or entry is not None:
            self.send(("text", delta, entry))

    def finish(self, reason, entry=None):
        if entry is not None:  # end-of-text: its log-probability is reported, its text is not
            self.send(("text", "", entry))
        self.finish_reason, self.cache = reason, None
        self.send(("done", reason, len(self.tokens)))


class QueueFull(Exception):
    pass


class Outbox:
    """What the engine sends to the HTTP side during one turn, handed over at its end.

    With one wake-up per event loop (a call_soon_threadsafe per token per stream costs the server a
    wake-up each: with 32 streams, 32 a step)."""

    def __init__(self):
        self.items = collections.defaultdict(list)

    def post(self, loop, put, event):
        self.items[loop].append((put, event))

    def flush(self):
        items, self.items = self.items, collections.defaultdict(list)
        for loop, puts in items.items():
            loop.call_soon_threadsafe(deliver, puts)


def deliver(puts):
    for put, event in puts:
        put(event)


RIDE_MIN = 8  # prompt tokens a chunk riding a decode pass may have, however few rows the pass has


class Engine:
    """The decode loop: admits jobs, prefills their prompts in chunks, decodes every row each turn.

    The decode loop (run(), in a daemon thread): each turn admits waiting jobs while rows are free,
    prefills one chunk of one joining prompt (a long prompt is spread over several turns, so the running
    streams keep getting tokens; the chunk rides in their decode pass, chunk()), then runs one decode step
    for every running row (row_batch: one batch, each row at its own length) and samples them in one call
    per setting. submit() is called from the HTTP side."""

    def __init__(self, model, max_batch, max_queue, prefill_chunk=64, thread=True):
        self.model, self.max_batch, self.max_queue, self.prefill_chunk = model, max_batch, max_queue, prefill_chunk
        self.device = next(model.parameters()).device
        self.batch = row_batch(model, max_batch)
        self.waiting, self.joining = collections.deque(), collections.deque()
        self.rows, self.sliding = [], []  # rows[i] is the batch's row i; sliding: past the context, run afresh
        self.wake = threading.Condition()
        self.steps = self.widest = 0  # decode steps so far, and the most rows one of them had (/health)
        self.outbox = Outbox()  # the jobs' events of a turn (their send posts here), handed over at its end
        if thread:  # (serve.py runs it in the main thread instead: see serve())
            threading.Thread(target=self.run, daemon=True, name="engine").start()

    def occupied(self):
        return len(self.rows) + len(self.sliding) + len(self.joining)

    def submit(self, jobs):
        """Queues the jobs of one request, all or none (QueueFull)."""
        with self.wake:
            if len(self.waiting) + len(jobs) > self.max_queue + self.max_batch - self.occupied():
                raise QueueFull
            self.waiting.extend(jobs)
            self.wake.notify()

    def busy(self):
        return {"running": len(self.rows) + len(self.sliding), "joining": len(self.joining), "waiting": len(self.waiting),
                "max_batch": self.max_batch, "max_queue": self.max_queue, "decode_steps": self.steps, "widest_step": self.widest}

    def run(self, stopped=lambda: False):
        while not stopped():
            with self.wake:
                while not (self.waiting or self.joining or self.rows or self.sliding) and not stopped():
                    self.wake.wait(timeout=1)
                free = self.max_batch - self.occupied()
                self.joining.extend(self.waiting.popleft() for _ in range(min(free, len(self.waiting))))
            self.drop_finished()
            job = riding = self.joining[0] if self.joining else None
            if job is not None and not self.rows:  # no batch pass to share: the chunk alone
                self.guarded(job, self.prefill)
                riding = None
            if self.rows or self.sliding:
                self.decode(riding)
            if job is not None and (job.cache is None or job.finish_reason is not None):  # its prompt is done (or it failed)
                self.joining.popleft()
            self.outbox.flush()

    def guarded(self, job, work):
        """work(job), where a failure ends that job (the client gets an error) and not the server."""
        try:
            work(job)
        except Exception as e:  # noqa: BLE001: one request's failure must not stop the others
            job.finish_reason, job.cache = "error", None
            job.send(("error", f"{type(e).__name__}: {e}"))

    def drop_finished(self):
        """Frees the rows (and the joining places) of jobs that are done or whose client has gone."""
        for i in reversed(range(len(self.rows))):
            if self.rows[i].finish_reason is not None or self.rows[i].cancelled:
                self.leave(i)
        self.sliding = [job for job in self.sliding if job.finish_reason is None and not job.cancelled]
        while self.joining and self.joining[0].cancelled:
            self.joining.popleft().cache = None

    def leave(self, i):
        """Row i leaves the batch, whose last row takes its place."""
        self.batch.remove(i)
        last = self.rows.pop()
        if i < len(self.rows):
            self.rows[i] = last

    def past_context(self, job):
        """Whether the job's next step would pass the model's context (then it runs afresh each step)."""
        limit = self.model.config.context_limit
        return limit is not None and len(job.prompt) + len(job.tokens) > limit

    @torch.no_grad()
    def prefill(self, job):
        """The next prefill_chunk tokens of the prompt into the job's cache, in a pass of their own."""
        self.prefilled(job, self.model.forward_cached(*self.chunk(job)))

    def chunk(self, job, riding=0):
        """The next chunk of a joining job's prompt: (tokens (1, T), its cache, how many logits it needs).

        prefill_chunk tokens in a pass of their own; riding a decode pass of `riding` rows on a CPU, at most
        max(RIDE_MIN, riding). On a CPU a pass costs about linearly in its rows, so a chunk no longer than the
        rows it rides with at most about doubles their step: a long prompt joining a few streams delays each
        of their tokens by at most about one step of their own, in more, smaller chunks."""
        if job.cache is None:  # (an encoder-decoder's: its source encoded once, for every step of the job)
            source = None if job.source is None else torch.tensor([job.source], device=self.device)
            job.cache, job.prompt_logits = self.model.new_cache(source=source), []
        start = job.cache.length
        cpu = self.device.type == "cpu"  # (on a GPU a pass's time is flat in its rows until it is large)
        size = min(self.prefill_chunk, max(RIDE_MIN, riding)) if riding and cpu else self.prefill_chunk
        end = min(len(job.prompt), start + size)
        want_prompt = job.echo and job.logprobs is not None
        return torch.tensor([job.prompt[start:end]], device=self.device), job.cache, end - start if want_prompt else 1

    def prefilled(self, job, logits):
        """After a chunk of job's prompt: after the last, its first token, and the job joins the batch.

        After a chunk of job's prompt (logits: what chunk() asked for): after the last, the first token
        (or, with max_tokens 0, none) and the job joins the batch."""
        want_prompt = job.echo and job.logprobs is not None
        if want_prompt:
            job.prompt_logits.append(logits)
        if job.cache.length < len(job.prompt):
            return
        if want_prompt:
            job.scored_prompt(torch.cat(job.prompt_logits, dim=1))
        cache, job.cache, job.prompt_logits = job.cache, None, None
        if job.max_tokens == 0:
            return job.finish("length")
        job.take(logits[:, -1])
        if job.finish_reason is None:
            if self.past_context(job):
                self.sliding.append(job)
            else:
                self.batch.add(cache)
                self.rows.append(job)

    @torch.no_grad()
    def decode(self, joining=None):
        """One token for every row, and a joining prompt's next chunk in the same pass.

        One token for every row: the batch's decode step (and, for rows whose text has outgrown the model's
        context, their last block_size tokens afresh, as generate() and sample.py do past block_size: every
        cached key is stale there), then one sampling call per setting. With a joining job, the next chunk of
        its prompt goes through the same pass (BatchRows.decode_and_prefill: the weights read once for both)."""
        for i in reversed(range(len(self.rows))):
            if self.past_context(self.rows[i]):
                self.sliding.append(self.rows[i])
                self.leave(i)
        if joining is not None and not self.rows:  # no batch pass left to share
            self.guarded(joining, self.prefill)
            joining = None
        rows = self.rows + self.sliding
        try:
            logits = []
            if self.rows:
                tokens = torch.tensor([[job.tokens[-1]] for job in self.rows], device=self.device)
                positions = [len(job.prompt) + len(job.tokens) - 1 for job in self.rows]
                if joining is None:
                    logits.append(self.batch.decode(tokens, positions))
                else:
                    decoded, chunk_logits = self.batch.decode_and_prefill(tokens, positions, *self.chunk(joining, len(self.rows)))
                    logits.append(decoded)
            logits.extend(self.slide(job)[None] for job in self.sliding)
            logits = torch.cat(logits)
            tokens = sample_rows(logits, [job.sampling for job in rows], [job.generator for job in rows]).tolist()
        except Exception as e:  # noqa: BLE001: (out of memory, say) these requests fail, the server goes on
            for job in rows + ([joining] if joining is not None else []):
                job.finish_reason, job.cache = "error", None
                job.send(("error", f"{type(e).__name__}: {e}"))
            return
        self.steps, self.widest = self.steps + 1, max(self.widest, len(rows))
        for job, token, row in zip(rows, tokens, logits):
            self.guarded(job, lambda job: job.accept(token, row[None]))
        if joining is not None:  # after the rows: it joins the batch at the next step
            self.guarded(joining, lambda job: self.prefilled(job, chunk_logits))

    def slide(self, job):
        """The next logits of a row past the context: generate.next_logits's window, run afresh."""
        seq = torch.tensor([job.prompt + job.tokens], device=self.device)
        source = None if job.source is None else torch.tensor([job.source], device=self.device)
        return next_logits(self.model, seq, seq.size(1), source=source)[0]


# ----------------------------------------------------------------------------------------------------
# The batch: sequences decoded together, each at its own length


def sample_rows(logits, samplings, generators):
    """(B, vocab) logits -> (B,) tokens, row i drawn as sample_next would draw it alone.

    (B, vocab) logits -> (B,) tokens: row i drawn with samplings[i] from generators[i], exactly as
    sample_next draws it alone; the rows that share a Sampling are drawn in one call."""
    tokens = torch.empty(logits.size(0), dtype=torch.long, device=logits.device)
    groups = {}
    for i, sampling in enumerate(samplings):
        groups.setdefault(sampling, []).append(i)
    for sampling, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        tokens[index] = sample_next(logits[index], sampling, [generators[i] for i in rows])[:, 0]
    return tokens
