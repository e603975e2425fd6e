"""Anthropic's Messages API through a real uvicorn, driven by the `anthropic` client.

A Messages request is the chat request it becomes: its text equals the chat route's for the
same conversation (greedy), streamed or not; stop sequences, usage and count_tokens agree with
the chat route; forced tool calls come back as `tool_use` blocks whose input matches the schema,
and a tool loop runs; the key is taken as `x-api-key`; what this server does not implement is a
400 naming the field.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

import anthropic
import httpx
import pytest
from pydantic import BaseModel
from serverkit import NAME, embedded_server

KEY = "sekret"
# every answer runs to its max (a random model may end early); greedy, through extra_body as the
# current `anthropic` client sends sampling fields
EXACT = {"ignore_eos": True, "temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="dummy", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def embedded():
    """The embedded model behind a real uvicorn that asks for a key."""
    with embedded_server(api_key=KEY) as url:
        client = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=60)
        yield SimpleNamespace(url=url, client=client)


def _chat(s, messages: list[dict], n: int, **kw):
    return s.chat(messages=messages, max_tokens=n, temperature=0, extra_body=EXACT, **kw)


def _post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json={"model": NAME, **body}, timeout=60)


ASK = [{"role": "user", "content": "Hello there"}]


def test_text_answer_usage_and_count_are_the_chat_routes(server, claude):
    m = claude.messages.create(model=NAME, max_tokens=9, messages=ASK,
                               extra_body=EXACT)  # fmt: skip
    chat = _chat(server, ASK, 9)
    assert m.type == "message" and m.content[0].type == "text"
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 9
    assert m.usage.input_tokens == chat.usage.prompt_tokens
    count = claude.messages.count_tokens(model=NAME, messages=ASK)
    assert count.input_tokens == chat.usage.prompt_tokens
    turns = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "Hello!"},
                                               {"type": "thinking", "thinking": "x",
                                                "signature": "s"}]},
             {"role": "user", "content": "Again"}]  # fmt: skip
    m = claude.messages.create(model=NAME, max_tokens=6, messages=turns,
                               extra_body=EXACT)  # fmt: skip
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Again"}]  # fmt: skip
    assert m.content[0].text == _chat(server, plain, 6).choices[0].message.content


def test_stream_events_and_stop_sequences(server, claude):
    kw = dict(model=NAME, max_tokens=12, messages=ASK, extra_body=EXACT)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    text = whole.content[0].text
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    m = claude.messages.create(model=NAME, max_tokens=12, messages=ASK, stop_sequences=[stop],
                               extra_body=EXACT)  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_forced_tool_use_then_its_result_then_an_answer(embedded):
    c = embedded.client
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    kw = dict(model=NAME, max_tokens=80, messages=ask, tools=[WEATHER],
              tool_choice={"type": "any"}, system="You help.",
              extra_body={"temperature": 0})  # fmt: skip
    m = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for msg in (m, streamed):
        use = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and use and use[0].name == "get_weather"
        assert set(use[0].input) == {"city", "unit"} and use[0].input["unit"] in ("c", "f")
    assert streamed.content[-1].input == m.content[-1].input
    events = []  # the raw stream: the tool_use block opens, then its input comes in pieces
    with c.messages.stream(**kw) as stream:
        events = [
            e.type if e.type != "content_block_delta" else e.delta.type
            for e in stream
            if e.type.startswith(("content_block", "message"))
        ]  # not the client's own
    start = events.index("content_block_start")
    assert events[start + 1 : start + 3] == ["input_json_delta"] * 2
    assert events.count("input_json_delta") > 2 and "text_delta" not in events
    turns = [*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                           "content": "sunny"}]}]  # fmt: skip
    answer = c.messages.create(model=NAME, max_tokens=6, messages=turns, tools=[WEATHER],
                               tool_choice={"type": "none"})  # fmt: skip
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")


class Choice(BaseModel):
    """Bounded by enums alone: the `anthropic` client moves numeric and length bounds into
    descriptions (its transform_schema), where no grammar sees them."""

    label: Literal["a", "b"]
    ok: bool


def test_parse_output_format(embedded):
    for temperature in (0.0, 1.0):
        out = embedded.client.messages.parse(
            model=NAME, max_tokens=60, messages=[{"role": "user", "content": "A point"}],
            output_format=Choice, extra_body={"temperature": temperature},
        )  # fmt: skip
        assert out.stop_reason == "end_turn", out.content
        assert isinstance(out.parsed_output, Choice), out.content


def test_the_key_comes_as_x_api_key(embedded):
    body = {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    url = embedded.url + "/v1/messages"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=60).status_code == 401
    assert httpx.post(url, json=body, headers={"x-api-key": KEY}, timeout=60).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                     "name": "f", "input": {}}]}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a",
                                                          "name": "f"}]}]}, "messages"),
        ({"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools"),
        ({"messages": ASK, "tools": [{"input_schema": {"type": "object"}}]}, "tools"),
        ({"messages": ASK, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"messages": ASK, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]},
         "tool_choice"),
        ({"messages": ASK, "system": [{"type": "image"}]}, "system"),
        ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
        ({"messages": ASK, "max_tokens": 10**6}, "max_tokens"),
        ({"messages": ASK, "temperature": 1.5}, "temperature"),
        ({"messages": ASK, "output_config": {"format": {"type": "xml"}}}, "output_config.format"),
        ({"messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "not": {}}}}}, "output_config.format.json_schema"),
        ({"messages": []}, "messages"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = _post(server, "/v1/messages", {"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    missing = _post(server, "/v1/messages", {"messages": ASK})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "max_tokens"
