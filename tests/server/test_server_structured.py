"""Structured output and tool calls through a real uvicorn, driven by the `openai` client.

The embedded model (trained on Python, not on JSON or tool calls) serves them, so what it
returns here is what the grammar allowed:
`chat.completions.parse(response_format=PydanticModel)` parses, JSON schemas validate, regexes
and choices match, forced tool calls carry arguments that match the function's schema, streamed
or not, and a tool loop (call, tool result, answer) runs. Bad input is a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from marker_kit import marker_tokenizer
from pydantic import BaseModel, Field
from serverkit import NAME, embedded_server, post

from expresslane.serve.tools import plan_tools, prompt_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },  # fmt: skip
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    """The embedded model behind a real uvicorn (a context of 1024 for the tool prompts)."""
    with embedded_server() as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=60)
        yield SimpleNamespace(url=url, client=client)


class Point(BaseModel):  # bounded: the random model would write digits and letters forever
    x: int = Field(ge=0, le=99)
    y: int = Field(ge=-9, le=9)
    label: Literal["a", "b"]
    note: str = Field(max_length=6)


def _chat(s, **kw) -> dict:  # the status beside the body
    r = httpx.post(s.url + "/v1/chat/completions", json={"model": NAME, "messages": ASK, **kw},
                   timeout=60)  # fmt: skip
    return {"status": r.status_code, **r.json()}


def test_parse_pydantic_model(server):
    for temperature in (0.0, 1.0):
        out = server.client.chat.completions.parse(
            model=NAME, messages=ASK, response_format=Point, max_tokens=120,
            temperature=temperature, seed=3,
        )  # fmt: skip
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Point), msg.content


def test_json_schema_json_object_regex_choice(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}  # fmt: skip
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    out = _chat(server, response_format=rf, max_tokens=40)
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
    # penalties apply before the grammar's mask: still valid JSON; min_tokens is refused there
    out = _chat(server, response_format=rf, max_tokens=40, frequency_penalty=1.5,
                presence_penalty=1.0, repetition_penalty=1.3)  # fmt: skip
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
    refused = _chat(server, response_format=rf, min_tokens=3)
    assert refused["status"] == 400 and refused["error"]["param"] == "min_tokens", refused
    out = _chat(server, response_format={"type": "json_object"}, max_tokens=150, seed=1)
    assert "choices" in out, out
    if out["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    so = {"regex": "[a-c]{3}-[0-9]{2}"}
    text = _chat(server, structured_outputs=so, max_tokens=20)["choices"][0]["message"]["content"]
    assert re.fullmatch(so["regex"], text), text
    got = _chat(server, structured_outputs={"choice": ["yes", "no"]}, temperature=1.0, seed=5)
    assert got["choices"][0]["message"]["content"] in ("yes", "no")
    comp = post(server, "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 20,
                                             "guided_regex": "[0-9]{4}"})  # fmt: skip
    assert re.fullmatch("[0-9]{4}", comp["choices"][0]["text"])
    out = _chat(server, json_schema={"type": "integer", "minimum": 5, "maximum": 9})  # llama.cpp
    assert 5 <= json.loads(out["choices"][0]["message"]["content"]) <= 9
    gbnf = 'root ::= "a" ("b" | "c")'
    assert _chat(server, grammar=gbnf)["choices"][0]["message"]["content"] in ("ab", "ac")


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls(server, stream):
    props = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                  max_tokens=120, parallel_tool_calls=False, temperature=0)  # fmt: skip
        if not stream:
            out = server.client.chat.completions.create(**kw)
            calls, finish = out.choices[0].message.tool_calls, out.choices[0].finish_reason
        else:
            deltas, finish = [], None
            for chunk in server.client.chat.completions.create(**kw, stream=True):
                deltas += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            # the first delta of a call has its id and name; its arguments come in the deltas
            # from there on, as many as the stream's chunks cut them into (tokens that come
            # faster than the client reads share a chunk: tests/test_tool_stream.py has the
            # pieces themselves)
            calls = [d for d in deltas if d.id]
            assert {d.index for d in deltas} == {0} and deltas[0].id
            calls[0].function.arguments = "".join(d.function.arguments or "" for d in deltas)
        assert finish == "tool_calls" and len(calls) == 1
        fn = calls[0].function
        assert fn.name in ("get_weather", "get_time")
        if isinstance(choice, dict):
            assert fn.name == "get_weather"
            jsonschema.validate(json.loads(fn.arguments), props)
        assert calls[0].id.startswith("call_")


@pytest.mark.parametrize("style", ["mistral", "llama3"])
def test_calls_in_a_native_convention_whose_marker_is_a_special_token(tmp_path, style):
    """A template in the Mistral or Llama 3 convention, its marker a special token: forced
    calls come back as tool_calls, streamed or not (the marker's token stays in the text that
    is parsed), and an `auto` answer is text without the marker or calls that validate."""
    folder, ids = marker_tokenizer(tmp_path, style)
    props = WEATHER["function"]["parameters"]
    with embedded_server(tokenizer=folder) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=60)
        kw = dict(model=NAME, messages=ASK, tools=[WEATHER], max_tokens=100, temperature=0)
        out = client.chat.completions.create(**kw, tool_choice="required")
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
        jsonschema.validate(json.loads(calls[0].function.arguments), props)
        deltas = [d for c in client.chat.completions.create(**kw, tool_choice="required",
                  stream=True) for d in c.choices[0].delta.tool_calls or []]  # fmt: skip
        assert deltas and deltas[0].function.name == "get_weather"
        args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
        assert json.loads(args) == json.loads(calls[0].function.arguments)
        for seed in range(3):
            auto = client.chat.completions.create(**{**kw, "temperature": 1.0}, seed=seed)
            msg = auto.choices[0].message
            for call in msg.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), props)
            assert not any(m in (msg.content or "") for m in ids), msg.content


def test_tool_loop(server):
    """call -> the tool's result in a role 'tool' message -> an answer without calls."""
    messages = list(ASK)
    out = server.client.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER], tool_choice="required", max_tokens=80
    )
    call = out.choices[0].message.tool_calls[0]
    messages.append(out.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'})
    final = server.client.chat.completions.create(
        model=NAME, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")


def test_a_history_call_whose_arguments_do_not_parse(server):
    """OpenAI's arguments are text that need not parse: such a call goes back as written (it
    was a 500), and a parsable one renders as before."""
    calls = {"bad": "{oops", "good": '{"city": "Paris"}', "object": {"city": "Paris"},
             "null": None}  # fmt: skip
    rendered = {}
    for kind, args in calls.items():
        call = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                "arguments": args}}  # fmt: skip
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
        assert _chat(server, messages=history, tools=[WEATHER], max_tokens=2)["status"] == 200
        plan = plan_tools({"tools": [WEATHER]}, template="")
        messages, _ = prompt_messages(history, plan)
        rendered[kind] = messages[-2]["content"]
    assert '"arguments": {oops}' in rendered["bad"]
    assert rendered["good"] == rendered["object"] and '"arguments": {}' in rendered["null"]
    assert json.loads(rendered["good"].split("\n")[1])["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "object", "not": {}}}}}, "response_format.json_schema", "not"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
            "type": "string", "format": "weird"}}}}, "response_format.json_schema", "weird"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex", "regex"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "one structured output"),
    ],
)  # fmt: skip
def test_bad_structured_input_is_a_400(server, body, param, words):
    out = _chat(server, **body)
    assert out["status"] == 400, out
    assert out["error"]["param"] == param and words in out["error"]["message"], out


def test_openai_client_raises_on_bad_schema(server):
    with pytest.raises(openai.BadRequestError, match="not"):
        server.client.chat.completions.create(
            model=NAME, messages=ASK, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "not": {"type": "string"}}}},
        )  # fmt: skip


def test_llm_cli_schema(server, tmp_path):
    """Simon Willison's `llm` with `--schema`, the server as an extra OpenAI model."""
    exe = shutil.which("llm", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("the llm package is not installed")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: {NAME}\n  model_name: {NAME}\n  api_base: {server.url}/v1\n"
        "  supports_schema: true\n"
    )
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
              "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["name", "n"],
              "additionalProperties": False}  # fmt: skip
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "dummy"}
    out = subprocess.run(
        [exe, "-m", NAME, "--schema", json.dumps(schema), "-o", "max_tokens", "60", "--no-log",
         "Name a thing and a digit."],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), schema)


def test_tool_call_parser_names_a_native_templates_convention():
    """vLLM's --tool-call-parser: a template that renders tools gets the named convention in
    place of the one read from its text; the generic prompt (no tools in the template) asks
    for Hermes calls whatever is named; a name not known here exits 2 (ConfigError)."""
    from expresslane.errors import ConfigError
    from expresslane.serve.guards import ServeLimits

    native = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>"
    extra = {"tools": [WEATHER], "tool_choice": "required"}
    assert plan_tools(extra, native).style == "hermes"
    forced = plan_tools(extra, native, "mistral")
    assert forced.style == "mistral" and '"[TOOL_CALLS]"' in forced.grammar.source
    assert plan_tools(extra, native, "llama3_json").style == "llama3"
    assert plan_tools(extra, "{{ messages }}", "mistral").style == "hermes"
    with pytest.raises(ConfigError, match="--tool-call-parser pythonic"):
        ServeLimits(tool_call_parser="pythonic").validate()
