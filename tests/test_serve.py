"""serve.py: the OpenAI-compatible server on a local port, through real clients (openai, HTTP, lm-eval, a browser)."""

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import ROOT, TINY_RUN, run_main

pytest.importorskip("fastapi", reason="serve.py needs FastAPI and uvicorn (requirements-serve.txt)")
uvicorn = pytest.importorskip("uvicorn", reason="serve.py needs FastAPI and uvicorn (requirements-serve.txt)")

import serve  # noqa: E402
from checkpoint import load_any  # noqa: E402
from generate import Sampling  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """serve.make_app on a free port, in a thread of this process (uvicorn's own server, real sockets)."""

    def __init__(self, out_dir, model=None, **keys):
        self.model, self.tokenizer, _ = load_any(out_dir)
        self.model = (model or self.model).eval()
        self.config = serve.ServeConfig(out_dir=out_dir, **keys)
        app = serve.make_app(self.model, self.tokenizer, self.config, "tiny")
        self.engine = app.state.engine
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def post(self, body, path="/v1/completions", headers=None, raw=None):
        """(status, JSON body) of a POST."""
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read().decode()

    def greedy(self, prompt, n):
        """What model.generate (sample.py --temperature=0) continues prompt with."""
        ids = self.tokenizer.encode(prompt)
        out = self.model.generate(torch.tensor([ids]), n, Sampling(temperature=0))
        return self.tokenizer.decode(out[0, len(ids) :].tolist())


@pytest.fixture(scope="module")
def served_run(tmp_path_factory, char_dataset):
    """A character model trained enough (300 steps, about 3 s) that its greedy text depends on the prompt."""
    import train

    out = tmp_path_factory.mktemp("served")
    train.main([*TINY_RUN, f"--dataset={char_dataset}", f"--out_dir={out}", "--max_iters=300", "--eval_interval=300",
                "--learning_rate=1e-2", "--batch_size=8"])
    return str(out)


@pytest.fixture(scope="module")
def server(served_run):
    s = Server(served_run, max_batch=8, max_queue=6)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai", reason="the openai package is a test dependency (requirements-dev.txt)")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# ---------------------------------------------------------------------------------------------------
# The openai package


def test_openai_client_completions_and_stream(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="The king", max_tokens=12, temperature=0)
    assert done.choices[0].text == server.greedy("The king", 12) and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (8, 12)
    pieces = list(client.completions.create(model="tiny", prompt="The king", max_tokens=12, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text  # the stream is the same text
    assert pieces[-1].choices[0].finish_reason == "length" and len(pieces) > 3
    # several prompts, n choices each, a seed: sampled text reproducible, choice indexes prompt-major
    many = client.completions.create(model="tiny", prompt=["The", "Fair"], n=2, max_tokens=6, seed=5, temperature=1.0)
    again = client.completions.create(model="tiny", prompt=["The", "Fair"], n=2, max_tokens=6, seed=5, temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [c.text for c in again.choices]


def test_stop_strings_and_token_prompts(server, client):
    full = server.greedy("The king", 20)
    stop = full[5:7]
    cut = client.completions.create(model="tiny", prompt="The king", max_tokens=20, temperature=0, stop=[stop, "@@"])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"
    ids = server.tokenizer.encode("The king")
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert as_ids.choices[0].text == full[:8]


def test_echo_and_logprobs_score_the_prompt(server, client):
    ids = server.tokenizer.encode("The king hath")
    out = client.completions.create(model="tiny", prompt="The king hath", max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith("The king hath") and len(lp.token_logprobs) == len(ids) + 1
    with torch.no_grad():
        logp = torch.log_softmax(server.model(torch.tensor([ids]))[0][0].float(), dim=-1)
    expected = [None] + [logp[i, t].item() for i, t in enumerate(ids[1:])]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:-1] == pytest.approx(expected[1:], abs=1e-4)
    assert all(len(top) == 2 and max(top.values()) >= lp.token_logprobs[i + 1] - 1e-6 for i, top in enumerate(lp.top_logprobs[1:]))


def test_errors_in_openais_shape(server, client):
    import openai

    with pytest.raises(openai.BadRequestError, match="'temperature' must be in \\[0, 2\\]"):
        client.completions.create(model="tiny", prompt="The", temperature=5)
    with pytest.raises(openai.BadRequestError, match="context is 32 tokens and the prompt has 45: shorten it"):
        client.completions.create(model="tiny", prompt="The king " * 5, max_tokens=1)
    status, body = server.post({"prompt": [[1, 2, 10**6]]})
    assert status == 400 and body["error"]["param"] == "prompt" and "outside the vocabulary" in body["error"]["message"]
    status, body = server.post({"prompt": "zx"})
    assert status == 400 and "characters not in the vocabulary" in body["error"]["message"]
    status, body = server.post({"prompt": "The", "max_tokens": 10**9})
    assert status == 400 and "'max_tokens' must be in [0, 16384] (the server's max_tokens_limit)" in body["error"]["message"]
    assert serve.parse_request({"prompt": "The"}, server.tokenizer, server.model.config, 4)[1]["max_tokens"] == 4  # default capped
    for bad in [{"prompt": "The", "max_tokens": -1}, {"prompt": "The", "max_tokens": "ten"}, {"prompt": ""},
                {"prompt": 5}, {"prompt": "The", "n": 0}, {"prompt": "The", "stop": [""]}, {"prompt": "The", "logprobs": 99}]:
        status, body = server.post(bad)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (bad, body)
    assert server.post(None, raw=b"{not json")[0] == 400
    assert server.post(None, raw=b"x" * (2 << 20))[0] == 413
    assert server.post({"prompt": "The", "max_tokens": 2, "unknown_field": 1})[0] == 200  # ignored, as OpenAI does
    # unknown paths and methods: OpenAI's shape and wording, not FastAPI's {"detail": "Not Found"}
    status, body = server.post({"prompt": "The"}, path="/v1/complete")
    assert status == 404 and body["error"]["message"].startswith("Invalid URL (POST /v1/complete)"), body
    assert body["error"]["type"] == "invalid_request_error" and set(body["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError, match="Invalid URL"):
        client.embeddings.create(model="tiny", input="The")
    request = urllib.request.Request(server.url + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=30)
    body = json.loads(answer.value.read())
    assert answer.value.code == 405 and body["error"]["message"] == "Method not allowed (GET /v1/completions)", body
    assert answer.value.headers["allow"] == "POST"


def test_api_key_and_queue_limit(served_run):
    s = Server(served_run, max_batch=1, max_queue=1, api_key="sesame")
    try:
        assert s.post({"prompt": "The", "max_tokens": 2})[0] == 401
        assert s.post({"prompt": "The", "max_tokens": 2}, headers={"Authorization": "Bearer sesame"})[0] == 200
        busy = {"prompt": "The", "max_tokens": 28}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: s.post(busy, headers={"Authorization": "Bearer sesame"}), range(6)))
        statuses = sorted(status for status, _ in answers)
        assert statuses[0] == 200 and statuses[-1] == 503  # one runs, one waits, the rest are told to come back
        assert all("retry" in body["error"]["message"] for status, body in answers if status == 503)
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------------
# Batching


def test_greedy_alone_equals_greedy_in_a_busy_batch(server):
    prompts = ["The king", "Fair", "O heaven, the", "Sweet", "My lord", "Night", "Good morrow", "Fire"]
    alone = [server.post({"prompt": p, "max_tokens": 16, "temperature": 0})[1]["choices"][0]["text"] for p in prompts]
    assert alone == [server.greedy(p, 16) for p in prompts]  # = sample.py --temperature=0
    assert len(set(alone)) >= 4  # the text depends on the prompt, so rows mixed up would show
    before, server.engine.widest = server.engine.steps, 0

    def mixed(i):  # greedy requests, with sampled ones of other lengths and settings between them
        body = ({"prompt": prompts[i], "max_tokens": 16, "temperature": 0} if i % 2 == 0 else
                {"prompt": prompts[i], "max_tokens": 12 + i, "temperature": 1.2, "top_k": 5, "seed": i})
        return server.post(body)[1]["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(mixed, range(8)))
    assert server.engine.widest >= 4  # they did share decode steps
    assert server.engine.steps - before < 16 * 4 + 12 * 4 + 16  # fewer than one request at a time would take
    assert [together[i] for i in range(0, 8, 2)] == [alone[i] for i in range(0, 8, 2)]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_that_leaves_frees_its_row(served_run, stream):
    import http.client

    from dataclasses import replace

    from model import GPT

    # the served model's shape with windowed layers, which run any length: a request of a million tokens
    # would hold its row for hours. A whole reply sends nothing before its end, so only the server's own
    # listening tells it the client has gone (without it this row ran on, and the server with it).
    torch.manual_seed(0)
    endless = GPT(replace(load_any(served_run)[0].config, pos_emb="rope", attn_pattern="S", attn_window=8))
    s = Server(served_run, model=endless, max_batch=2, max_tokens_limit=10**6)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        connection.request("POST", "/v1/completions", json.dumps({"prompt": "The", "max_tokens": 10**6, "stream": stream}),
                           {"Content-Type": "application/json"})
        if stream:
            response = connection.getresponse()
            assert response.status == 200 and response.read(300)  # the first chunks arrived
        deadline = time.time() + 10
        while not json.loads(s.get("/health"))["running"] and time.time() < deadline:
            time.sleep(0.05)
        assert json.loads(s.get("/health"))["running"] == 1
        connection.close()  # and the client is gone mid-stream, or while it waits for the whole reply
        deadline = time.time() + 10
        while json.loads(s.get("/health"))["running"] and time.time() < deadline:
            time.sleep(0.05)
        assert json.loads(s.get("/health"))["running"] == 0
        assert s.post({"prompt": "The", "max_tokens": 4, "temperature": 0})[1]["choices"][0]["text"] == s.greedy("The", 4)
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------------
# The command line, the page, and who imports FastAPI


def test_serve_py_serves_the_page_and_the_api(served_run):
    port = free_port()
    process = subprocess.Popen([sys.executable, "serve.py", f"--out_dir={served_run}", f"--port={port}"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, page = time.time() + 60, None
        while page is None and time.time() < deadline and process.poll() is None:
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
        assert page is not None, process.stdout.read() if process.poll() is not None else "no answer in 60 s"
        assert "<textarea" in page and "/v1/completions" in page
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "The", "max_tokens": 3}).encode(),
                                         headers={"Content-Type": "application/json"})
        assert json.loads(urllib.request.urlopen(request, timeout=30).read())["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_serves_a_model_with_its_own_bpe(bpe_run):
    """A BPE learned by data/prepare.py: prompts in, text out, with and without the stream, as sample.py."""
    s = Server(bpe_run[1])
    try:
        for prompt in ("The king", "Sweet \u00bfnight?"):  # byte-level: any character is a prompt
            status, body = s.post({"prompt": prompt, "max_tokens": 12, "temperature": 0})
            assert status == 200 and body["choices"][0]["text"] == s.greedy(prompt, 12) != ""
            assert body["usage"]["prompt_tokens"] == len(s.tokenizer.encode(prompt))
    finally:
        s.stop()


def test_bad_serve_keys_get_one_line():
    result = run_main("serve.py", "--out_dir=nowhere-at-all", "--port=1")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = run_main("serve.py", "--max_batch=0")
    assert result.returncode == 2 and "max_batch=0 must be >= 1" in result.stderr


def test_a_port_in_use_is_one_line_and_a_non_zero_exit(served_run):
    """uvicorn's failed bind ended only its thread: serve.py said it served, then exited 0. Now it binds
    first, before loading the model, and says why it cannot."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_main("serve.py", f"--out_dir={served_run}", f"--port={port}")
    assert result.returncode == 2 and result.stderr == (
        f"error: cannot listen on 127.0.0.1:{port}: the port is in use (another server?): stop it or give another --port\n")
    result = run_main("serve.py", f"--out_dir={served_run}", "--host=no-such-host.invalid")
    assert result.returncode == 2 and result.stderr.startswith("error: cannot listen on no-such-host.invalid:8000: unknown host")
    result = run_main("serve.py", f"--out_dir={served_run}", "--port=70000")
    assert result.returncode == 2 and result.stderr == "error: port=70000 must be in [0, 65535]\n"
    # port 0: every address localhost names listens on the one port the system chose
    sockets = serve.listen_on("localhost", 0)
    try:
        assert len({s.getsockname()[1] for s in sockets}) == 1 and sockets[0].getsockname()[1] > 0
        with socket.create_connection(("127.0.0.1", sockets[0].getsockname()[1]), timeout=5):
            pass  # accepted into the backlog: it listens
        with pytest.raises(__import__("configurator").ConfigError, match="the port is in use"):
            serve.listen_on("127.0.0.1", sockets[0].getsockname()[1])
    finally:
        for s in sockets:
            s.close()


def test_no_other_script_imports_fastapi_and_none_imports_torch_dynamo():
    """Every top-level module of the repository but serve.py imports without FastAPI or uvicorn (the list
    comes from the tree, so a new module is covered); the first one that brings them in is named. And none
    imports torch._dynamo, 2 s of every command line's start-up on a 2-core AMD EPYC (sample.py's one-line
    error took 5.6 s, now 3.2 s): a compiled run imports it when it compiles (attention.kernels.outside_compiled_graphs)."""
    scripts = sorted(path.stem for path in ROOT.glob("*.py") if path.name != "serve.py")
    scripts += sorted(path.parent.name for path in ROOT.glob("*/__init__.py"))  # packages (attention/)
    assert {"train", "model", "generate", "harness", "attention"} <= set(scripts)
    code = (f"import importlib, sys\nscripts = {scripts!r}\nfor name in scripts:\n    before = set(sys.modules)\n"
            "    importlib.import_module(name)\n    if 'fastapi' in sys.modules or 'uvicorn' in sys.modules:\n"
            "        print('importing', name, 'with', sorted(set(sys.modules) - before & set(scripts)))\n        break\n"
            "    if 'torch._dynamo' in sys.modules:\n        print('torch._dynamo: importing', name)\n        break\n"
            "else:\n    print('none')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "none", f"{result.stdout.strip()} brings in fastapi, uvicorn or torch._dynamo; {result.stderr}"


class DevTools:
    """Headless chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: it reads
    NUL-ended JSON commands on its fd 3 and writes replies and events on fd 4), as Puppeteer's pipe
    transport does: no websocket client needed."""

    def __init__(self, browser, profile):
        commands, self.commands = os.pipe()
        self.replies, replies = os.pipe()

        def on_fds_3_and_4():  # in the child, before exec
            os.dup2(commands, 3)
            os.dup2(replies, 4)

        self.process = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync", "about:blank"],
            preexec_fn=on_fds_3_and_4, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands)
        os.close(replies)
        self.ids, self.buffer = itertools.count(1), b""

    def call(self, method, session=None, **params):
        """The result of one command (events that come before its reply are skipped)."""
        id = next(self.ids)
        message = {"id": id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                chunk = os.read(self.replies, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"chromium closed its DevTools pipe (exit code {self.process.poll()})")
                self.buffer += chunk
            line, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(line)
            if reply.get("id") == id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def close(self):
        try:
            self.call("Browser.close")
        except (OSError, RuntimeError):
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        os.close(self.commands)
        os.close(self.replies)


def rendered_page(url, seconds=120):
    """The page's DOM once its stream has finished (its stats line says `finished: `), waited for in real
    time, or a skip without chromium. (--dump-dom dumped when the page's virtual time ran out, which went on
    while the stream's body arrived: on a slow machine mid-stream.)"""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs Debian's chromium where apt can)")
    with tempfile.TemporaryDirectory() as profile:
        devtools = DevTools(browser, profile)
        try:
            target = devtools.call("Target.createTarget", url=url)["targetId"]
            session = devtools.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            deadline, dom = time.time() + seconds, ""
            while time.time() < deadline:
                dom = devtools.call("Runtime.evaluate", session, expression="document.documentElement.outerHTML",
                                    returnByValue=True)["result"].get("value", "")
                if re.search(r'id="stats">[^<]*finished: ', dom):  # the rendered line, not the script's text
                    break
                time.sleep(0.1)
            return dom
        finally:
            devtools.close()


def html(text):
    return text.replace("&", "&amp;").replace("<", "&lt;")


def test_the_page_streams_in_a_headless_browser(server):
    dom = rendered_page(f"{server.url}/?prompt=The%20king&max_tokens=12&temperature=0&run=1")
    expected = "The king" + server.greedy("The king", 12)
    assert html(expected) in dom, dom[-2000:]
    assert re.search(r'id="stats">[^<]*finished: length</span>', dom)  # the page saw the stream end


def test_the_page_chats_with_a_chat_model(chat_server):
    dom = rendered_page(f"{chat_server.url}/?prompt=the%20king&max_tokens=8&temperature=0&run=1")
    reply = chat_py_reply(chat_server, [{"role": "user", "content": "the king"}], 8)
    assert html(f"you: the king\nmodel: {reply}") in dom, dom[-2000:]
    assert re.search(r'id="stats">[^<]*finished: (stop|length)</span>', dom)


# ---------------------------------------------------------------------------------------------------
# lm-evaluation-harness through the server = eval.py --tasks on the checkpoint


def test_lm_eval_local_completions_equals_eval_py(tmp_path, served_run, server):
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is an optional extra (requirements-eval.txt)")
    pytest.importorskip("transformers")
    import random

    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    import harness
    from conftest import WORDS

    # a multiple-choice task short enough that no request is cut to the 32-token context on either side
    rng = random.Random(1)
    rows = [{"context": " ".join(rng.choice(WORDS) for _ in range(2)).capitalize(),
             "choices": [rng.choice(WORDS) for _ in range(4)], "label": rng.randrange(4)} for _ in range(16)]
    rows = [r for r in rows if len(r["context"]) + 1 + max(map(len, r["choices"])) <= 30]
    (tmp_path / "served_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "served_mc.yaml").write_text(
        "task: served_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'served_mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{label}}\"\n"
        "metric_list:\n  - metric: acc\n")
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)  # (lm-eval's own: 16 s more)
    exported = run_main("export.py", f"--out_dir={served_run}", f"--hf_dir={tmp_path / 'hf'}")
    assert exported.returncode == 0, exported.stderr

    theirs = simple_evaluate(model="local-completions", tasks=["served_mc"], task_manager=manager, log_samples=True,
                             model_args={"base_url": server.url + "/v1/completions", "model": "tiny",
                                         "tokenizer": str(tmp_path / "hf"), "max_length": 32, "max_retries": 1},
                             verbosity="ERROR")
    lm = harness.GPTHarness(server.model, server.tokenizer, "cpu", batch_size=4,
                            context=torch.autocast("cpu", enabled=False))
    ours = harness.run_tasks(lm, ["served_mc"], task_manager=manager, log_samples=True)
    mine = {s["doc_id"]: s for s in ours["samples"]["served_mc"]}
    served = {s["doc_id"]: s for s in theirs["samples"]["served_mc"]}
    assert len(mine) == len(served) == len(rows) >= 8
    for doc_id, sample in mine.items():
        for (ll, greedy), (their_ll, their_greedy) in zip((r[0] for r in sample["resps"]),
                                                          (r[0] for r in served[doc_id]["resps"])):
            assert ll == pytest.approx(their_ll, abs=1e-4) and greedy == their_greedy
    assert ours["results"]["served_mc"]["acc,none"] == theirs["results"]["served_mc"]["acc,none"]


def test_a_reply_past_the_context_slides_as_sample_py_does(server):
    """block_size 32: a reply that takes the text past the context continues as model.generate (and
    sample.py) do, each step over the last 32 tokens, alone and in a batch whose rows cross the context
    at different steps; /v1/models gives the context as clients read it (vLLM's max_model_len)."""
    status, body = server.post({"prompt": "The king", "max_tokens": 60, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == server.greedy("The king", 60), body
    prompts = ["The king", "O heaven, the lord", "Sweet"]
    status, body = server.post({"prompt": prompts, "max_tokens": 40, "temperature": 0})
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert status == 200 and texts == [server.greedy(p, 40) for p in prompts]
    listed = json.loads(server.get("/v1/models"))
    assert listed["data"][0]["max_model_len"] == listed["data"][0]["context_length"] == 32


# ---------------------------------------------------------------------------------------------------
# Chat completions (a model fine-tuned on conversations: conftest's sft_run)


@pytest.fixture(scope="module")
def chat_server(sft_run):
    s = Server(sft_run, max_batch=4, max_queue=4)
    yield s
    s.stop()


def chat_py_reply(server, messages, max_tokens):
    """What chat.py answers to the conversation's last user turn (greedy), the earlier turns given."""
    from chat import Conversation

    conversation = Conversation(server.model, server.tokenizer, Sampling(temperature=0), 0)
    conversation.messages = messages[:-1]
    conversation.ids = server.tokenizer.render(messages[:-1])[0]
    return conversation.reply(messages[-1]["content"], max_tokens)


def test_openai_client_chat_completions_equal_chat_py(chat_server):
    openai = pytest.importorskip("openai", reason="the openai package is a test dependency (requirements-dev.txt)")
    client = openai.OpenAI(base_url=chat_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "the king"}, {"role": "assistant", "content": "the"},
                {"role": "user", "content": "love"}]  # 22 tokens and 8 new: within block_size 32, as chat.py keeps it
    expected = chat_py_reply(chat_server, messages, 8)
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == expected
    assert done.choices[0].finish_reason in ("stop", "length")
    newer = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=2)
    assert newer.choices[0].message.content == expected
    assert len(newer.choices[0].logprobs.content[0].top_logprobs) == 2
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("messages, param", [
    (None, "messages"),
    ([], "messages"),
    ([{"role": "robot", "content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "messages[1].content"),
    (["hi"], "messages[0]"),
])  # fmt: skip
def test_malformed_messages_get_400_naming_the_field(chat_server, messages, param):
    status, body = chat_server.post({"messages": messages, "max_tokens": 4}, path="/v1/chat/completions")
    assert status == 400 and body["error"]["param"] == param and param in body["error"]["message"]


def test_chat_completions_refuse_a_model_without_a_template(server):
    status, body = server.post({"messages": [{"role": "user", "content": "hi"}]}, path="/v1/chat/completions")
    assert status == 400 and "no chat template" in body["error"]["message"]
