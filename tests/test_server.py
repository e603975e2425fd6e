"""The OpenAI-compatible server against a real uvicorn on 127.0.0.1, driven by the `openai` client.

One tiny random Laneformer serves the whole module. References come from a second Engine over the
same weights (its own cache), run only while the server is idle. Covered: completions and chat
(greedy equals the engine's greedy, seeds reproduce the engine's sampling), streaming (chunks,
the usage chunk, [DONE]), echo logprobs against the model's own log-softmax, stop strings and
stop ids, clamped max_tokens, a table of bad requests, the API key, metrics, cancellation
(streaming, non-streaming, queued, during prefill) and 50 concurrent clients served in FIFO
order.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from functools import partial
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from starlette.testclient import TestClient

from expresslane.cli.serve import serving
from expresslane.config import SamplingParams
from expresslane.engine import Engine
from expresslane.serve import attach, create_app
from expresslane.serve.metrics import parse_metrics
from expresslane.textgen import generate_text
from expresslane.tokenizer import Tokenizer

CTX = 256
NAME = "tiny"


@pytest.fixture(scope="module")
def server(random_laneformer_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one intra-op thread is fastest for a tiny model
    engine = Engine.from_pretrained(
        str(random_laneformer_dir), device="cpu", dtype="float32", max_model_len=CTX, progress=False
    )
    tok = Tokenizer.from_dir(random_laneformer_dir)
    app = create_app(engine, tok, served_model_name=NAME)
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=60)
        cmpl = partial(client.completions.create, model=NAME)
        chat = partial(client.chat.completions.create, model=NAME)
        ref = Engine(engine.model, max_model_len=CTX)  # its own cache: used while server idles
        yield SimpleNamespace(url=url, app=app, engine=engine, tok=tok, ref=ref, client=client,
                              cmpl=cmpl, chat=chat)  # fmt: skip
    torch.set_num_threads(threads)


def greedy(s, ids: list[int], n: int, **kw) -> str:
    params = SamplingParams(max_tokens=n, **kw)
    return "".join(text for text, _ in generate_text(s.ref, s.tok, ids, params))


def metrics(s) -> dict[str, float]:
    return parse_metrics(httpx.get(s.url + "/metrics").text)


def post(s, path: str, body: dict, **kw) -> dict:
    return httpx.post(s.url + path, json=body, timeout=kw.pop("timeout", 60), **kw).json()


def metric(m: dict, name: str, **labels) -> float:
    labels = sorted({**labels, "model_name": NAME}.items())  # the exposition sorts labels
    lab = ",".join(f'{k}="{v}"' for k, v in labels)
    return m.get(f"expresslane:{name}{{{lab}}}", 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def wait_idle(s, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = metrics(s)
        if metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError("the engine did not become idle")


# --- basics -----------------------------------------------------------------------------------
def test_health_models_and_playground(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].model_extra["max_model_len"] == CTX
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "Stop" in page.text
    assert httpx.get(server.url + "/playground/app.js").status_code == 200


def test_health_503_while_loading(server):
    app = create_app(None, None, served_model_name=NAME)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        assert c.get("/metrics").status_code == 200
        attach(app, server.engine, server.tok)  # no request goes through this second worker
        assert c.get("/health").status_code == 200
    app.state.service.worker.shutdown()


def test_completion_greedy_equals_engine(server):
    prompt = "def add(a, b):"
    ids = server.tok.encode(prompt)
    resp = server.cmpl(prompt=prompt, max_tokens=8, temperature=0)
    assert resp.choices[0].text == greedy(server, ids, 8)
    assert resp.usage.prompt_tokens == len(ids)
    t = resp.model_extra["timings"]
    assert t["ttft_ms"] > 0 and t["completion_tokens"] == resp.usage.completion_tokens
    if resp.usage.completion_tokens > 1:
        assert t["decode_tokens_per_s"] > 0


def test_token_id_prompt_gets_no_bos(server):
    ids = [5, 17, 42, 300]
    resp = server.cmpl(prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=0)
    assert resp.usage.prompt_tokens == 4
    assert len(resp.choices[0].logprobs.token_logprobs) == 5
    assert resp.choices[0].text.startswith(server.tok.decode(ids))
    text = server.cmpl(prompt="hi", max_tokens=1, echo=True)
    assert text.usage.prompt_tokens == len(server.tok.encode("hi"))  # strings do get a BOS


def test_echo_logprobs_equal_model_log_softmax(server):
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (20, 7)]
    # what lm-eval's local-completions sends
    body = dict(model=NAME, prompt=batch, max_tokens=1, temperature=0, logprobs=3, echo=True)
    out = post(server, "/v1/completions", {**body, "seed": 1234})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for ids, choice in zip(batch, out["choices"], strict=True):
        with torch.inference_mode():
            lp = server.engine.model(torch.tensor([ids]))[0].float().log_softmax(-1)
        got = choice["logprobs"]
        assert len(got["token_logprobs"]) == len(got["top_logprobs"]) == len(ids) + 1
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        for i in range(1, len(ids) + 1):
            row = lp[i - 1]
            want = row[ids[i]] if i < len(ids) else row.max()  # the last is the greedy token
            assert got["token_logprobs"][i] == pytest.approx(float(want), abs=1e-4)
            top = got["top_logprobs"][i]
            assert 3 <= len(top) <= 4
            assert max(top.values()) == pytest.approx(float(row.max()), abs=1e-4)
        # lm-eval's is_greedy test (logprob == max of top_logprobs) holds exactly for the argmax
        assert got["token_logprobs"][-1] == max(got["top_logprobs"][-1].values())


def test_seeds_reproducible_and_equal_engine_sampling(server):
    ids = server.tok.encode("Once upon")
    kw = dict(prompt="Once upon", max_tokens=8, temperature=1.0, top_p=0.9,
              extra_body={"top_k": 50, "ignore_eos": True})  # fmt: skip
    a, b, c = (server.cmpl(seed=seed, **kw).choices[0].text for seed in (1234, 1234, 4321))
    assert a == b != c
    want = greedy(server, ids, 8, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    assert a == want


def test_chat_greedy_and_continued_assistant_message(server):
    tok = server.tok
    msgs = [{"role": "user", "content": "Write a function."}]
    ids = tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    r = server.chat(messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == greedy(server, ids, 6)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.role == "assistant"
    msgs2 = msgs + [{"role": "assistant", "content": "def f():"}]
    ids2 = tok.encode(
        tok.apply_chat_template(msgs2, add_generation_prompt=False, continue_final_message=True),
        add_special_tokens=False,
    )
    r2 = server.chat(messages=msgs2, temperature=0, max_completion_tokens=6)
    assert r2.usage.prompt_tokens == len(ids2)
    assert r2.choices[0].message.content == greedy(server, ids2, 6)


# --- streaming --------------------------------------------------------------------------------
def test_completion_stream_chunks_usage_and_done(server):
    prompt = "import os\n"
    want = greedy(server, server.tok.encode(prompt), 8, ignore_eos=True)
    usage = {"include_usage": True}
    chunks = list(server.cmpl(prompt=prompt, max_tokens=8, temperature=0, stream=True,
                              stream_options=usage, extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert last.model_extra["timings"]["completion_tokens"] == 8
    assert all(c.usage is None for c in chunks[:-1])
    body = {"prompt": prompt, "max_tokens": 3, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] is not None


def test_chat_stream_with_logprobs(server):
    msgs = [{"role": "user", "content": "hello"}]
    want = server.chat(messages=msgs, max_tokens=6, temperature=0).choices[0].message.content
    chunks = list(server.chat(messages=msgs, max_tokens=6, temperature=0, stream=True,
                              logprobs=True, top_logprobs=2,
                              stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    entries = [e for lp in lps for e in lp.content]
    assert len(entries) <= chunks[-1].usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_stop_strings_and_stop_token_ids(server):
    prompt = "The quick brown"
    ids = server.tok.encode(prompt)
    full = greedy(server, ids, 16, ignore_eos=True)
    stop = full[6:8]
    stops = [stop] + [f"zq{i}zq" for i in range(5)]  # more than OpenAI's 4: accepted
    kw = dict(prompt=prompt, max_tokens=16, temperature=0)
    r = server.cmpl(stop=stops, extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    gen = list(server.ref.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True)))
    r = server.cmpl(extra_body={"stop_token_ids": [gen[2]], "ignore_eos": True}, **kw)
    assert r.usage.completion_tokens == gen.index(gen[2]) + 1
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == gen[2]


def test_n_choices_and_prompt_batches(server):
    r = server.cmpl(prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5


def test_max_tokens_clamped_to_context_and_unknown_fields_ignored(server):
    ids = [7] * (CTX - 3)
    body = dict(prompt=ids, max_tokens=10**9, ignore_eos=True, temperature=0)
    out = post(server, "/v1/completions", {**body, "user": "x", "new_field": {"a": 1}})
    assert out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"


# --- bad requests -----------------------------------------------------------------------------
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


def test_tokenizer_routes(server):
    tok = server.tok
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>" and info["chat_template"]
    eos = post(server, "/tokenize", {"prompt": "</s>", "add_special_tokens": False})
    assert eos["tokens"] == [tok.eos_ids[0]]
    r = post(server, "/tokenize", {"prompt": "hello world"})
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    back = post(server, "/detokenize", {"tokens": r["tokens"]})
    assert back["prompt"] == tok.decode(r["tokens"])


# --- metrics, cancellation, concurrency -------------------------------------------------------
def test_metrics_count_a_request(server):
    before = metrics(server)
    post(server, "/v1/completions", dict(prompt=[5, 6, 7, 8], max_tokens=4, ignore_eos=True))
    d = partial(delta, before, metrics(server))
    assert d("generation_tokens_total") == 4 and d("prompt_tokens_total") == 4
    assert d("request_success_total", finished_reason="length") == 1
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert d(f"{h}_seconds_count") == 1
    assert d("request_decode_tokens_per_second_count") == 1
    assert d("inter_token_latency_seconds_count") == 3
    assert metric(metrics(server), "num_requests_running") == 0


LONG = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def test_client_closing_a_stream_frees_the_engine(server):
    before = metrics(server)
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    took = wait_idle(server)
    d = partial(delta, before, metrics(server))
    assert d("generation_tokens_total") < 100  # far from the 200 asked for
    assert took < 2.0 and d("request_success_total", finished_reason="abort") == 1
    nxt = server.cmpl(prompt="y", max_tokens=2)
    assert nxt.usage.completion_tokens >= 1


def test_client_gone_non_streaming_and_while_queued(server):
    before = metrics(server)
    url = server.url + "/v1/completions"
    first = threading.Thread(
        target=lambda: pytest.raises(httpx.ReadTimeout, httpx.post, url, json=LONG, timeout=0.6)
    )
    first.start()
    time.sleep(0.2)  # the second request waits in the queue behind the first
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=LONG, timeout=0.3)
    first.join()
    wait_idle(server)
    d = partial(delta, before, metrics(server))
    assert d("request_success_total", finished_reason="abort") == 2
    assert d("generation_tokens_total") < 150


def test_client_gone_during_prefill_stops_it_between_chunks(server):
    calls = []

    class Slow:  # the model, 0.1 s per forward call, counting the calls
        def __init__(self, model):
            self.model = model

        def __call__(self, *args, **kw):
            calls.append(time.monotonic())
            time.sleep(0.1)
            return self.model(*args, **kw)

    engine = Engine(server.engine.model, max_model_len=CTX, prefill_chunk=8)
    engine.model = Slow(engine.model)  # a 128-token prompt: 16 prefill chunks, 1.6 s
    app = create_app(engine, server.tok, served_model_name=NAME)
    with serving(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            body = {"prompt": list(range(3, 131)), "max_tokens": 4}
            httpx.post(url + "/v1/completions", json=body, timeout=0.35)
        gone = time.monotonic()
        wait_idle(SimpleNamespace(url=url))
        m = metrics(SimpleNamespace(url=url))
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
