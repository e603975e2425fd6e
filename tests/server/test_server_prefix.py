"""Prefix reuse through the server: multi-turn chats answer what a cold engine answers, and
usage (`prompt_tokens_details.cached_tokens`, streamed too), `timings` and /metrics say how much
of each prompt the cache already held."""

from __future__ import annotations

from functools import partial

import httpx
import pytest
from serverkit import CTX, delta, metrics

from expresslane.checkpoint import load_model
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.textgen import generate_text
from expresslane.tokenizer import Tokenizer


def cold_answer(engine: Engine, tok, ids: list[int], n: int) -> str:
    params = SamplingParams(max_tokens=n)
    return "".join(text for text, _ in generate_text(engine, tok, ids, params))


def chat_ids(tok, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_multi_turn_chat_equals_a_cold_engine_and_reports_cached_tokens(server):
    tok = server.tok
    cold = Engine(server.engine.model, max_model_len=CTX, prefix_reuse=False)
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "ls"},
    ]
    previous = 0  # the last prompt's length
    for k in range(3):
        before = metrics(server)
        ids = chat_ids(tok, messages)
        r = server.chat(messages=messages, max_tokens=8, temperature=0)
        text = r.choices[0].message.content
        assert text == cold_answer(cold, tok, ids, 8)
        cached = r.usage.prompt_tokens_details.cached_tokens
        d = partial(delta, before, metrics(server))
        assert d("prefix_cache_queries_total") == len(ids) == r.usage.prompt_tokens
        assert d("prefix_cache_hits_total") == cached
        assert d("prefix_cache_hit_requests_total") == (cached > 0)
        if k:  # at least the previous prompt (its last token may retokenize with the answer)
            assert previous - 1 <= cached < len(ids)
        previous = len(ids)
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"ok {k}"},
        ]


def test_streamed_usage_and_completions_report_cached_tokens(server):
    prompt = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]
    body = dict(prompt=prompt, max_tokens=3, ignore_eos=True)
    httpx.post(server.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    again = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": len(prompt) - 1}
    assert again["timings"]["cached_tokens"] == len(prompt) - 1
    stream = server.cmpl(
        prompt=prompt, max_tokens=3, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == len(prompt) - 1
    chat = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    server.chat(**chat)
    stream = server.chat(**chat, stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    n = len(chat_ids(server.tok, chat["messages"]))
    assert usage[0].prompt_tokens == n and usage[0].prompt_tokens_details.cached_tokens == n - 1


def test_echo_scores_the_prompt_afresh(server):
    """An echo with logprobs computes every prompt position: nothing counts as cached."""
    prompt = [7, 8, 9, 10, 11, 12]
    body = dict(prompt=prompt, max_tokens=2, echo=True, logprobs=1, ignore_eos=True)
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_agent_bench_conversation_reuses_every_turn(random_laneformer_dir, api):
    """The agent benchmark's conversation, small: a reusing server against a cold engine. They
    answer alike, and the server holds at least the previous prompt at every turn (less its
    last token, which may merge with the answer when re-tokenized). Through the Responses API
    each turn sends only its new message, with previous_response_id; through Anthropic's
    Messages API the whole conversation, `system` apart."""
    from types import SimpleNamespace

    from expresslane.bench.agent import (
        converse,
        engine_sender,
        http_sender,
        messages_sender,
        responses_sender,
    )
    from expresslane.cli.serve import serving
    from expresslane.serve import create_app

    tok = Tokenizer.from_dir(random_laneformer_dir)
    model = load_model(random_laneformer_dir, device="cpu", dtype="float32", progress=False)
    args = SimpleNamespace(turns=3, target_tokens=600, answer_tokens=3)
    cold = engine_sender(Engine(model, 1024, prefix_reuse=False), tok)
    with serving(create_app(Engine(model, 1024), tok, served_model_name="agent")) as url:
        senders = {"responses": responses_sender, "messages": messages_sender}
        hot = senders.get(api, http_sender)(url)
        rows = converse({True: hot, False: cold}, tok, args)
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["same_answer"] for r in rows)
    for prev, r in zip(rows, rows[1:], strict=False):
        assert prev["prompt_tokens"] - 1 <= r["cached_tokens"] < r["prompt_tokens"]
        assert r["new_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
    assert rows[-1]["prompt_tokens"] <= args.target_tokens
