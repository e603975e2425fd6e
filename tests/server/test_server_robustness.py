"""The server under bad input and bad clients, against a real uvicorn (tests/serverkit.py).

Covered: a table of bad requests (OpenAI-shaped 4xx naming the parameter), the API key,
cancellation (streaming, non-streaming, queued, during prefill) and 50 concurrent clients served
in FIFO order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from serverkit import (
    CTX,
    NAME,
    metric,
    metrics,
    wait_idle,
)
from starlette.testclient import TestClient

from expresslane.cli.serve import serving
from expresslane.engine import Engine
from expresslane.serve import create_app

USER = [{"role": "user", "content": "hi"}]
C, CH, X, U = "/v1/completions", "/v1/chat/completions", {"prompt": "x"}, {"messages": USER}
BAD = [  # (path, body, status, param, part of the message)
    (C, b"{not json", 400, None, "invalid JSON"),
    (C, b"[1, 2]", 400, None, "object"),
    (C, {"max_tokens": 1}, 400, "prompt", "Field required"),
    (C, {**X, "temperature": "hot"}, 400, "temperature", "number"),
    (C, {**X, "temperature": -1}, 400, "temperature", "equal to 0"),
    (C, {**X, "top_p": 0}, 400, "top_p", "greater than 0"),
    (C, {**X, "top_k": -2}, 400, "top_k", "-1"),
    (C, {**X, "min_p": 2}, 400, "min_p", "1"),
    (C, {**X, "max_tokens": -1}, 400, "max_tokens", "0"),
    (C, {**X, "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    (C, {**X, "n": 0}, 400, "n", "1"),
    (C, {**X, "logprobs": 21}, 400, "logprobs", "20"),
    (C, {**X, "stream": "maybe"}, 400, "stream", "boolean"),
    (C, {**X, "seed": "abc"}, 400, "seed", "integer"),
    (C, {**X, "stop": 5}, 400, "stop", "string"),
    (C, {"prompt": []}, 400, "prompt", "at least one token"),
    (C, {"prompt": [1, "a"]}, 400, "prompt", "token ids"),
    (C, {"prompt": [5, 99999]}, 400, "prompt", "outside the vocabulary"),
    (C, {"prompt": [-1]}, 400, "prompt", "outside the vocabulary"),
    (C, {"prompt": [5] * CTX}, 400, "prompt", "context"),
    (C, {**X, "stop_token_ids": [10**6]}, 400, "stop_token_ids", "vocabulary"),
    (C, {**X, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    (C, {**X, "allowed_token_ids": []}, 400, "allowed_token_ids", "at least 1"),
    (C, {**X, "allowed_token_ids": [10**6]}, 400, "allowed_token_ids", "vocabulary"),
    (C, {**X, "bad_words": [3]}, 400, "bad_words", "string"),
    (C, {**X, "model": "gpt-9"}, 404, "model", "does not exist"),
    (CH, {"messages": []}, 400, "messages", "at least 1"),
    (CH, {"messages": "hi"}, 400, "messages", "array"),
    (CH, {"messages": [{"content": "hi"}]}, 400, "messages", "role"),
    (CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages", "wizard"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages",
     "image_url"),
    (CH, {**U, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CH, {**U, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", "20"),
    (CH, {**U, "max_completion_tokens": 0}, 400, "max_completion_tokens", "1"),
    (CH, {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages", "context"),
    (CH, {**U, "model": "nope"}, 404, "model", "nope"),
    ("/tokenize", {}, 400, "prompt", "required"),
    ("/detokenize", {"tokens": [99999]}, 400, "tokens", "vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "array"),
    ("/v1/nothing", {}, 404, None, "Not Found"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), BAD,
                         ids=[f"{b[0]}:{b[3]}:{i}" for i, b in enumerate(BAD)])  # fmt: skip
def test_bad_request(server, path, body, status, param, message):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={"Content-Type": "application/json"}, **kw)
    err = r.json()["error"]
    assert (r.status_code, err["param"], err["code"]) == (status, param, status), err
    assert message in err["message"] and err["type"]


def test_client_sees_openai_errors_and_server_survives(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.cmpl(prompt="x", temperature=-3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        server.chat(messages=USER, model="nope")
    assert httpx.get(server.url + "/health").status_code == 200


def test_api_key_guards_v1_only(server):
    app = create_app(server.engine, server.tok, served_model_name=NAME, api_key="sekret")
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        bad = c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
    app.state.service.worker.shutdown()


LONG = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


class Slow:
    """The model at a fixed pace (so that tests about time are not races), counting calls."""

    def __init__(self, model, seconds: float):
        self.model, self.seconds, self.calls = model, seconds, []

    def __call__(self, *args, **kw):
        self.calls.append(time.monotonic())
        time.sleep(self.seconds)
        return self.model(*args, **kw)


@contextlib.contextmanager
def slow_server(server, seconds: float, **engine_kw):
    """A second server over the same weights whose every forward call takes `seconds`."""
    engine = Engine(server.engine.model, max_model_len=CTX, **engine_kw)
    engine.model = slow = Slow(engine.model, seconds)
    app = create_app(engine, server.tok, served_model_name=NAME)
    with serving(app) as url:
        yield SimpleNamespace(url=url, calls=slow.calls)


def test_client_closing_a_stream_frees_the_engine(server):
    with slow_server(server, 0.02) as s:  # 50 tokens/s: 200 tokens would take 4 s
        body = {**LONG, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
        wait_idle(s)
        m = metrics(s)
        nxt = httpx.post(s.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2})
    assert metric(m, "generation_tokens_total") < 100  # far from the 200 asked for
    assert metric(m, "request_success_total", finished_reason="abort") == 1
    assert nxt.json()["usage"]["completion_tokens"] >= 1


@contextlib.contextmanager
def posted(base: str, body: dict, until):
    """A client that POSTs `body` to /v1/completions and hangs up once `until()` holds.

    It leaves on an event, not after a fixed time: on a loaded machine a request may not reach
    the engine within any fixed time.
    """
    data, url = json.dumps(body).encode(), httpx.URL(base)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
    with socket.create_connection((url.host, url.port)) as conn:
        conn.sendall(f"{head}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        deadline = time.monotonic() + 60
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        yield


def test_client_gone_non_streaming_and_while_queued(server):
    with slow_server(server, 0.02) as s:  # 50 tokens/s: 200 tokens would take 4 s
        queued = lambda: metric(metrics(s), "num_requests_waiting") == 1  # noqa: E731
        with posted(s.url, LONG, lambda: s.calls), posted(s.url, LONG, queued):
            pass  # the second leaves while queued, then the first while running
        wait_idle(s)
        m = metrics(s)
    assert metric(m, "request_success_total", finished_reason="abort") == 2
    assert metric(m, "generation_tokens_total") < 150  # far from the 400 asked for


def test_client_gone_during_prefill_stops_it_between_chunks(server):
    # a 128-token prompt in 8-token chunks at 0.1 s each: 16 prefill chunks, 1.6 s
    with slow_server(server, 0.1, prefill_chunk=8) as s:
        with posted(s.url, {"prompt": list(range(3, 131)), "max_tokens": 4}, lambda: s.calls):
            pass
        gone = time.monotonic()
        wait_idle(s)
        m = metrics(s)
    calls = s.calls
    assert 1 <= len(calls) < 16 and sum(t > gone for t in calls) <= 1  # one chunk at most
    assert metric(m, "generation_tokens_total") == 0
    assert metric(m, "request_success_total", finished_reason="abort") == 1


def test_fifty_concurrent_clients_all_served_in_order(server):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 40, (50,), generator=g).tolist()
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    worker = server.app.state.service.worker

    async def one(client, i):
        body = {"prompt": prompts[i], "max_tokens": 1 + i % 4, "temperature": 0, "echo": True}
        r = await client.post("/v1/completions", json=body)
        return r.status_code, r.json()

    async def main():
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    start = len(worker.served)
    results = asyncio.run(main())
    assert [status for status, _ in results] == [200] * 50
    for i, (_, out) in enumerate(results):
        assert out["usage"]["prompt_tokens"] == len(prompts[i])
        assert 1 <= out["usage"]["completion_tokens"] <= 1 + i % 4
        assert out["choices"][0]["text"].startswith(server.tok.decode(prompts[i]))
    order = list(worker.served)[start:]
    assert len(order) == 50 and order == sorted(order)  # FIFO: served in arrival order
    wait_idle(server)
