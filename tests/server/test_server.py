"""The OpenAI-compatible server's API, against a real uvicorn (tests/serverkit.py).

Covered: completions and chat (greedy equals the engine's greedy, seeds reproduce the engine's
sampling), streaming (chunks, the usage chunk, [DONE]), echo logprobs against the model's own
log-softmax, stop strings and stop ids, max_tokens beyond the context, tokenizer routes and metrics.
"""

from __future__ import annotations

import json
from functools import partial

import httpx
import pytest
import torch
from serverkit import (
    CTX,
    NAME,
    delta,
    greedy,
    metric,
    metrics,
    post,
)
from starlette.testclient import TestClient

import expresslane
from expresslane.sampling.params import SamplingParams, bad_word_ids
from expresslane.serve import attach, create_app
from expresslane.serve.guards import ServeLimits


# --- basics -----------------------------------------------------------------------------------
def test_health_models_and_playground(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = server.client.models.list().data
    assert [m.id for m in models] == [NAME] and models[0].model_extra["max_model_len"] == CTX
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "Stop" in page.text
    assert httpx.get(server.url + "/playground/app.js").status_code == 200


def test_health_503_while_loading(server):
    """/health, and vLLM's /ping (GET or POST), 503 until the model is attached, 200 after;
    /version always answers."""
    app = create_app(None, None, served_model_name=NAME)
    probes = (("get", "/health"), ("get", "/ping"), ("post", "/ping"))
    with TestClient(app) as c:
        for method, path in probes:
            r = getattr(c, method)(path)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503, path
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 503
        assert c.get("/metrics").status_code == 200
        assert c.get("/version").json() == {"version": expresslane.__version__}
        attach(app, server.engine, server.tok)  # no request goes through this second worker
        for method, path in probes:
            r = getattr(c, method)(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, path
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


def test_return_tokens_as_token_ids_names_each_logprobs_token_by_id(server):
    """vLLM's field: completions (echoed prompt too) and chat name tokens "token_id:N", the ids
    the engine picked, with the same logprobs as the text-named request."""
    ids = [5, 9, 30, 7]
    body = dict(prompt=ids, max_tokens=5, temperature=0, logprobs=2, echo=True)
    named = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    by_id = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    lp = by_id["choices"][0]["logprobs"]
    out = list(server.ref.generate(ids, SamplingParams(max_tokens=5)))
    assert lp["tokens"] == [f"token_id:{t}" for t in ids + out]
    assert lp["token_logprobs"] == named["token_logprobs"]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    ask = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
               logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)  # fmt: skip
    chat = post(server, "/v1/chat/completions", ask)["choices"][0]["logprobs"]["content"]
    for entry in chat:
        assert entry["token"].startswith("token_id:") and entry["bytes"] == list(
            entry["token"].encode()
        )
        assert entry["top_logprobs"][0]["token"].startswith("token_id:")


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
    # vLLM's echo: the continued message's text, then the same answer; streamed alike
    r3 = server.chat(
        messages=msgs2, temperature=0, max_completion_tokens=6, extra_body={"echo": True}
    )
    assert r3.choices[0].message.content == "def f():" + greedy(server, ids2, 6)
    chunks = server.chat(messages=msgs2, temperature=0, max_completion_tokens=6, stream=True,
                         extra_body={"echo": True})  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r3.choices[0].message.content
    r4 = server.chat(messages=msgs, temperature=0, max_tokens=6, extra_body={"echo": True})
    assert r4.choices[0].message.content == r.choices[0].message.content  # last turn a user's


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


def test_continuous_usage_stats(server):
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage is the counts so far,
    the last chunk's the totals; without it (above) chunks carry usage null."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(server.chat(messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                              temperature=0, stream=True, stream_options=options,
                              extra_body={"ignore_eos": True}))  # fmt: skip
    total = chunks[-1].usage
    assert chunks[-1].choices == [] and total.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens == total.prompt_tokens for c in chunks[:-1])


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
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: the string that matched
    body = {"ignore_eos": True, "include_stop_str_in_output": True}
    r = server.cmpl(stop=stops, extra_body=body, **kw)
    assert r.choices[0].text == full[: full.find(stop) + len(stop)]
    streamed = server.cmpl(stop=stops, extra_body=body, stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    gen = list(server.ref.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True)))
    r = server.cmpl(extra_body={"stop_token_ids": [gen[2]], "ignore_eos": True}, **kw)
    assert r.usage.completion_tokens == gen.index(gen[2]) + 1
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == gen[2]


def test_truncate_prompt_tokens_keeps_the_last_ones(server):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context is served from its last
    k tokens (completions and chat; an echo shows what was kept); 0 is a 400 naming it."""
    ids = [(7 * i + 3) % 60 + 4 for i in range(CTX + 40)]  # longer than the context
    body = dict(prompt=ids, max_tokens=6, temperature=0, truncate_prompt_tokens=9, echo=True)
    r = post(server, "/v1/completions", body)
    assert r["usage"]["prompt_tokens"] == 9
    tail = server.tok.decode(ids[-9:])
    assert r["choices"][0]["text"] == tail + greedy(server, ids[-9:], 6)
    chat = post(server, "/v1/chat/completions", dict(
        messages=[{"role": "user", "content": "word " * (4 * CTX)}], max_tokens=2,
        truncate_prompt_tokens=-1))  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == CTX - 2
    r = httpx.post(server.url + "/v1/completions", json={**body, "truncate_prompt_tokens": 0})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "truncate_prompt_tokens")


def test_n_choices_and_prompt_batches(server):
    r = server.cmpl(prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5


def test_max_tokens_beyond_context_is_400_or_clamped_and_unknown_fields_ignored(server):
    ids = [7] * (CTX - 3)
    body = dict(prompt=ids, max_tokens=10**9, ignore_eos=True, temperature=0)
    r = httpx.post(server.url + "/v1/completions", json={**body, "user": "x", "new": {"a": 1}})
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, "max_tokens")
    assert f"maximum context length is {CTX} tokens" in err["message"]  # vLLM's words
    assert f"{CTX - 3} input tokens" in err["message"]
    app = create_app(server.engine, server.tok, served_model_name=NAME,
                     limits=ServeLimits(clamp_max_tokens=True))  # fmt: skip
    with TestClient(app) as c:
        out = c.post("/v1/completions", json={**body, "user": "x", "new": {"a": 1}}).json()
    app.state.service.worker.shutdown()
    assert out["usage"]["completion_tokens"] == 3
    assert out["choices"][0]["finish_reason"] == "length"


# --- tokenizer routes -------------------------------------------------------------------------


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


# --- metrics ----------------------------------------------------------------------------------
def test_allowed_token_ids_and_bad_words_give_the_engines_tokens(server):
    """vLLM's allowed_token_ids and bad_words (text: tokenized by the server as vLLM does, as
    written and after a space) reach the sampler: the engine's greedy text with the same ids,
    changed from the plain one."""
    ids, tok = server.tok.encode("the quick brown fox"), server.tok
    plain = list(server.ref.generate(ids, SamplingParams(max_tokens=16)))
    # words whose text tokenizes back to the tokens generated (a model may write a word in
    # tokens its tokenizer would not choose; bad_words are matched as the tokenizer writes them)
    pieces = [plain[i : i + n] for n in (2, 1) for i in range(14)]
    words = [tok.decode(p) for p in pieces if tok.decode(p).strip()
             and tok.encode(tok.decode(p), False) == p][:2]  # fmt: skip
    assert words
    allowed = [t for t in range(0, server.engine.cfg.vocab_size, 2) if t != plain[0]]
    for field, value, params in (
        ("bad_words", words, {"bad_words": bad_word_ids(words, lambda w: tok.encode(w, False))}),
        ("allowed_token_ids", allowed, {"allowed_token_ids": tuple(allowed)}),
    ):
        r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 16, "temperature": 0,
                                             field: value})  # fmt: skip
        want = greedy(server, ids, 16, **params)
        assert r["choices"][0]["text"] == want != greedy(server, ids, 16), field


def test_penalties_and_logit_bias_give_the_engines_tokens(server):
    """vLLM's fields reach the sampler: the server's greedy text equals the engine's with the
    same adjustments (OpenAI's string keys for logit_bias), and the adjustments change it."""
    ids = server.tok.encode("the quick brown fox")
    fields = dict(frequency_penalty=0.8, presence_penalty=0.3, repetition_penalty=1.2,
                  min_tokens=4)  # fmt: skip
    bias = {str(ids[-1]): -100, "5": 7.5}
    r = post(server, "/v1/completions", dict(prompt=ids, max_tokens=24, temperature=0,
                                              logit_bias=bias, **fields))  # fmt: skip
    want = greedy(server, ids, 24, logit_bias=((5, 7.5), (ids[-1], -100.0)), **fields)
    assert r["choices"][0]["text"] == want != greedy(server, ids, 24)


def test_metrics_name_the_kv_cache_as_loaded(server):
    """vLLM's cache_config_info: a 1 labelled with the cache's dtype and context, and its bytes."""
    m = metrics(server)
    assert metric(m, "cache_config_info", cache_dtype="float32", max_model_len=CTX) == 1
    assert metric(m, "kv_cache_bytes") == server.engine.cache.nbytes > 0


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
