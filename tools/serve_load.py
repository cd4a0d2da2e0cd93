"""
Load and faults against serve.py: concurrent streaming clients with batching and one at a time, the queue
limit, clients killed mid-stream, a sweep of malformed requests, and a prompt that fills the context
arriving while 16 streams run. Starts the servers itself.

  python tools/serve_load.py --out_dir=out-shakespeare-char-cpu [--clients=32 --seconds=60 --max_tokens=64]

Prints the figures docs/benchmarks.md quotes and writes them with --json. Each client loops: a streamed
request of max_tokens tokens (greedy, from one of a few prompts), timing the first token and every later
one, until the time is up; a request that fails, or returns fewer tokens than asked, counts as failed.

  python tools/serve_load.py --out_dir=RUN --compare "packed:" "linear:SMALLGPT_BATCH_PRODUCT=linear" --rounds=3

compares servers instead (each NAME:KEY=VALUE,...: environment variables, or serve.py keys as --key=value):
the batched clients only, against each in turn, interleaved over --rounds (A, B, A, B, ...), medians, and
the median over rounds of the first variant's tokens/s and p95 over each other's.
"""

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["ROMEO:", "JULIET:\nO", "First Citizen:\n", "KING RICHARD III:\nNow is", "To be, or not", "MENENIUS:\n"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, out_dir, env=None, **keys):
        self.port = free_port()
        args = [sys.executable, "serve.py", f"--out_dir={out_dir}", f"--port={self.port}",
                *(f"--{k}={v}" for k, v in keys.items())]
        self.process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if self.get("/health")["status"] == "ok":
                    return
            except OSError:
                time.sleep(0.2)
            if self.process.poll() is not None:
                raise SystemExit(f"serve.py exited: {self.process.stderr.read()}")
        raise SystemExit("serve.py did not answer in 120 s")

    def get(self, path):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        connection.request("GET", path)
        return json.loads(connection.getresponse().read())

    def post(self, body, raw=None, timeout=120):
        """(status, parsed body or None)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        connection.request("POST", "/v1/completions", raw if raw is not None else json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, None

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def stream_one(port, prompt, max_tokens, timeout=300):
    """One streamed greedy request: (tokens, seconds to the first, gaps between the next ones) or raises."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, "stream": True, "logprobs": 0}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"status {response.status}")
    times, done = [], False
    for line in response:
        line = line.strip()
        if line == b"data: [DONE]":
            done = True
            break
        if line.startswith(b"data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"][0]["logprobs"]:  # one per token (logprobs=0 asks for the sampled token's only)
                times.append(time.perf_counter())
    connection.close()
    if not done or len(times) != max_tokens:
        raise RuntimeError(f"{len(times)} tokens of {max_tokens}, done={done}")
    return len(times), times[0] - start, [b - a for a, b in zip(times, times[1:])], times


def clients(port, n, seconds, max_tokens):
    """n clients streaming requests back to back for `seconds`: aggregate figures."""
    results, failures, lock = [], [], threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(i):
        k = 0
        while time.perf_counter() < stop_at:
            try:
                outcome = stream_one(port, PROMPTS[(i + k) % len(PROMPTS)], max_tokens)
                with lock:
                    results.append(outcome)
            except Exception as e:  # noqa: BLE001: counted, reported
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
            k += 1

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    tokens = sum(r[0] for r in results)
    first = sorted(r[1] for r in results)
    gaps = sorted(g for r in results for g in r[2])

    def pct(values, q):
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else None

    return {"clients": n, "seconds": wall, "requests": len(results), "failed": len(failures),
            "failures": failures[:5], "tokens": tokens, "tokens_per_sec": tokens / wall,
            "ttft_ms_p50": pct(first, 0.5), "ttft_ms_p95": pct(first, 0.95),
            "token_ms_p50": pct(gaps, 0.5), "token_ms_p95": pct(gaps, 0.95)}


def long_prompt(server, n, max_tokens):
    """n clients stream while a request whose prompt fills the model's context arrives: the longest gap
    between two tokens of a running stream while that prompt is prefilled, against the streams' p50."""
    context = server.get("/v1/models")["data"][0]["max_model_len"]
    streams, stop, lock = [], threading.Event(), threading.Lock()

    def client(i):
        while not stop.is_set():
            times = stream_one(server.port, PROMPTS[i % len(PROMPTS)], max_tokens)[3]
            with lock:
                streams.append(times)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(5)  # every stream running
    began = time.perf_counter()
    status, _ = server.post({"prompt": ("To be, or not to be: that is the question. " * context)[:context], "max_tokens": 1})
    ended = time.perf_counter()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    during = [b - a for times in streams for a, b in zip(times, times[1:]) if b > began and a < ended]
    others = sorted(b - a for times in streams for a, b in zip(times, times[1:]) if b <= began or a >= ended)
    p50 = others[len(others) // 2]
    return {"streams": n, "prompt_tokens": context, "status": status, "prompt_seconds": ended - began,
            "longest_gap_ms": max(during) * 1000, "streams_token_ms_p50": p50 * 1000,
            "longest_gap_vs_p50": max(during) / p50}


def killed_clients(server, n, max_tokens):
    """n streaming clients that vanish after their first chunk: rows freed, the next request at full speed."""
    sockets = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", server.port))
        body = json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True})
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        sockets.append(s)
    for s in sockets:
        s.recv(100)  # the headers and a first chunk
        s.close()
    start, running = time.perf_counter(), None
    while time.perf_counter() - start < 30:
        health = server.get("/health")
        running = health["running"] + health["waiting"]
        if running == 0:
            break
        time.sleep(0.05)
    freed = time.perf_counter() - start
    tokens, first, gaps, _ = stream_one(server.port, PROMPTS[0], max_tokens)
    return {"killed": n, "rows_left": running, "seconds_to_free": freed,
            "after_tokens_per_sec": (tokens - 1) / sum(gaps) if gaps else None}


def queue_limit(server, burst, max_tokens):
    """burst requests at once at a server with a small queue: every one answered (200 or 503), none hangs."""
    statuses, lock = [], threading.Lock()

    def one():
        try:
            status, body = server.post({"prompt": PROMPTS[0], "max_tokens": max_tokens}, timeout=120)
        except Exception as e:  # noqa: BLE001
            status = f"{type(e).__name__}"
        with lock:
            statuses.append(status)

    start = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"burst": burst, "ok": statuses.count(200), "busy_503": statuses.count(503),
            "other": [s for s in statuses if s not in (200, 503)], "seconds": time.perf_counter() - start}


def malformed(server):
    """Bad requests: each must get a 4xx, and the server must go on serving."""
    cases = {
        "bad JSON": (None, b"{\"prompt\": "), "not an object": ([1, 2], None), "prompt a number": ({"prompt": 5}, None),
        "max_tokens a string": ({"prompt": "ROMEO:", "max_tokens": "ten"}, None),
        "negative max_tokens": ({"prompt": "ROMEO:", "max_tokens": -5}, None),
        "huge max_tokens": ({"prompt": "ROMEO:", "max_tokens": 10**9}, None),
        "empty prompt": ({"prompt": ""}, None), "empty prompt list": ({"prompt": []}, None),
        "token id out of the vocabulary": ({"prompt": [[1, 2, 10**7]]}, None),
        "temperature a list": ({"prompt": "ROMEO:", "temperature": [1]}, None),
        "10 MB body": (None, json.dumps({"prompt": "a" * (10 << 20)})),
    }
    out = {}
    for name, (body, raw) in cases.items():
        try:
            status, _ = server.post(body, raw=raw, timeout=60)
        except Exception as e:  # noqa: BLE001
            status = f"{type(e).__name__}"
        out[name] = status
    out["still serving"] = server.post({"prompt": "ROMEO:", "max_tokens": 4})[0]
    return out


def variant(spec):
    """'NAME:KEY=VALUE,...' -> (name, environment variables, serve.py keys (written --key=value))."""
    name, _, rest = spec.partition(":")
    env, keys = {}, {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--compare {spec!r}: write NAME:KEY=VALUE,... (an empty list after the colon is allowed)")
        if key.startswith("--"):
            keys[key[2:]] = value
        else:
            env[key] = value
    return name, env, keys


def compare(a):
    """The batched phase against each variant in turn, interleaved over a.rounds: medians per variant."""
    variants = [variant(spec) for spec in a.compare]
    runs = {name: [] for name, _, _ in variants}
    if len(runs) != len(variants):
        raise SystemExit("--compare: give each variant a name of its own")
    for r in range(a.rounds):
        for name, env, keys in variants:
            server = ServeProcess(a.out_dir, env, **{"max_batch": a.max_batch, "max_queue": a.clients, **keys})
            try:
                stream_one(server.port, PROMPTS[0], a.max_tokens)  # warm up
                runs[name].append(clients(server.port, a.clients, a.seconds, a.max_tokens))
            finally:
                server.stop()
            out = runs[name][-1]
            print(f"round {r} {name}: {out['tokens_per_sec']:.0f} tokens/s, per-token p50 {out['token_ms_p50']} ms, "
                  f"p95 {out['token_ms_p95']} ms, failed {out['failed']}", flush=True)

    def median(outs, key):  # None where a round had no figure (every request failed)
        values = [out[key] for out in outs if out[key] is not None]
        return statistics.median(values) if values else None

    figures = {name: {key: median(outs, key) for key in ("tokens_per_sec", "token_ms_p50", "token_ms_p95", "ttft_ms_p50", "failed")}
               for name, outs in runs.items()}
    first = variants[0][0]
    for name in list(runs)[1:]:  # each round's pair, then the median of those ratios (the rounds' noise paired off)
        for key in ("tokens_per_sec", "token_ms_p95"):
            ratios = [a[key] / b[key] for a, b in zip(runs[first], runs[name]) if a[key] and b[key]]
            figures[name][f"{first}_over_this_{key}"] = statistics.median(ratios) if ratios else None
    for name, f in figures.items():
        print(name, json.dumps(f), flush=True)
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out_dir", required=True)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--max_batch", type=int, default=32)
    parser.add_argument("--json", default="")
    parser.add_argument("--compare", nargs="+", default=[], metavar="NAME:KEY=VALUE,...")
    parser.add_argument("--rounds", type=int, default=3, help="with --compare: interleaved rounds")
    a = parser.parse_args()
    figures = compare(a) if a.compare else load_and_faults(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(figures, f, indent=2)


def load_and_faults(a):
    """The default run: batched and one at a time, the faults, the queue limit."""
    figures = {}
    for name, batch in (("batched", a.max_batch), ("one_at_a_time", 1)):
        server = ServeProcess(a.out_dir, max_batch=batch, max_queue=a.clients)
        try:
            stream_one(server.port, PROMPTS[0], a.max_tokens)  # warm up
            figures[name] = clients(server.port, a.clients, a.seconds, a.max_tokens)
            print(name, json.dumps(figures[name]), flush=True)
            if name == "batched":
                figures["killed"] = killed_clients(server, 20, a.max_tokens)
                print("killed", json.dumps(figures["killed"]), flush=True)
                figures["malformed"] = malformed(server)
                print("malformed", json.dumps(figures["malformed"]), flush=True)
                figures["long_prompt"] = long_prompt(server, 16, a.max_tokens)
                print("long_prompt", json.dumps(figures["long_prompt"]), flush=True)
        finally:
            server.stop()
    figures["batched_vs_one_at_a_time"] = figures["batched"]["tokens_per_sec"] / figures["one_at_a_time"]["tokens_per_sec"]
    server = ServeProcess(a.out_dir, max_batch=4, max_queue=4)
    try:
        figures["queue_limit"] = queue_limit(server, 40, a.max_tokens)
        print("queue_limit", json.dumps(figures["queue_limit"]), flush=True)
    finally:
        server.stop()
    print(f"aggregate tokens/s, batched / one at a time: {figures['batched_vs_one_at_a_time']:.2f}x")
    return figures


if __name__ == "__main__":
    main()
