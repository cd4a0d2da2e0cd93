"""
Serves a model over HTTP with OpenAI's completions API, decoding concurrent requests together, and a page
to try it in a browser.

  python serve.py --out_dir=out-shakespeare-char-cpu              # then open http://127.0.0.1:8000
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "ROMEO:", "max_tokens": 40}'
  python serve.py --help

Endpoints: POST /v1/completions (prompt as text, texts, token ids or lists of them; max_tokens, temperature,
top_p, top_k, stop, seed, n, stream, echo, logprobs), POST /v1/chat/completions (messages, for a model
fine-tuned on conversations; max_tokens or max_completion_tokens, the same sampling keys, logprobs and
top_logprobs), GET /v1/models, GET /health, GET / (the page; a chat mode for a chat model). An
encoder-decoder (config/train_seq2seq_cpu.py) reads each prompt as its source and completes it from its
decoder's start: {"prompt": "40213"} -> "forty thousand two hundred thirteen".
Needs `pip install -r requirements-serve.txt` (FastAPI and uvicorn; nothing else here imports them).

Requests are decoded together by engine.py's Engine (continuous batching); this file parses them,
answers in OpenAI's shapes and serves the page.
"""

import asyncio
import itertools
import json
import errno
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch

from checkpoint import ContextKeys, load_for
from configurator import ConfigError, DataError, checked, command_line, keys_of
from device import DEVICES, pick_device
from engine import Engine, Job, QueueFull
from generate import Sampling
from quantize import BATCH_OVERRIDE, WEIGHTS_DTYPES, for_inference, precision_line
from tokenizer import ChatTokenizer, chat_tokenizer, check_messages, decoder_start, source_end

MAX_BODY_BYTES = 1 << 20  # a request larger than 1 MB is refused (413) before it is parsed
MAX_LOGPROBS = 20


@dataclass
class ServeConfig(ContextKeys):
    out_dir: str = "out"  # the training run's directory (init_from=resume)
    init_from: str = "resume"  # resume (out_dir/ckpt.pt) | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a Hugging Face model directory
    host: str = "127.0.0.1"  # 0.0.0.0 serves other machines too (set api_key then)
    port: int = 8000
    device: str = "auto"  # auto | cpu | cuda | mps
    weights_dtype: str = "auto"  # auto (bf16 on a GPU with bf16, else float32) | float32 | bfloat16 | float16 | int8 (CPU; quantised, see docs/guide.md)
    max_batch: int = 8  # requests decoded together; more wait in the queue
    max_queue: int = 64  # requests waiting beyond the batch; past it, 503 with Retry-After
    prefill_chunk: int = 64  # prompt tokens prefilled per engine turn (riding the running rows' decode pass: at most as many as its rows, 8 at least)
    max_tokens_limit: int = 16384  # the most tokens one choice may ask for (max_tokens); above it, 400
    api_key: str = ""  # if set, requests must send Authorization: Bearer <api_key>
    model_name: str = ""  # the id /v1/models reports; "" = the out_dir's (or init_from's) name


SERVE_CHOICES = {"device": DEVICES, "weights_dtype": WEIGHTS_DTYPES, **ContextKeys.CHOICES}


# ----------------------------------------------------------------------------------------------------
# The request: OpenAI's fields, checked, into jobs


class BadRequest(Exception):
    """A 4xx answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message, param=None, status=400, code=None, headers=None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers

    def body(self):
        kind = {401: "authentication_error", 413: "invalid_request_error", 503: "server_busy"}.get(self.status,
                                                                                                  "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def field(body, name, kinds, default, check=None, what=""):
    """body[name] (default when absent or null), of one of `kinds`, passing check (else 400 naming it)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"'{name}' must be {names}, got {json.dumps(value)[:50]}", name)
    if check is not None and not check(value):
        raise BadRequest(f"'{name}' must be {what}, got {json.dumps(value)[:50]}", name)
    return value


def prompts_of(body, tokenizer, vocab_size):
    """The request's prompts as lists of token ids: a string, a list of strings, a list of ids or a list
    of lists of ids (OpenAI's four forms)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                         "of token ids", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            try:
                ids = tokenizer.encode(p)
            except DataError as e:
                raise BadRequest(f"'prompt': {e}", "prompt") from None
            if not ids and tokenizer.eot_token is not None:
                ids = [tokenizer.eot_token]  # GPT-2's unconditional start
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise BadRequest(f"'prompt': token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
            ids = p
        else:
            raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids", "prompt")
        if not ids:
            raise BadRequest("'prompt' is empty and this tokenizer has no end-of-text token to start from", "prompt")
        out.append(ids)
    return out


def sampling_fields(body):
    """The settings completions and chat completions share, checked (BadRequest naming the field)."""
    s = dict(
        temperature=field(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "in [0, 2]"),
        top_p=field(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=field(body, "top_k", (int,), None, lambda v: v >= 1, ">= 1"),
        n=field(body, "n", (int,), 1, lambda v: 1 <= v <= 16, "in [1, 16]"),
        seed=field(body, "seed", (int,), None),
        stream=field(body, "stream", (bool,), False),
    )
    stop = field(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    s["stop"] = stop
    return s


def check_context(prompts, config):
    # past it, generation slides (Engine.step); a prompt must fit in it (an encoder-decoder's source: its encoder)
    limit = config.block_size if config.family == "encoder-decoder" else config.context_limit
    longest = max(map(len, prompts))
    if limit is not None and longest > limit:
        raise BadRequest(f"this model's context is {limit} tokens and the prompt has {longest}: shorten it",
                         "prompt", code="context_length_exceeded")


def parse_request(body, tokenizer, config, max_tokens_limit):
    """(prompts, settings) of a completions request, or BadRequest naming the field. Unknown fields are
    ignored, as OpenAI does."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompts = prompts_of(body, tokenizer, config.vocab_size)
    if config.family == "encoder-decoder":  # a prompt is a source text: closed by its end token, as sample.py's
        end = source_end(tokenizer)
        prompts = [p if p[-1] == end else [*p, end] for p in prompts]
    s = dict(
        max_tokens=field(body, "max_tokens", (int,), min(16, max_tokens_limit), lambda v: 0 <= v <= max_tokens_limit,
                         f"in [0, {max_tokens_limit}] (the server's max_tokens_limit)"),
        **sampling_fields(body),
        echo=field(body, "echo", (bool,), False),
        logprobs=field(body, "logprobs", (int,), None, lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
    )
    if config.family == "encoder-decoder" and s["echo"]:
        raise BadRequest("'echo': an encoder-decoder's prompt is its source, not the start of its text", "echo")
    if s["max_tokens"] == 0 and not (s["echo"] and s["logprobs"] is not None):
        raise BadRequest("'max_tokens' is 0: set echo and logprobs to score the prompt, or ask for tokens", "max_tokens")
    check_context(prompts, config)
    return prompts, s


CHAT_REPLY_TOKENS = 256  # a chat reply's max_tokens when the request sets none and the model has no context limit


def parse_chat_request(body, tokenizer, config, max_tokens_limit):
    """(prompts, settings) of a chat completions request: the messages rendered with the model's chat
    template and the assistant's turn opened (tokenizer.ChatTokenizer.render). max_tokens (or OpenAI's newer
    max_completion_tokens) defaults to what the context has left (at most max_tokens_limit); logprobs is a
    bool, top_logprobs 0-20."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    try:
        messages = check_messages(body.get("messages"))
        chat = chat_tokenizer(tokenizer)
        prompt = chat.render(messages, add_generation_prompt=True)[0]
    except DataError as e:
        param = str(e).split(":")[0] if str(e).startswith("messages") else "messages"
        raise BadRequest(str(e), param) from None
    check_context([prompt], config)
    limit = config.context_limit
    default = limit - len(prompt) + 1 if limit is not None else CHAT_REPLY_TOKENS  # (the last token is the reply's end)
    allowed, what = lambda v: 1 <= v <= max_tokens_limit, f"in [1, {max_tokens_limit}] (the server's max_tokens_limit)"
    tokens = field(body, "max_completion_tokens", (int,), None, allowed, what)
    s = dict(
        max_tokens=field(body, "max_tokens", (int,), tokens or min(default, max_tokens_limit), allowed, what),
        **sampling_fields(body),
        echo=False,
        logprobs=None,
    )
    if field(body, "logprobs", (bool,), False):
        s["logprobs"] = field(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
    return [prompt], s


# ----------------------------------------------------------------------------------------------------
# The HTTP side (FastAPI), imported only here


def make_app(model, tokenizer, c, name, engine_thread=True):
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="smallgpt", docs_url=None, redoc_url=None)
    engine = app.state.engine = Engine(model, c.max_batch, c.max_queue, c.prefill_chunk, thread=engine_thread)
    created = int(time.time())
    ids = itertools.count()

    def error(e):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def authorise(request):
        if c.api_key and request.headers.get("authorization") != f"Bearer {c.api_key}":
            raise BadRequest("invalid or missing API key: send Authorization: Bearer <key>", status=401,
                             code="invalid_api_key")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e):
        """Unknown paths (404) and methods (405) in OpenAI's error shape, as OpenAI words them, not FastAPI's
        {"detail": "Not Found"}: every answer a client gets from here parses the same way."""
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where}): this server answers /v1/completions, /v1/chat/completions and /v1/models",
                   405: f"Method not allowed ({where})"}.get(e.status_code, f"{e.detail} ({where})")
        return error(BadRequest(message, status=e.status_code, headers=e.headers))

    @app.get("/health")
    def health():
        return {"status": "ok", "model": name, **engine.busy()}

    @app.get("/v1/models")
    def models(request: Request):
        try:
            authorise(request)
        except BadRequest as e:
            return error(e)
        limit = model.config.context_limit  # None: any length (bounded caches)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "smallgpt",
                                            "context_length": limit, "max_model_len": limit}]}

    @app.get("/", response_class=HTMLResponse)
    def page():
        return PAGE.replace("{{model}}", name).replace("{{chat}}", json.dumps(isinstance(tokenizer, ChatTokenizer)))

    async def answer(request, parse, make_reply, prefix):
        """A completions or chat completions request: parsed, its choices queued as jobs, answered whole or
        streamed."""
        try:
            authorise(request)
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise BadRequest(f"the request body is {len(raw):,} bytes; the limit is {MAX_BODY_BYTES:,}", status=413)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise BadRequest(f"the body is not valid JSON ({e})") from None
            prompts, s = parse(body, tokenizer, model.config, c.max_tokens_limit)
            sampling = checked(Sampling, float(s["temperature"]), s["top_k"], float(s["top_p"]))
        except (BadRequest, ConfigError) as e:
            return error(e if isinstance(e, BadRequest) else BadRequest(str(e)))
        loop = asyncio.get_running_loop()
        events = asyncio.Queue()
        seed = s["seed"] if s["seed"] is not None else torch.randint(2**31, ()).item()
        jobs = []
        for index, (prompt, j) in enumerate((p, j) for p in prompts for j in range(s["n"])):
            send = lambda event, index=index: engine.outbox.post(loop, events.put_nowait, (index, event))  # noqa: E731
            source = None
            if model.config.family == "encoder-decoder":  # the prompt is the source; the decoder writes from its start
                source, prompt = prompt, [decoder_start(tokenizer)]
            jobs.append(Job(prompt, s["max_tokens"], sampling, tokenizer=tokenizer, send=send, seed=seed + j,
                            stop=s["stop"], logprobs=s["logprobs"], echo=s["echo"], device=engine.device, source=source))
        try:
            engine.submit(jobs)
        except QueueFull:
            return error(BadRequest(f"the server is busy ({engine.max_batch} running, queue of {engine.max_queue} "
                                    "full); retry shortly", status=503, headers={"Retry-After": "1"}))
        reply = make_reply(f"{prefix}-{next(ids)}-{int(time.time())}", name, prompts, s, tokenizer)
        if s["stream"]:
            return StreamingResponse(reply.stream(events, jobs), media_type="text/event-stream")
        collecting, gone = asyncio.ensure_future(reply.collect(events, len(jobs))), asyncio.ensure_future(disconnect(request))
        try:
            await asyncio.wait([collecting, gone], return_when=asyncio.FIRST_COMPLETED)
        finally:  # (or the server cancelled the handler)
            gone.cancel()
            if gone.done() and not gone.cancelled():
                gone.exception()  # a receive() that failed counts as the client gone (read, so not logged as unread)
            left = not collecting.done()
            if left:  # the client left before the answer: its rows are free at the next step
                collecting.cancel()
                for job in jobs:
                    job.cancelled = True
        if left:
            return Response(status_code=499)  # nginx's "client closed request": no one reads it
        collecting.result()  # (raises what collecting raised)
        if reply.failure:
            return JSONResponse({"error": {"message": reply.failure, "type": "server_error", "param": None,
                                           "code": None}}, status_code=500)
        return reply.whole()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, parse_request, Reply, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(request, parse_chat_request, ChatReply, "chatcmpl")

    return app


async def disconnect(request):
    """Returns once the client has closed the connection. A streamed reply learns it from Starlette, which
    listens while it sends; a whole one sends nothing until the end, so it listens here (uvicorn's receive()
    after the body waits for the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # (a server that answers at once, against ASGI's rule, is polled, not spun on)


class Reply:
    """What the jobs of one request send, put together as OpenAI's answer: whole, or as server-sent
    events (one chunk per text delta, a last chunk per choice with its finish_reason, then [DONE])."""

    def __init__(self, id, model, prompts, s, tokenizer):
        self.id, self.model, self.prompts, self.s, self.tokenizer = id, model, prompts, s, tokenizer
        n = len(prompts) * s["n"]
        self.text, self.finish, self.generated = [""] * n, [None] * n, [0] * n
        self.entries = [[] for _ in range(n)]  # (token, logprob, top) per token, the prompt's first with echo
        self.failure = None

    def prompt_of(self, index):
        return self.prompts[index // self.s["n"]]

    def record(self, index, event):
        kind = event[0]
        if kind == "prompt":
            self.entries[index][:0] = event[1]
        elif kind == "text":
            self.text[index] += event[1]
            if event[2] is not None:
                self.entries[index].append(event[2])
        elif kind == "done":
            self.finish[index], self.generated[index] = event[1], event[2]
        elif kind == "error":
            self.failure, self.finish[index] = event[1], "error"

    async def collect(self, events, n):
        while sum(f is not None for f in self.finish) < n:
            index, event = await events.get()
            self.record(index, event)

    def logprobs(self, entries):
        if self.s["logprobs"] is None:
            return None
        tokens = [self.tokenizer.decode([t]) for t, _, _ in entries]
        offsets = list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]])) if tokens else []
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [top for _, _, top in entries], "text_offset": offsets}

    def choice(self, index):
        prompt_text = self.tokenizer.decode(self.prompt_of(index)) if self.s["echo"] else ""
        return {"text": prompt_text + self.text[index], "index": index,
                "logprobs": self.logprobs(self.entries[index]), "finish_reason": self.finish[index]}

    def usage(self):
        prompt_tokens, completion = sum(len(p) for p in self.prompts) * self.s["n"], sum(self.generated)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    def whole(self):
        return {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [self.choice(i) for i in range(len(self.text))], "usage": self.usage()}

    def chunk(self, index, text, entries, finish_reason=None):
        body = {"id": self.id, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": [{"text": text, "index": index, "logprobs": self.logprobs(entries) if entries else None,
                             "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, events, jobs):
        try:
            if self.s["echo"]:
                for index in range(len(self.text)):
                    yield self.chunk(index, self.tokenizer.decode(self.prompt_of(index)), [])
            done = 0
            while done < len(jobs):
                index, event = await events.get()
                self.record(index, event)
                if event[0] == "prompt":
                    yield self.chunk(index, "", event[1])
                elif event[0] == "text":
                    yield self.chunk(index, event[1], [event[2]] if event[2] else [])
                elif event[0] in ("done", "error"):
                    done += 1
                    if event[0] == "error":
                        yield f"data: {json.dumps({'error': {'message': event[1], 'type': 'server_error'}})}\n\n"
                    yield self.chunk(index, "", [], self.finish[index])
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): free the rows at the next step
            for job in jobs:
                job.cancelled = True


class ChatReply(Reply):
    """The same jobs' events as OpenAI's chat completions: a message per choice, or chat.completion.chunk
    events (per choice the role first, then content deltas, a last empty delta with its finish_reason,
    then [DONE]); logprobs as {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""

    def logprobs(self, entries):
        if self.s["logprobs"] is None:
            return None

        def item(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(self.tokenizer.decode([t]), lp), "top_logprobs": [item(k, v) for k, v in top.items()]}
                            for t, lp, top in entries]}

    def choice(self, index):
        return {"index": index, "message": {"role": "assistant", "content": self.text[index]},
                "logprobs": self.logprobs(self.entries[index]), "finish_reason": self.finish[index]}

    def whole(self):
        return {**super().whole(), "object": "chat.completion"}

    def chunk(self, index, text, entries, finish_reason=None, delta=None):
        delta = delta if delta is not None else ({"content": text} if finish_reason is None else {})
        body = {"id": self.id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                "choices": [{"index": index, "delta": delta, "logprobs": self.logprobs(entries) if entries else None,
                             "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body)}\n\n"

    async def stream(self, events, jobs):
        for index in range(len(self.text)):
            yield self.chunk(index, "", [], delta={"role": "assistant", "content": ""})
        async for event in super().stream(events, jobs):
            yield event


# ----------------------------------------------------------------------------------------------------
# The page: no build step, no CDN (the machine may be offline); it uses the same API


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>smallgpt: {{model}}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; }
textarea { width: 100%; height: 7rem; font-family: ui-monospace, monospace; }
pre#out { white-space: pre-wrap; background: #f4f4f4; padding: 1rem; min-height: 6rem; }
label { margin-right: 1rem; } input[type=number] { width: 5rem; } #stats { color: #555; }
</style></head><body>
<h1>smallgpt <small>{{model}}</small></h1>
<textarea id="prompt">ROMEO:</textarea>
<p><label>max tokens <input id="max_tokens" type="number" value="200" min="1"></label>
<label>temperature <input id="temperature" type="number" value="0.8" step="0.1" min="0" max="2"></label>
<label>top p <input id="top_p" type="number" value="1" step="0.05" min="0.05" max="1"></label>
<label>top k <input id="top_k" type="number" value="" min="1" placeholder="all"></label>
<label>seed <input id="seed" type="number" value="" placeholder="random"></label>
<label>API key <input id="key" type="password" size="10"></label></p>
<p><button id="go">Generate</button> <button id="stop" disabled>Stop</button> <button id="clear" hidden>New chat</button>
<span id="stats"></span></p>
<pre id="out"></pre>
<script>
const $ = (id) => document.getElementById(id);
const CHAT = {{chat}};  // a model with a chat template: the text box is your turn, /v1/chat/completions answers
let controller = null, history = [], transcript = "";
if (CHAT) { $("prompt").value = ""; $("go").textContent = "Send"; $("clear").hidden = false; }
function settings() {
  const body = {max_tokens: +$("max_tokens").value, temperature: +$("temperature").value,
                top_p: +$("top_p").value, stream: true};
  if (CHAT) body.messages = [...history, {role: "user", content: $("prompt").value}]; else body.prompt = $("prompt").value;
  if ($("top_k").value) body.top_k = +$("top_k").value;
  if ($("seed").value) body.seed = +$("seed").value;
  return body;
}
async function generate() {
  const out = $("out"), stats = $("stats");
  const turn = $("prompt").value; let reply = "";
  out.textContent = CHAT ? transcript + "you: " + turn + "\\nmodel: " : turn; stats.textContent = "";
  controller = new AbortController(); $("go").disabled = true; $("stop").disabled = false;
  const headers = {"Content-Type": "application/json"};
  if ($("key").value) headers["Authorization"] = "Bearer " + $("key").value;
  const start = performance.now(); let first = null, tokens = 0;
  try {
    const response = await fetch(CHAT ? "/v1/chat/completions" : "/v1/completions", {method: "POST", headers, body: JSON.stringify(settings()),
                                                      signal: controller.signal});
    if (!response.ok) { const e = await response.json(); stats.textContent = "error: " + e.error.message; return; }
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\\n\\n")) >= 0) {
        const line = buffer.slice(0, end); buffer = buffer.slice(end + 2);
        if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) { stats.textContent = "error: " + chunk.error.message; continue; }
        const choice = chunk.choices[0], text = CHAT ? (choice.delta.content || "") : choice.text;
        if (text) { out.textContent += text; reply += text; tokens += 1; first = first || performance.now(); }
        if (CHAT && choice.finish_reason) {
          history.push({role: "user", content: turn}, {role: "assistant", content: reply});
          transcript = out.textContent + "\\n"; $("prompt").value = "";
        }
        const seconds = (performance.now() - (first || start)) / 1000;
        stats.textContent = tokens + " chunks, " + (seconds > 0 ? (tokens / seconds).toFixed(1) : "-") + " tokens/s" +
          (choice.finish_reason ? ", finished: " + choice.finish_reason : "");
      }
    }
  } catch (e) { if (e.name !== "AbortError") stats.textContent = "error: " + e; }
  finally { $("go").disabled = false; $("stop").disabled = true; controller = null; }
}
$("go").onclick = generate;
const query = new URLSearchParams(location.search);  // ?prompt=...&run=1 fills the form (and starts)
for (const [key, value] of query) if ($(key) && key !== "out") $(key).value = value;
if (query.get("run")) generate();
$("stop").onclick = () => controller && controller.abort();
$("clear").onclick = () => { history = []; transcript = ""; $("out").textContent = ""; };
</script></body></html>
"""


# ----------------------------------------------------------------------------------------------------


def serve(c):
    for key, low in (("max_batch", 1), ("max_queue", 0), ("port", 0), ("prefill_chunk", 1), ("max_tokens_limit", 1)):
        if getattr(c, key) < low:
            raise ConfigError(f"{key}={getattr(c, key)} must be >= {low}")
    try:
        import uvicorn
    except ImportError:
        raise ConfigError("serve.py needs FastAPI and uvicorn, which are not installed: "
                          "pip install -r requirements-serve.txt") from None
    listening = listen_on(c.host, c.port)  # before the model loads: a port in use fails at once
    try:
        serve_on(listening, c)
    finally:
        for sock in listening:
            sock.close()


def serve_on(listening, c):
    import uvicorn

    device = pick_device(c.device)
    model, tokenizer, _ = load_for(c)
    if model.config.family == "encoder":
        raise ConfigError("this model is an encoder (family='encoder'): it fills masks or classifies, it writes no "
                          "text to serve; score it with eval.py")
    model = checked(for_inference, model.to(device=device), c.weights_dtype, batch_rows=c.max_batch)
    name = c.model_name or (c.out_dir if c.init_from == "resume" else c.init_from).rstrip("/").split("/")[-1]
    app = make_app(model, tokenizer, c, name, engine_thread=False)
    print(precision_line(c.weights_dtype, device), file=sys.stderr)
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    if packed:
        print(f"batches: {len(packed)} weights also packed for oneDNN over {c.max_batch} rows, measured faster than F.linear "
              f"(+{sum(t.numel() * t.element_size() for t in packed) / 2**20:.0f} MB; {BATCH_OVERRIDE}=linear keeps one copy)",
              file=sys.stderr)
    port = listening[0].getsockname()[1]  # (--port=0: the one the system chose)
    print(f"serving {name} on {url_of(c.host, port)} (max_batch={c.max_batch}, max_queue={c.max_queue})",
          file=sys.stderr)
    # The engine runs in the main thread, the HTTP server in another: once the main thread has run a
    # parallel region (loading the model does), torch's CPU kernels called from any other thread run
    # several times slower (OpenMP: a layer norm of 32 rows 8 us in the main thread, 75-85 us in another),
    # which halved the decode speed of an engine in a thread of its own.
    server = uvicorn.Server(uvicorn.Config(app, host=c.host, port=c.port, log_level="warning"))
    http = threading.Thread(target=server.run, kwargs={"sockets": listening}, daemon=True, name="http")
    signal.signal(signal.SIGTERM, stop_serving)
    http.start()
    try:
        app.state.engine.run(lambda: not http.is_alive())
    except KeyboardInterrupt:
        return
    finally:
        server.should_exit = True
        http.join(timeout=10)
    sys.exit("error: the HTTP server stopped on its own (its error is above); nothing is served")


def listen_on(host, port):
    """The server's listening sockets, one per address host resolves to (localhost: 127.0.0.1 and ::1, as
    asyncio's create_server binds them), made here before anything else: uvicorn's own bind failing only
    ended the HTTP thread, and the process went on, exiting 0 after saying it served."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"port={port} must be in [0, 65535]")
    try:
        found = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    sockets = []
    try:
        for family, kind, proto, address in dict.fromkeys((f, k, p, a) for f, k, p, _, a in found):  # each once
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # its own socket beside the IPv4 one (asyncio's choice too)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # the port the system chose for the first address, for all
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            try:
                sock.bind(address)
            except OSError as e:  # a family this machine has not enabled (IPv6): skipped, as asyncio does
                if e.errno != errno.EADDRNOTAVAIL or family != socket.AF_INET6 or len(found) == 1:
                    raise
                sockets.pop().close()
                continue
            sock.listen(2048)  # listening now: a second server on this port fails here, not after loading
    except OSError as e:
        for sock in sockets:
            sock.close()
        why = {errno.EADDRINUSE: "the port is in use (another server?): stop it or give another --port",
               errno.EACCES: "not allowed (ports below 1024 need root): give --port=1024 or above",
               errno.EADDRNOTAVAIL: "the address is not this machine's: give --host=127.0.0.1 or 0.0.0.0"}
        raise ConfigError(f"cannot listen on {host}:{port}: {why.get(e.errno, e.strerror or e)}") from None
    return sockets  # (never empty: an IPv6 address is skipped only beside another)


def url_of(host, port):
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def stop_serving(signum, frame):
    raise KeyboardInterrupt  # SIGTERM ends the engine's loop as Ctrl-C does; the HTTP thread then stops


main = command_line(ServeConfig, "python serve.py [config_file ...] [--key=value ...]",
                    __doc__.strip().splitlines()[0], serve,
                    keys_of(ServeConfig, SERVE_CHOICES, base=ContextKeys))


if __name__ == "__main__":
    main()
