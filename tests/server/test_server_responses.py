"""OpenAI's Responses API through a real uvicorn, driven by the `openai` client's `responses`.

A Responses request is the chat request it becomes: its text, tool calls and logprobs equal
the chat route's for the same conversation (greedy), streamed or not; `previous_response_id`
continues a stored conversation; `text.format` and forced tool calls go through the grammar, so
`responses.parse(text_format=PydanticModel)` parses and a tool loop runs; what this server does
not implement is a 400 naming the field, an unknown stored id a 404.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from serverkit import NAME, embedded_server

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def embedded():
    """The embedded model (a context of 1024, for the tool prompt) behind a real uvicorn."""
    with embedded_server() as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=60)
        yield SimpleNamespace(url=url, client=client)


class Point(BaseModel):  # bounded: a random model would write digits forever
    x: int = Field(ge=0, le=99)
    label: Literal["a", "b"]


EXACT = {"ignore_eos": True}  # every answer runs to its max (a random model may end early)


def _chat_text(s, messages: list[dict], n: int, **kw) -> tuple[str, dict]:
    out = s.chat(messages=messages, max_tokens=n, temperature=0, extra_body=EXACT, **kw)
    return out.choices[0].message.content, out.usage


def _post(s, body: dict) -> httpx.Response:
    return httpx.post(s.url + "/v1/responses", json={"model": NAME, **body}, timeout=60)


def test_text_answer_is_the_chat_answer_for_the_same_conversation(server):
    r = server.client.responses.create(model=NAME, input="Hello there", max_output_tokens=9,
                                       temperature=0, store=False, extra_body=EXACT)  # fmt: skip
    text, usage = _chat_text(server, [{"role": "user", "content": "Hello there"}], 9)
    assert r.object == "response" and r.output_text == text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == 9
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!"}]},
             {"role": "user", "content": "Again"}]  # fmt: skip
    r = server.client.responses.create(model=NAME, input=items, max_output_tokens=7,
                                       temperature=0, extra_body=EXACT)  # fmt: skip
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Again"}]  # fmt: skip
    assert r.output_text == _chat_text(server, messages, 7)[0]


def test_instructions_come_first_as_a_system_message(embedded):
    items = [{"role": "user", "content": "Hi"}]
    r = embedded.client.responses.create(
        model=NAME,
        input=items,
        instructions="You help.",
        max_output_tokens=7,
        temperature=0,
        extra_body=EXACT,
    )
    messages = [{"role": "system", "content": "You help."}, *items]
    chat = embedded.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=7, temperature=0, extra_body=EXACT
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "You help."


def test_stream_events_in_order_and_equal_to_the_answer(server):
    kw = dict(model=NAME, input="Tell me", max_output_tokens=12, temperature=0, store=False,
              extra_body=EXACT)  # fmt: skip
    whole = server.client.responses.create(**kw)
    events = list(server.client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12


def test_previous_response_id_continues_a_stored_conversation(server):
    c = server.client
    first = c.responses.create(model=NAME, input="One", max_output_tokens=5, temperature=0,
                               extra_body=EXACT)  # fmt: skip
    second = c.responses.create(
        model=NAME,
        input="Two",
        previous_response_id=first.id,
        max_output_tokens=5,
        temperature=0,
        extra_body=EXACT,
    )
    messages = [{"role": "user", "content": "One"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Two"}]  # fmt: skip
    assert second.output_text == _chat_text(server, messages, 5)[0]
    assert second.previous_response_id == first.id
    assert c.responses.retrieve(first.id).output_text == first.output_text
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    gone = _post(server, {"input": "x", "previous_response_id": first.id})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
    unstored = c.responses.create(model=NAME, input="x", max_output_tokens=2, store=False)
    assert httpx.get(server.url + f"/v1/responses/{unstored.id}").status_code == 404


def test_forced_tool_call_then_its_result_then_an_answer(embedded):
    c = embedded.client
    for stream in (False, True):
        kw = dict(model=NAME, input="Weather in Paris?", tools=[WEATHER],
                  tool_choice="required", max_output_tokens=80, temperature=0)  # fmt: skip
        if stream:
            events = list(c.responses.create(stream=True, **kw))
            kinds = [e.type for e in events]
            r = events[-1].response
            # the call's item opens at its first delta, its arguments come in pieces that join
            # into the final ones, and its `done` events come before the response's
            added = kinds.index("response.output_item.added")
            pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
            done = next(e for e in events if e.type == "response.function_call_arguments.done")
            assert events[added].item.type == "function_call" and pieces
            assert added < kinds.index("response.function_call_arguments.delta")
            assert "".join(pieces) == done.arguments == r.output[-1].arguments
            assert kinds.index("response.function_call_arguments.done") < len(kinds) - 1
        else:
            r = c.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and calls and calls[0].name == "get_weather"
        args = json.loads(calls[0].arguments)
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}
    answer = c.responses.create(model=NAME, previous_response_id=r.id, input=[result],
                                tools=[WEATHER], tool_choice="none", max_output_tokens=6,
                                temperature=0)  # fmt: skip
    call = calls[0].model_dump(exclude_none=True)  # the same turn, sent whole
    again = c.responses.create(model=NAME, input=[{"role": "user", "content": "Weather in Paris?"},
                                                  call, result],
                               tools=[WEATHER], tool_choice="none", max_output_tokens=6,
                               temperature=0)  # fmt: skip
    assert answer.output[0].type == "message" and answer.output_text == again.output_text


def test_parse_text_format(embedded):
    for temperature in (0.0, 1.0):
        out = embedded.client.responses.parse(
            model=NAME,
            input="A point",
            text_format=Point,
            max_output_tokens=60,
            temperature=temperature,
        )
        assert out.status == "completed", out.output_text
        assert isinstance(out.output_parsed, Point), out.output_text


def test_include_logprobs_gives_the_chat_routes_logprobs(server):
    r = _post(
        server,
        {
            "input": "Hi",
            "max_output_tokens": 4,
            "temperature": 0,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 2,
            **EXACT,
        },
    )
    chat = server.chat(
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=EXACT,
    )
    got = r.json()["output"][0]["content"][0]["logprobs"]
    want = [t.model_dump() for t in chat.choices[0].logprobs.content]
    assert [t["token"] for t in got] == [t["token"] for t in want]
    # the chat request found the prompt in the cache: its first logits come from another path
    assert [t["logprob"] for t in got] == pytest.approx([t["logprob"] for t in want], abs=1e-5)
    assert [len(t["top_logprobs"]) for t in got] == [2] * 4


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"},
          "tools": [WEATHER]}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "x", "text": {"format": "json"}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "t",
          "schema": {"type": "object", "not": {}}}}}, "text.format.json_schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "include": ["everything"]}, "include"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": []}, "input"),
        ({}, "input"),
    ],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, body, param):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
