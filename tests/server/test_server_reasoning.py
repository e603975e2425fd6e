"""`serve --reasoning-parser`: a thinking model's reasoning apart from its answer, through a real
uvicorn.

The tiny model cannot think, so a regex (`structured_outputs`) makes it write the tags. A server
without a parser returns that whole text; a server with one must split it as
`reasoning.split` splits the same text: in one body (`reasoning_content` and `reasoning`), in a
stream read by the `openai` client, with tool calls parsed from the answer alone, and in the
Responses API (a `reasoning` item) and the Messages API (a `thinking` block). Those requests turn
thinking off, so that the regex alone is the grammar; with it on, a schema holds the answer
after a thought (the last test).
"""

from __future__ import annotations

import json
import re

import anthropic
import jsonschema
import openai
import pytest
from serverkit import NAME, post
from test_server_hostile import CH, own_server

from expresslane.serve.guards import ServeLimits
from expresslane.structured.reasoning import END, split

OFF = {"enable_thinking": False}  # the regex alone is the grammar: it writes the tags itself
THINK = r"<think>[a-z ]{6,14}</think>\n\n[a-z]{2,8}"
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
          "additionalProperties": False}  # fmt: skip
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
CALL = r'<think>[a-z]{3,8}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": ' \
       r'\{"city": "[a-z]{2,6}"\}\}\n</tool_call>'  # fmt: skip


def chat_body(regex: str, **kw) -> dict:
    """A greedy chat body whose output the regex writes: thinking turned off, so that the
    regex is the whole grammar (with it on, a parser's grammar would want a thought first)."""
    return {"model": NAME, "messages": [{"role": "user", "content": "why?"}], "max_tokens": 60,
            "temperature": 0, "chat_template_kwargs": OFF,
            "structured_outputs": {"regex": regex}, **kw}  # fmt: skip


@pytest.fixture(scope="module")
def servers(server):
    """(a server without a parser, one with deepseek_r1, one with qwen3), the same weights."""
    with (
        own_server(server) as plain,
        own_server(server, limits=ServeLimits(reasoning_parser="deepseek_r1")) as deep,
        own_server(server, limits=ServeLimits(reasoning_parser="qwen3")) as qwen,
    ):
        yield plain, deep, qwen


def stream(s, body: dict):
    """The `openai` client's stream of a chat body (vLLM's fields through extra_body)."""
    body = dict(body)
    extra = {k: body.pop(k) for k in ("structured_outputs", "chat_template_kwargs")}
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
    return client.chat.completions.create(stream=True, extra_body=extra, **body)


def test_one_body_splits_the_reasoning(servers):
    plain, deep, qwen = servers
    raw = post(plain, CH, chat_body(THINK))["choices"][0]["message"]
    assert re.fullmatch(THINK, raw["content"]) and "reasoning_content" not in raw
    reasoning, content = split(raw["content"], "deepseek_r1")
    assert reasoning and content and "<think>" not in reasoning + content
    for s in (deep, qwen):  # the output opens with <think>: both parsers split it
        msg = post(s, CH, chat_body(THINK))["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == (
            reasoning, reasoning, content)  # fmt: skip
    hidden = post(deep, CH, chat_body(THINK, include_reasoning=False))["choices"][0]["message"]
    assert hidden["content"] == content and "reasoning_content" not in hidden
    # no tags: qwen3 (thinking turned off) answers it all as content, deepseek_r1 as reasoning
    words = post(plain, CH, chat_body("[a-z]{3,9}"))["choices"][0]["message"]["content"]
    msg = post(qwen, CH, chat_body("[a-z]{3,9}"))["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, words)
    msg = post(deep, CH, chat_body("[a-z]{3,9}"))["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (words, "")


@pytest.mark.parametrize("parser,regex", [("deepseek_r1", THINK), ("qwen3", "\n\n")])
def test_stream_splits_the_reasoning_as_the_body(servers, parser, regex):
    """Also an answer the qwen3 parser holds back to its end (it might still open <think>)."""
    s = servers[1] if parser == "deepseek_r1" else servers[2]
    want = post(s, CH, chat_body(regex))["choices"][0]["message"]
    reasoning = content = ""
    for c in stream(s, chat_body(regex)):
        if c.choices:
            extra = c.choices[0].delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning_content") or ""
            content += c.choices[0].delta.content or ""
    assert (reasoning or None, content) == (want["reasoning_content"], want["content"])
    assert content or reasoning


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_calls_come_from_the_answer_alone(servers, streamed):
    _, deep, _ = servers
    body = chat_body(CALL, tools=[TOOL], tool_choice="auto", max_tokens=150)
    if not streamed:
        msg = post(deep, CH, body)["choices"][0]
        assert msg["finish_reason"] == "tool_calls", msg
        calls, reasoning = msg["message"]["tool_calls"], msg["message"]["reasoning_content"]
    else:
        reasoning, calls = "", []
        for c in stream(deep, body):
            if c.choices:
                reasoning += (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                calls += [t.model_dump() for t in c.choices[0].delta.tool_calls or []]
    assert re.fullmatch("[a-z]{3,8}", reasoning)
    (call,) = calls
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_responses_api_returns_a_reasoning_item(servers):
    _, deep, _ = servers
    want = post(deep, CH, chat_body(THINK))["choices"][0]["message"]
    client = openai.OpenAI(base_url=deep.url + "/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model=NAME, input="why?", max_output_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": THINK},
                          "chat_template_kwargs": OFF})  # fmt: skip
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == want["reasoning_content"]
    assert r.output_text == want["content"]
    events = list(client.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (want["reasoning_content"], want["content"])
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1] and events[-1].response.output[0].content[0].text == thought
    # the next turn carries the reasoning back as the chat template's reasoning_content
    turn = client.responses.create(**{**kw, "input": "and?"}, previous_response_id=r.id)
    assert turn.status == "completed"


def test_usage_counts_the_thoughts_tokens(servers):
    """OpenAI's completion_tokens_details.reasoning_tokens: the tokens up to the one that
    completes </think>, read off the answer's own logprob tokens; the same in a stream's usage
    and in the Responses API's output_tokens_details. Without a parser: no count."""
    plain, deep, _ = servers
    body = chat_body(THINK, logprobs=True)
    out = post(deep, CH, body)
    toks = [t["token"] for t in out["choices"][0]["logprobs"]["content"]]
    want = next(k for k in range(len(toks) + 1) if END in "".join(toks[:k]))
    assert 0 < want < len(toks) == out["usage"]["completion_tokens"]
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == want
    assert "completion_tokens_details" not in post(plain, CH, body)["usage"]
    chunks = list(stream(deep, {**chat_body(THINK), "stream_options": {"include_usage": True}}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == want
    client = openai.OpenAI(base_url=deep.url + "/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model=NAME, input="why?", max_output_tokens=60, temperature=0,
              extra_body={"structured_outputs": {"regex": THINK},
                          "chat_template_kwargs": OFF})  # fmt: skip
    assert client.responses.create(**kw).usage.output_tokens_details.reasoning_tokens == want
    done = [e for e in client.responses.create(stream=True, **kw) if e.type.endswith("completed")]
    assert done[-1].response.usage.output_tokens_details.reasoning_tokens == want


def test_messages_api_returns_a_thinking_block(servers):
    _, deep, _ = servers
    want = post(deep, CH, chat_body(THINK))["choices"][0]["message"]
    claude = anthropic.Anthropic(base_url=deep.url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model=NAME, max_tokens=60, messages=[{"role": "user", "content": "why?"}],
              extra_body={"temperature": 0, "structured_outputs": {"regex": THINK},
                          "chat_template_kwargs": OFF})  # fmt: skip
    m = claude.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert (m.content[0].thinking, m.content[1].text) == (want["reasoning_content"],
                                                          want["content"])  # fmt: skip
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    blocks = [(b.type, getattr(b, "thinking", None), getattr(b, "text", None)) for b in m.content]
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None))
            for b in final.content] == blocks  # fmt: skip


def test_a_schema_holds_the_answer_after_the_thought(servers):
    """With a parser, a schema's grammar lets the model think first (structured/grammar.py):
    qwen3's output opens with <think> (the grammar forces it). The tiny model would think until
    max_tokens, so its thought is ended with the answer's reserve of the budget left
    (structured/decoding.py), and the answer is the schema's JSON. With thinking turned off
    the answer is the schema's JSON alone."""
    _, _, qwen = servers
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    body = {"model": NAME, "messages": [{"role": "user", "content": "why?"}], "max_tokens": 40,
            "temperature": 0, "response_format": fmt}  # fmt: skip
    for sampled in ({}, {"temperature": 1.0, "seed": 3}):
        thinking = post(qwen, CH, {**body, **sampled})["choices"][0]
        assert thinking["message"]["reasoning_content"] and thinking["finish_reason"] == "stop"
        jsonschema.validate(json.loads(thinking["message"]["content"]), SCHEMA)
    off = {**body, "max_tokens": 40, "chat_template_kwargs": {"enable_thinking": False}}
    plain = post(qwen, CH, off)["choices"][0]["message"]
    assert plain["reasoning_content"] is None
    jsonschema.validate(json.loads(plain["content"]), SCHEMA)


def test_serve_refuses_an_unknown_parser():
    from expresslane.errors import ConfigError

    with pytest.raises(ConfigError, match="--reasoning-parser granite"):
        ServeLimits(reasoning_parser="granite").validate()
