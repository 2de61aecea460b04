"""`pocket serve` end to end: a real server process on an ephemeral port with a real model
(smollm2-135m, the engine's default settings), driven by the real `openai` client and by raw
HTTP for what a client library would never send.

Answers are checked against the library's own generation in this process (same engine
settings) and against the server's one-request-at-a-time answers under load; the scheduler's
counters (/health) show that batching, prefix reuse and cancellation really happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
pytestmark = pytest.mark.real


class Server:
    """`pocket serve` in a subprocess; ``url`` once it listens."""

    def __init__(self, *args: str, env: dict | None = None):
        e = {k: v for k, v in os.environ.items() if k != "POCKET_ACT"}  # the engine's default
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pocketlm.cli", "serve", "-m", MODEL, "--port", "0", *args],
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=e)
        self.log: list[str] = []
        deadline = time.time() + 120
        self.url = None
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"(http://[\d.]+:\d+)/  \(OpenAI", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.log)
                               + self.proc.stderr.read())
        # keep draining stderr so the server never blocks on a full pipe
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stderr],
                         daemon=True).start()

    def client(self, **kw) -> openai.OpenAI:
        kw.setdefault("api_key", "unused")
        kw.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def peak_rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmHWM")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def local(monkeypatch_module):
    """The library in this process, with the server's engine settings."""
    import pocketlm

    monkeypatch_module.delenv("POCKET_ACT", raising=False)
    return pocketlm.load(MODEL)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


QUESTIONS = ["What is the capital of France?", "Name three primary colors.",
             "What is 2 + 3?", "Translate 'good morning' into French."]


# -- the OpenAI client ----------------------------------------------------------------------

def test_models_and_health(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"
    h = server.health()
    assert h["status"] == "ok" and h["model"] == MODEL and h["engine"] == "native"


def test_chat_matches_the_library_and_counts_usage(server, local):
    c = server.client()
    for q in QUESTIONS[:2]:
        msgs = [{"role": "user", "content": q}]
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=40, temperature=0)
        expected = local.chat(msgs, max_tokens=40, temperature=0)
        state = local.last_state
        assert r.choices[0].message.content == expected
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == ("stop" if state.finish_reason == "stop"
                                              else "length")
        assert r.usage.prompt_tokens == len(local.chat_ids(msgs))
        assert r.usage.completion_tokens == len(state.generated)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "chat.completion" and r.model == MODEL


def test_long_prompt_prefilled_in_chunks_matches_the_library(server, local):
    # ~900 tokens: several prefill chunks, while another request streams
    text = (Path(__file__).parent / "data" / "english.txt").read_text(encoding="utf-8")
    prompt = (text * 4)[:4000]
    c = server.client(timeout=120)
    with ThreadPoolExecutor(2) as pool:
        other = pool.submit(lambda: c.completions.create(model=MODEL, prompt="Hello, my name is",
                                                         max_tokens=40, temperature=0))
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert other.result().usage.completion_tokens == 40
    assert r.usage.prompt_tokens == len(local.tokenize(prompt)) > 600
    assert r.choices[0].text == local.generate(prompt, max_tokens=8, temperature=0)


def test_streaming_chat_equals_the_whole_answer(server):
    c = server.client()
    msgs = [{"role": "user", "content": QUESTIONS[1]}]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, temperature=0)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=30,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == whole.choices[0].finish_reason and set(finish[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    pieces = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) > 5  # streamed as it was generated, not in one piece
    # without stream_options there is no usage chunk
    plain = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                           temperature=0, stream=True))
    assert all(ch.usage is None and ch.choices for ch in plain)


def test_completions_plain_and_streaming(server, local):
    c = server.client()
    prompt = "The capital of France is"
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == local.generate(prompt, max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(local.tokenize(prompt))
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert streamed == r.choices[0].text
    # OpenAI's default for completions is 16 tokens
    assert c.completions.create(model=MODEL, prompt=prompt, temperature=0).usage \
        .completion_tokens == 16


def test_stop_strings_cut_the_answer(server):
    c = server.client()
    prompt = "Count: one, two, three, four, five, six,"
    full = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    text = full.choices[0].text
    assert "," in text.strip()
    stop = text.strip()[text.strip().index(",") :]  # from the first comma of the answer
    cut = c.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                               stop=[stop[:2], "zzz"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop[:2])]
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=stop[:2], stream=True))
    assert streamed == cut.choices[0].text


def test_seeds_reproduce_samples(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=1.0)
    a = [c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)]
    b = [c.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)]
    assert a == b
    assert len(set(a)) > 1  # different seeds, different samples
    # OpenAI takes any int64 seed (a negative one was refused): -1 is no seed, as llama.cpp's
    # server and its clients read it; another negative seed is a seed (modulo 2**64), and
    # top_p 0 keeps the most likely token alone (it was refused)
    neg = [c.completions.create(seed=-5, **kw).choices[0].text for _ in range(2)]
    assert neg[0] == neg[1]
    unseeded = {c.completions.create(seed=-1, **kw).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1
    greedy = c.completions.create(**{**kw, "temperature": 0}).choices[0].text
    assert c.completions.create(seed=3, top_p=0, **kw).choices[0].text == greedy


# -- concurrency ----------------------------------------------------------------------------

def _prompts(n: int) -> list[str]:
    subjects = ["cats", "rivers", "the moon", "bread", "trains", "music", "winter", "bees",
                "the sea", "tea"]
    return [f"Fact {i} about {subjects[i % len(subjects)]}:" for i in range(n)]


def test_fifty_clients_at_once_each_get_their_own_answer(server):
    c = server.client(timeout=300)
    prompts = _prompts(50)
    kw = dict(model=MODEL, max_tokens=24, temperature=0)
    known = {p: c.completions.create(prompt=p, **kw).choices[0].text for p in prompts}
    before = server.health()

    def call(p):
        if prompts.index(p) % 2:
            return "".join(ch.choices[0].text
                           for ch in c.completions.create(prompt=p, stream=True, **kw))
        return c.completions.create(prompt=p, **kw).choices[0].text

    with ThreadPoolExecutor(50) as pool:
        got = dict(zip(prompts, pool.map(call, prompts)))
    assert got == known
    after = server.health()
    assert after["max_batch_seen"] > 4  # decoded together, not one after another
    assert 0.02 <= after["row_cost"] < 5  # learned from the steps' times and rows
    assert after["prefill_s"] > before["prefill_s"] and after["decode_s"] > before["decode_s"]
    assert after["completed"] - before["completed"] == 50
    assert after["running"] == 0 and after["waiting"] == 0 and after["kv_reserved_mb"] >= 0


def test_shared_system_prompt_is_reused(server, local):
    c = server.client()
    # where prefill runs on AMX tiles, a prefix is reused only with 16 or more prompt tokens
    # left to run (docs/serve.md), elsewhere to its last shared token
    system = ("You are a helpful assistant for a shopping app. Answer briefly, in one "
              "sentence, and never make up prices. " + " ".join(
                  f"Rule {i}: be kind to customer number {i}." for i in range(30)))
    before = server.health()
    answers = []
    for q in QUESTIONS:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        answers.append(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                                 temperature=0).choices[0].message.content)
        assert answers[-1] == local.chat(msgs, max_tokens=16, temperature=0)
    after = server.health()
    shared = len(local.tokenize(local.render_chat([{"role": "system", "content": system}])))
    left = 16 if getattr(getattr(local.runtime, "native", None), "amx", False) else 1
    assert after["prefix_hits"] - before["prefix_hits"] >= len(QUESTIONS) - 1
    reused = 0
    for q in QUESTIONS[1:]:
        n = len(local.chat_ids([{"role": "system", "content": system},
                                {"role": "user", "content": q}]))
        reused += min(shared - 2, n - left)
    assert after["prefix_tokens_reused"] - before["prefix_tokens_reused"] >= reused


def test_client_disconnect_cancels_and_frees(server):
    before = server.health()
    with httpx.Client(timeout=30) as http, http.stream(
            "POST", server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "A long story:", "max_tokens": 2000,
                  "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
    # the connection is closed: the request is cancelled and its cache freed
    deadline = time.time() + 20
    while time.time() < deadline:
        h = server.health()
        if h["cancelled"] > before["cancelled"] and h["running"] == 0:
            break
        time.sleep(0.1)
    assert h["cancelled"] == before["cancelled"] + 1 and h["running"] == 0
    assert h["completed"] == before["completed"]  # it did not run to its 2000 tokens
    assert server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage


# -- bad input from the wire ----------------------------------------------------------------

def _post(server, path, body=None, raw=None, headers=None):
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=30,
                      headers={"Content-Type": "application/json", **(headers or {})})


BAD = [  # (body or raw bytes, status, code, param)
    (b"{not json", 400, "invalid_json", None),
    (b"\xff\xfe", 400, "invalid_json", None),
    (b"[" * 200_000 + b"]" * 200_000, 400, "invalid_json", None),
    ([1, 2], 400, "invalid_type", None),
    ({"model": MODEL}, 400, "missing_required_parameter", "prompt"),
    ({"prompt": "x"}, 400, "missing_required_parameter", "model"),
    ({"model": MODEL, "prompt": 5}, 400, "invalid_type", "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "9"}, 400, "invalid_type", "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "invalid_value", "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": -0.1}, 400, "invalid_value", "top_p"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "invalid_type", "stream"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "invalid_value", "n"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, 400, "unsupported_value", "best_of"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "invalid_value",
     "logit_bias"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"7": 101}}, 400, "invalid_value",
     "logit_bias.7"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": -3}, 400, "invalid_value",
     "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "invalid_value", "logprobs"),
    ({"model": MODEL, "prompt": [1, "a"]}, 400, "invalid_type", "prompt"),
    ({"model": MODEL, "prompt": "x", "stop": [1]}, 400, "invalid_type", "stop"),
    ({"model": MODEL, "prompt": "x", "seed": -2**63 - 1}, 400, "invalid_value", "seed"),
    ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "unknown_parameter", "bogus"),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "model_not_found", "model"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "context_length_exceeded",
     "max_tokens"),
    ({"model": MODEL, "prompt": "word " * 5000}, 400, "context_length_exceeded", "prompt"),
    ({"model": MODEL, "prompt": "x", "speculative": "medusa"}, 400, "unsupported_value",
     "speculative"),
    ({"model": MODEL, "prompt": "x", "speculative": 3}, 400, "invalid_type", "speculative"),
    ({"model": MODEL, "prompt": "x", "speculative": {"max_draft": 0}}, 400, "invalid_value",
     "speculative.max_draft"),
    # the Python API's draft-model form: named as unsupported here, not as an unknown field
    ({"model": MODEL, "prompt": "x", "speculative": {"draft": "m"}}, 400, "unsupported_value",
     "speculative"),
    ({"model": MODEL, "prompt": "x", "speculative": {"bogus": 1}}, 400, "unknown_parameter",
     "speculative"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "invalid_value", "stream_options"),
]


@pytest.mark.parametrize("body,status,code,param", BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(server, body, status, code, param):
    r = _post(server, "/v1/completions", raw=body if isinstance(body, bytes) else None,
              body=None if isinstance(body, bytes) else body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["param"] == param and err["message"]


def test_unsupported_values_are_shown_as_json(server):
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 3})
    assert r.status_code == 400
    assert "'best_of' = 3 is not supported" in r.json()["error"]["message"]


def test_bad_chat_requests(server):
    for body, param in [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x", "x": 1}]}, "messages[0]"),
        # a name or refusal of another type was taken and ignored
        ({"model": MODEL, "messages": [{"role": "user", "content": "x", "name": 5}]},
         "messages[0].name"),
        ({"model": MODEL, "messages": [{"role": "assistant", "content": "x", "refusal": []}]},
         "messages[0].refusal"),
    ]:
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_transport_errors_and_the_server_keeps_serving(server):
    huge = _post(server, "/v1/completions", raw=b'{"model": "x", "prompt": "' + b"a" * 2_000_000
                 + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    # a body several times the limit: the server reads it to its end before the 413, else
    # closing with input unread resets the connection and the client never sees the error
    # (six at once from one client: one at a time, the reset rarely wins the race)
    async def six_at_once():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            body = b'{"prompt": "' + b"a" * 6_000_000 + b'"}'
            return await asyncio.gather(*[client.post(
                "/tokenize", content=body, headers={"Content-Type": "application/json"})
                for _ in range(6)], return_exceptions=True)
    for r in asyncio.run(six_at_once()):
        assert not isinstance(r, Exception), repr(r)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    # a client that waits for '100 Continue' has sent nothing: it gets the 413 at once
    url = httpx.URL(server.url)
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 900000000\r\nExpect: 100-continue\r\n\r\n")
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 413")
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage
    assert server.proc.poll() is None


def test_api_key():
    s = Server("--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert s.client(api_key="s3cret").completions.create(model=MODEL, prompt="Hi",
                                                             max_tokens=2).usage
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key
    finally:
        assert s.stop() == 0


def test_full_queue_gets_429_and_nothing_accepted_is_lost():
    s = Server("--max-batch", "1", "--max-queue", "1")
    try:
        body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 150, "temperature": 0}
        with ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120)
                    for _ in range(6)]
            results = [f.result() for f in futs]
        codes = sorted(r.status_code for r in results)
        assert codes.count(429) >= 1 and codes.count(200) >= 2, codes
        for r in results:
            if r.status_code == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
            else:  # every accepted request completed, with the same greedy answer
                assert r.json()["usage"]["completion_tokens"] == 150
        texts = {r.json()["choices"][0]["text"] for r in results if r.status_code == 200}
        assert len(texts) == 1
        h = s.health()
        assert h["completed"] == codes.count(200) and h["rejected"] == codes.count(429)
    finally:
        assert s.stop() == 0


def test_shutdown_ends_the_requests_in_flight_with_their_503_and_error_event():
    """SIGINT with requests running: after the grace period each ends with the shutdown's 503
    (JSON) or, streaming, an error event and the end of its body; before, uvicorn cancelled the
    handlers first: a plain-text 500, a stream cut mid-chunk, CancelledError tracebacks."""
    s = Server()
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True}
    got = {}

    def whole():
        got["whole"] = httpx.post(s.url + "/v1/completions", json=body, timeout=120)

    def streamed(first):
        with httpx.Client(timeout=120) as http, http.stream(
                "POST", s.url + "/v1/completions", json={**body, "stream": True}) as r:
            lines = []
            for line in r.iter_lines():  # raises if the body is cut before its end
                lines.append(line)
                first.set()
            got["stream"] = (r.status_code, lines)

    first = threading.Event()
    threads = [threading.Thread(target=whole), threading.Thread(target=streamed, args=(first,))]
    for t in threads:
        t.start()
    try:
        assert first.wait(60)
        time.sleep(0.5)
        t0 = time.time()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(30) == 0
        took = time.time() - t0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    for t in threads:
        t.join(30)
    assert 4 < took < 9, took  # the grace period, then the requests' errors, then the exit
    r = got["whole"]
    assert r.status_code == 503 and r.headers["Retry-After"] == "5"
    assert r.json()["error"]["code"] == "shutting_down"
    status, lines = got["stream"]
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert status == 200 and events[0]["choices"] and events[-1]["error"]["code"] == "shutting_down"
    log = "".join(s.log)
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_memory_budget_bounds_the_process():
    budget = 260  # MB: weights and buffers ~200 MB; a 2000-token cache ~45 MB
    s = Server("--max-memory-mb", str(budget), "--prefix-cache-mb", "0")
    try:
        h = s.health()
        kv_budget = h["kv_budget_mb"]
        assert 16 <= kv_budget < budget
        per_req = kv_budget / 3  # each of these requests needs about a third of it
        tokens = int(per_req * 2**20 / (2 * 30 * 3 * 64 * 2)) - 10  # smollm2: f16 KV
        body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": tokens,
                "temperature": 0}
        # one request that can never fit is refused outright
        r = httpx.post(s.url + "/v1/completions", timeout=30,
                       json={**body, "max_tokens": 4000})
        assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"]
        # eight that fit three at a time: they wait, then all complete
        with ThreadPoolExecutor(8) as pool:
            rs = list(pool.map(lambda _: httpx.post(s.url + "/v1/completions", json=body,
                                                    timeout=300), range(8)))
        assert [r.status_code for r in rs] == [200] * 8
        h = s.health()
        assert h["max_batch_seen"] <= 3 and h["kv_reserved_mb"] == 0
        assert s.peak_rss_mb() <= budget, (s.peak_rss_mb(), h)
    finally:
        assert s.stop() == 0


def test_budget_too_small_to_start():
    r = subprocess.run([sys.executable, "-m", "pocketlm.cli", "serve", "-m", MODEL,
                        "--max-memory-mb", "50", "--port", "0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("pocket: error: --max-memory-mb 50 is too small")


# -- the chat page in headless Chromium ------------------------------------------------------

ARTIFACTS = Path(os.environ.get("POCKET_TEST_ARTIFACTS", Path(__file__).parent.parent / "build"
                                / "test-artifacts"))


def _chromium() -> str:
    for name in ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"):
        if Path(name).exists():
            return name
    raise AssertionError("no Chromium found: install Debian's `chromium` (make test does)")


def test_chat_page_streams_an_answer_in_chromium(server, local):
    from playwright.sync_api import sync_playwright

    question = "What is the capital of France? 请用一句话回答。"
    expected = local.chat([{"role": "user", "content": question}], max_tokens=64,
                          temperature=0)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes("
                                   f"'{MODEL}')")
            page.fill("#max", "64")
            page.fill("#input", question)
            page.keyboard.press("Enter")
            # the answer grows while streaming, then is marked done
            # (a screen reader hears it once whole: busy while it streams, in a log region)
            page.wait_for_selector(".assistant[data-streaming][aria-busy=true]", timeout=30000)
            page.wait_for_selector(".assistant[data-done]", timeout=120000)
            assert page.get_attribute(".assistant", "aria-busy") is None
            assert page.get_attribute("#log", "role") == "log"
            answer = page.inner_text(".assistant")
            asked = page.inner_text(".user")
            stats = page.inner_text("#stats")
            page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)
            # the stop button ends a long answer mid-stream; the server cancels it
            before = server.health()
            page.click("#clear")
            page.fill("#max", "2000")
            page.fill("#input", "Write a very long story about a dragon.")
            page.keyboard.press("Enter")
            page.wait_for_function("document.querySelector('.assistant') && "
                                   "document.querySelector('.assistant').textContent.length > 40")
            page.click("#stop")
            page.wait_for_selector(".assistant[data-done]", timeout=30000)
            stopped = page.inner_text("#stats")
            assert page.is_enabled("#send") and not page.is_enabled("#stop")
            # a failed turn is shown faded, its text back in the box, and never sent again
            # (it stayed in the conversation, with an empty answer, and went out every time)
            sent = []
            page.on("request", lambda r: sent.append(json.loads(r.post_data))
                    if r.url.endswith("/v1/chat/completions") else None)
            page.fill("#max", "100000")
            page.fill("#input", "Hello?")
            page.keyboard.press("Enter")
            page.wait_for_selector(".error", timeout=30000)
            failed = page.inner_text(".user.failed")
            restored = page.input_value("#input")
            error = page.inner_text(".error")
            page.fill("#max", "4")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.assistant[data-done]')"
                                   ".length === 3", timeout=60000)
        finally:
            browser.close()
    deadline = time.time() + 20
    while server.health()["cancelled"] == before["cancelled"] and time.time() < deadline:
        time.sleep(0.1)
    after = server.health()
    assert after["cancelled"] == before["cancelled"] + 1 and after["running"] == 0
    assert "stopped" in stopped
    assert answer.strip() == expected.strip()
    assert asked == question  # the Chinese text went through the page unchanged
    assert re.search(r"tokens/s", stats), stats
    assert failed == "Hello?" and restored == "Hello?" and "context length" in error
    # the stopped answer's exchange stays (it had text), the failed one does not
    assert [m["role"] for m in sent[-1]["messages"]] == ["user", "assistant", "user"], sent
    assert sent[-1]["messages"][-1]["content"] == "Hello?"


# -- speculative decoding -------------------------------------------------------------------

GROUNDED = ("The city council met on Tuesday to discuss the new budget. Mayor Linda Park said "
            "the budget would add 12 new buses and repair the Main Street bridge. Council "
            "member Tom Reyes asked how the buses would be paid for. The vote is on March 3.")


def test_the_servers_draft_max_is_a_requests_default_and_its_cap():
    from pocketlm.server.app import ServerConfig, request_speculative

    default = ServerConfig(model_name="m", speculative="lookup", draft_max=4).speculative
    lookup = {"method": "lookup"}
    assert request_speculative(default, None) == {"method": "lookup", "max_draft": 4}
    assert request_speculative(default, lookup) == {"method": "lookup", "max_draft": 4}
    assert request_speculative(default, {**lookup, "max_draft": 16, "max_ngram": 3}) == \
        {"method": "lookup", "max_draft": 4, "max_ngram": 3}
    assert request_speculative(default, {**lookup, "max_draft": 2})["max_draft"] == 2
    assert request_speculative(default, False) is None
    # a server without --speculative: a request drafts as it asks (max_draft default 8)
    assert request_speculative(None, None) is None
    assert request_speculative(None, {**lookup, "max_draft": 16}) == {**lookup, "max_draft": 16}


def test_speculative_requests_get_the_same_answers_alone_and_batched(server, local):
    """Per request ('speculative': 'lookup') and as the server default (--speculative lookup):
    the answers equal plain decoding's (the library's), one client or several at once."""
    asks = [f"Repeat this text exactly:\n\n{GROUNDED}",
            f"List the people named in this text:\n\n{GROUNDED}",
            *QUESTIONS[:2]]
    msgs = [[{"role": "user", "content": a}] for a in asks]
    want = [local.chat(m, max_tokens=64, temperature=0) for m in msgs]
    c = server.client(timeout=300)

    def ask(m, **extra):
        return c.chat.completions.create(model=MODEL, messages=m, max_tokens=64,
                                         temperature=0, extra_body=extra
                                         ).choices[0].message.content

    before = server.health()
    assert [ask(m, speculative="lookup") for m in msgs] == want
    after = server.health()  # the drafts' acceptance, over every request
    assert after["drafted"] > before["drafted"]
    assert 0 < after["accepted"] - before["accepted"] <= after["drafted"] - before["drafted"]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda m: ask(m, speculative={"max_draft": 4}), msgs)) == want
    default = Server("--speculative", "lookup", "--draft-max", "6")
    try:
        d = default.client(timeout=300)
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda m: d.chat.completions.create(
                model=MODEL, messages=m, max_tokens=64, temperature=0
            ).choices[0].message.content, msgs))
        assert got == want
        # the batched steps' speculative tokens/s, measured with drafts and without
        gate = default.health()["draft_gate"]
        assert gate and all(set(v) <= {"drafting", "plain"} and all(r > 0 for r in v.values())
                            for v in gate.values())
        off = d.chat.completions.create(model=MODEL, messages=msgs[0], max_tokens=64,
                                        temperature=0, extra_body={"speculative": False})
        assert off.choices[0].message.content == want[0]
    finally:
        assert default.stop() == 0


# -- structured output and tool calls ------------------------------------------------------

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 40}},
                                          "required": ["city"]}}}]


def test_response_format_parses_with_the_real_client_and_matches_the_library(server, local):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        city: str

    c = server.client(timeout=300)
    msgs = [{"role": "user", "content": "Li Wei is 34 and lives in Beijing. Give JSON."}]
    r = c.chat.completions.parse(model=MODEL, messages=msgs, response_format=Person,
                                 max_tokens=80, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and r.choices[0].finish_reason == "stop"
    want = local.chat(msgs, max_tokens=80, temperature=0,
                      json_schema=Person.model_json_schema() | {"additionalProperties": False})
    assert Person.model_validate_json(want) == parsed
    # json_object, streamed, on completions too; several at once with plain requests
    def obj(i):
        return c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTIONS[i % 4]}],
            max_tokens=48, temperature=0.8, seed=i,
            response_format={"type": "json_object"} if i % 2 == 0 else None)
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(obj, range(6)))
    for i, a in enumerate(answers):
        if i % 2 == 0 and a.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(a.choices[0].message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = c.completions.create(model=MODEL, prompt="Is the sky blue? JSON:", max_tokens=20,
                             extra_body={"response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "a",
                                                                             "schema": schema}}})
    assert json.loads(r.choices[0].text)["answer"] in ("yes", "no")
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=80, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {
            "name": "p", "schema": Person.model_json_schema() | {"additionalProperties": False},
            "strict": True}}) if ch.choices]
    assert Person.model_validate_json("".join(pieces)) == parsed


def test_tool_calls_round_trip_with_the_real_client(server):
    c = server.client(timeout=300)
    ask = [{"role": "user", "content": "What's the weather in Paris, in Celsius?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = c.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER,
                                      tool_choice=choice, max_tokens=80, temperature=0)
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.content is None
        call = m.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.id.startswith("call_") and call.type == "function"
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        assert set(args) <= {"city", "unit"} and "city" in args
    stream = c.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER,
                                       tool_choice="required", max_tokens=80, temperature=0,
                                       stream=True)
    chunks = [ch for ch in stream if ch.choices]
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert deltas and deltas[0].function.name == call.function.name
    assert json.loads(deltas[0].function.arguments) == args
    assert not any(ch.choices[0].delta.content for ch in chunks)
    # log-probabilities of a call's tokens: streamed as whole (the held ones were dropped)
    whole, parts = (c.chat.completions.create(
        model=MODEL, messages=ask, tools=WEATHER, tool_choice="required", max_tokens=80,
        temperature=0, logprobs=True, stream=s) for s in (False, True))
    want = [e.token for e in whole.choices[0].logprobs.content]
    assert want and whole.choices[0].finish_reason == "tool_calls"
    assert [e.token for ch in parts if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content or []] == want
    # the result goes back; "none" answers in text (and may not call)
    follow = ask + [m.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    r = c.chat.completions.create(model=MODEL, messages=follow, tools=WEATHER,
                                  tool_choice="none", max_tokens=30, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # "auto" on a question no tool answers: free text, streamed as content
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write one sentence about cats."}],
        tools=WEATHER, max_tokens=30, temperature=0, stream=True) if ch.choices]
    assert "".join(pieces).strip() and not "".join(pieces).lstrip().startswith("{")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"not": {}}}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    # a schema or a key the server would ignore, and wrong types beside the schema
    ({"response_format": {"type": "json_object", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": 5, "schema": {}}}}, "response_format.json_schema.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "strin"}}}]}, "tools[0].function.parameters"),
    # no finite value fits either: the answer would nest until max_tokens
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}]},
     "tools[0].function.parameters"),
    # a call's arguments are an object: a string schema gave arguments of JSON text in text
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": WEATHER, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": WEATHER, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_schemas_and_tools_get_400_naming_the_field(server, extra, param):
    r = _post(server, "/v1/chat/completions",
              {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
               "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = _post(server, "/v1/chat/completions",
               {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2})
    assert ok.status_code == 200


# -- the rest of the OpenAI surface: logprobs, echo, n, logit_bias, penalties ----------------

def _log_softmax(x):
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def test_prompt_scoring_with_echo_equals_the_models_logits(server, local):
    c = server.client(timeout=300)
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = local.tokenize(prompt)
    want = [_log_softmax(row) for row in local.logits(ids)]
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i - 1][ids[i]]) < 1e-3
        best = sorted(range(len(want[i - 1])), key=lambda t: -want[i - 1][t])[:3]
        assert list(lp.top_logprobs[i].values()) == pytest.approx(
            [want[i - 1][t] for t in best], abs=1e-3)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # token ids as the prompt, and an answer after it: the same scores, then the answer's
    r2 = c.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=1)
    scores = r2.choices[0].logprobs.token_logprobs
    assert scores[0] is None
    assert scores[1:len(ids)] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)
    assert r2.choices[0].text.startswith(prompt)
    assert len(r2.choices[0].logprobs.tokens) == len(ids) + r2.usage.completion_tokens
    # streamed: the same text and log-probabilities, the prompt's in the echo chunk
    got = {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in c.completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True,
                                   logprobs=1, stream=True):
        if ch.choices:
            got["text"] += ch.choices[0].text
            for key in ("tokens", "token_logprobs", "text_offset") * bool(
                    ch.choices[0].logprobs):
                got[key] += getattr(ch.choices[0].logprobs, key)
    whole = r2.choices[0].logprobs
    assert got["text"] == r2.choices[0].text and got["tokens"] == whole.tokens
    assert got["text_offset"] == whole.text_offset
    assert got["token_logprobs"][0] is None
    assert got["token_logprobs"][1:] == pytest.approx(whole.token_logprobs[1:], abs=1e-6)


def test_completion_offsets_count_characters_where_tokens_cut_them(server, local):
    """smollm2's byte-level pieces cut Chinese and Japanese characters: a piece that is part
    of one is named by its bytes, and text_offset counts characters of the text (it counted
    the replacement characters of pieces decoded alone: offsets past the text's end)."""
    c = server.client(timeout=300)
    prompt = "日本語の文章です。北京的天气很好"
    ids = local.tokenize(prompt)
    assert any("\ufffd" in local.tokenizer.token_bytes(i).decode("utf-8", "replace")
               for i in ids)  # the case in question: pieces that cut a character
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "echo": True,
          "logprobs": 2}
    whole = c.completions.create(**kw).choices[0]
    lp, text = whole.logprobs, whole.text
    assert len(lp.tokens) > len(ids) and text.startswith(prompt)
    joined = b""
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        raw = (bytes(int(h, 16) for h in token[6:].split("\\x")[1:])
               if token.startswith("bytes:") else token.encode())
        # a token starts at the characters its predecessors completed
        assert offset == len(joined.decode("utf-8", "ignore")) <= len(text)
        if not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token
        joined += raw
    assert joined.decode("utf-8") == text and any(t.startswith("bytes:") for t in lp.tokens)
    assert all("\ufffd" not in key for top in lp.top_logprobs[1:] for key in top)
    got = {"tokens": [], "text_offset": []}  # streamed: the same, a cut character included
    for ch in c.completions.create(**kw, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            for key in got:
                got[key] += getattr(ch.choices[0].logprobs, key)
    assert got == {"tokens": lp.tokens, "text_offset": lp.text_offset}


def test_chat_logprobs_and_several_choices(server, local):
    c = server.client(timeout=300)
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(x.token for x in content) == r.choices[0].message.content
    ids = local.chat_ids(msgs)
    first = _log_softmax(local.logits(ids)[-1])
    # greedy: the best; to 1e-3 where a prefill's products do not depend on how many rows
    # reach the last layer, 1e-2 where AMX prefills (its bfloat16 products for all rows here,
    # the int8 ones for the server's one row: 3e-3 apart, measured)
    amx = getattr(getattr(local.runtime, "native", None), "amx", False)
    assert content[0].logprob == pytest.approx(first.max(), abs=1e-2 if amx else 1e-3)
    assert content[0].top_logprobs[0].token == content[0].token
    streamed = [x.token for ch in c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, stream=True)
        if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert streamed == [x.token for x in content]
    # n choices: differ when sampled, reproducible with a seed, streamed by index
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, n=3,
                                  temperature=1.0, seed=4)
    texts = [ch.message.content for ch in r.choices]
    assert [ch.index for ch in r.choices] == [0, 1, 2] and len(set(texts)) > 1
    assert r.usage.prompt_tokens == len(ids)
    again = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, n=3,
                                      temperature=1.0, seed=4)
    assert [ch.message.content for ch in again.choices] == texts
    got: dict[int, str] = {}
    for ch in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, n=3,
                                        temperature=1.0, seed=4, stream=True):
        for choice in ch.choices:
            got[choice.index] = got.get(choice.index, "") + (choice.delta.content or "")
    assert [got[i] for i in range(3)] == texts
    r = c.completions.create(model=MODEL, prompt=["One two", "Red green"], max_tokens=3, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]


def test_logprobs_leave_out_the_stop_string(server):
    """With a stop string, the log-probabilities cover the answer's tokens and none of the stop
    string's, streamed or not (llama.cpp leaves them out too)."""
    c = server.client(timeout=300)
    args = dict(model=MODEL, prompt="The days of the week are", max_tokens=16, temperature=0,
                logprobs=1)
    tokens = c.completions.create(**args).choices[0].logprobs.tokens
    whole = "".join(tokens)
    cut = next(i for i in range(3, len(tokens) - 2) if tokens[i].strip()
               and whole.find("".join(tokens[i:i + 2])) == len("".join(tokens[:i])))
    stop = "".join(tokens[cut:cut + 2])
    r = c.completions.create(**args, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == "".join(tokens[:cut])
    assert r.choices[0].logprobs.tokens == tokens[:cut]
    streamed = [t for ch in c.completions.create(**args, stop=[stop], stream=True)
                if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.tokens]
    assert streamed == tokens[:cut]
    msgs = [{"role": "user", "content": "List three colours."}]
    chat = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True)
    content = c.chat.completions.create(**chat).choices[0].logprobs.content
    pieces = [x.token for x in content]
    cut = next(i for i in range(2, len(pieces) - 1) if pieces[i].strip()
               and "".join(pieces).find(pieces[i]) == len("".join(pieces[:i])))
    r = c.chat.completions.create(**chat, stop=[pieces[cut]])
    assert r.choices[0].message.content == "".join(pieces[:cut])
    assert [x.token for x in r.choices[0].logprobs.content] == pieces[:cut]
    streamed = [x.token for ch in c.chat.completions.create(**chat, stop=[pieces[cut]],
                                                            stream=True)
                if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert streamed == pieces[:cut]


def test_logit_bias_and_penalties(server, local):
    c = server.client(timeout=300)
    forced = local.tokenize(" capital")[0]
    r = c.completions.create(model=MODEL, prompt="Paris is the", max_tokens=3, temperature=0,
                             logit_bias={str(forced): 100})
    assert r.choices[0].text == " capital" * 3
    plain = c.completions.create(model=MODEL, prompt="one one one one", max_tokens=16,
                                 temperature=0).choices[0].text
    penalised = c.completions.create(model=MODEL, prompt="one one one one", max_tokens=16,
                                     temperature=0, frequency_penalty=2.0).choices[0].text
    present = c.completions.create(model=MODEL, prompt="one one one one", max_tokens=16,
                                   temperature=0, presence_penalty=2.0).choices[0].text
    assert penalised != plain and present != plain
    for text in (penalised, present):  # no token of the answer more than a few times
        ids = local.tokenize(text, add_bos=False)
        assert max(ids.count(t) for t in set(ids)) <= 4


def test_tokenizer_endpoints(server, local):
    info = httpx.get(server.url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == local.tokenizer.id_to_token(local.tokenizer.eos_ids[0])
    text = "Hello, 世界! def f(x): return x"
    r = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == local.tokenize(text, add_bos=False) and r["count"] == len(r["tokens"])
    msgs = [{"role": "user", "content": "hi"}]
    assert _post(server, "/tokenize", {"messages": msgs}).json()["tokens"] == \
        local.chat_ids(msgs)
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == text
    for path, body, param in [("/tokenize", {"prompt": 3}, "prompt"),
                              ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
                              ("/detokenize", {"tokens": [10**9]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": 5}, "model"),
                              ("/detokenize", {"tokens": [1], "model": ["x"]}, "model")]:
        bad = _post(server, path, body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    # the model named is the one served, as on /v1 (another was answered with this tokenizer)
    assert _post(server, "/tokenize", {"prompt": "x", "model": MODEL}).status_code == 200
    for path, body in [("/tokenize", {"prompt": "x", "model": "gpt-4o"}),
                       ("/detokenize", {"tokens": [1], "model": "gpt-4o"})]:
        bad = _post(server, path, body)
        assert bad.status_code == 404 and bad.json()["error"]["code"] == "model_not_found"


def test_a_seeded_sampled_answer_does_not_change_once_its_prompt_is_cached(server):
    """On a CPU whose prefill logits depend on how a prompt is cut into calls (AMX: blocks of
    16 or more tokens on bfloat16 tiles, shorter ones on int8), the second identical seeded
    request reused the first one's cached prompt and ran its last token alone: another answer
    (the first choice of three changed). Prefixes are reused only where a fresh prefill cuts."""
    body = {"model": MODEL, "max_tokens": 12, "temperature": 1.2, "seed": 7, "n": 3,
            "messages": [{"role": "user", "content": "Tell me a word about the sea."}]}
    first = _post(server, "/v1/chat/completions", body).json()
    again = _post(server, "/v1/chat/completions", body).json()
    texts = [[c["message"]["content"] for c in r["choices"]] for r in (first, again)]
    assert texts[0] == texts[1], texts


def test_a_second_ctrl_c_ends_the_requests_at_once_without_a_traceback():
    """A second SIGINT cut the requests in flight at once, and uvicorn logged a CancelledError
    traceback from the app's lifespan, which the second signal cancelled mid-shutdown."""
    s = Server()
    body = {"model": MODEL, "prompt": "A long story:", "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    got, first = {}, threading.Event()

    def streamed():
        with contextlib.suppress(httpx.HTTPError), httpx.Client(timeout=120) as http, \
                http.stream("POST", s.url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                got.setdefault("stream", []).append(line)
                first.set()

    t = threading.Thread(target=streamed)
    t.start()
    try:
        assert first.wait(60)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(30) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    t.join(30)
    assert not t.is_alive()
    events = [json.loads(x[6:]) for x in got["stream"] if x.startswith("data: {")]
    assert events[-1]["error"]["code"] == "shutting_down"  # its handler had time to send it
    log = "".join(s.log)
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "server stopped" in log
