"""OpenAI's Responses API in: `/v1/responses` requests as chat requests, and the stored ones.

The Responses API is the chat API with another shape (what the OpenAI Agents SDK and Codex
speak): `instructions` and `input` items instead of `messages`, flat function tools, `text.format`
instead of `response_format`, and a conversation the server may keep (`previous_response_id`).
A request here becomes a chat request (`to_chat`), so the chat path's template, tools, grammars,
sampling and errors are the ones a Responses client gets; responses_out.py shapes the answer.

Input items, in order, become messages: a `message` (or a bare `{role, content}`) with text
parts; `function_call` items as the assistant's `tool_calls` (merged into the assistant message
before them); `function_call_output` as a `tool` message; `reasoning` items are skipped (this
engine produces none, and a client may echo another model's). Anything else (images, files,
item references, built-in tools) is a 400 naming it, as are the fields this server does not
implement (`background`, `conversation`, `prompt`, `max_tool_calls`, `truncation: "auto"`).
vLLM's sampling extensions (`top_k`, `seed`, penalties, ...) pass through as on chat.

Decision: hints that agents send whatever the model (Codex, the Agents SDK) are accepted and
not applied, as vLLM and llama.cpp's server take them: `reasoning` (this engine runs no
reasoning; the response reports `effort: null`), `text.verbosity`, `include` values that add to
items never produced here. Refusing them would stop those agents at their first request.

Decision: a stored response (`store`, the API's default true) is kept in memory, the most
recent `STORED` of them, for `previous_response_id` and `GET /v1/responses/{id}`. A server is
one process serving one user's agent at batch 1: a database would outlive its purpose, and an
older id is answered with a 404 that says it was dropped or never stored.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Literal

from pydantic import Field

from ..errors import RequestError
from . import protocol as P

STORED = 1024  # responses kept for previous_response_id (oldest dropped first)
# fields passed to the chat request as they are: vLLM's sampling extensions
PASSED = ("seed", "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "prediction",
          "chat_template_kwargs", "priority", "skip_special_tokens", "structured_outputs",
          "include_stop_str_in_output")  # fmt: skip
LOGPROBS = "message.output_text.logprobs"  # the one `include` value that changes the output
# OpenAI's other `include` values: each adds to items this server never produces (reasoning,
# built-in tools' calls, input images), so each is accepted and has nothing to add
INCLUDE_NOTHING = ("reasoning.encrypted_content", "web_search_call.action.sources",
                   "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                   "file_search_call.results", "message.input_image.image_url")  # fmt: skip
# chat's parameter names as a Responses client knows them (in errors)
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
          "response_format": "text.format"}  # fmt: skip


class ResponsesRequest(P._Request):
    """`POST /v1/responses`: OpenAI's fields (the item shapes are checked by `to_chat`)."""

    model_config = P.ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: P.Bool = True
    stream: P.Bool = False
    max_output_tokens: P.Int | None = Field(None, ge=1)
    temperature: P.Float | None = Field(None, ge=0, le=2)
    top_p: P.Float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: P.Bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: P.Int | None = Field(None, ge=0, le=P.MAX_LOGPROBS)
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: P.Bool | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None  # accepted and ignored, as are service_tier and prompt_cache_key


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, param=param)


def refuse_unimplemented(req: ResponsesRequest) -> None:
    """400 for each field whose meaning this server does not implement (module docstring)."""
    extra = req.model_extra or {}
    if req.background:
        raise _bad("background: not supported (responses run in the request)", "background")
    for name in ("conversation", "prompt", "max_tool_calls"):
        if extra.get(name) is not None:
            raise _bad(f"{name}: not supported by this server (leave it out)", name)
    if req.truncation == "auto":
        raise _bad("truncation: 'auto' is not supported (a prompt too long is a 400)", "truncation")
    unknown = [x for x in req.include or () if x != LOGPROBS and x not in INCLUDE_NOTHING]
    if unknown:
        raise _bad(f"include: {unknown[0]!r} is not one of OpenAI's values", "include")


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts (input_text, output_text, ...)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content: expected a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise _bad(f"{where}.content[{j}]: part of type {kind!r} is not supported (text "
                       "only)", "input")  # fmt: skip
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise _bad(f"{where}.content[{j}]: its text must be a string", "input")
        out.append(value)
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key}: required, a string", "input")
    return value


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat messages (module docstring)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role: expected user, system, developer or assistant, got "
                           f"{role!r}", "input")  # fmt: skip
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": text})  # fmt: skip
        elif kind != "reasoning":
            raise _bad(f"{where}: items of type {kind!r} are not supported (messages, "
                       "function_call and function_call_output)", "input")  # fmt: skip
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools as chat's nested ones; built-in tools are a 400."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise _bad(f"tools[{i}]: tools of type {t.get('type')!r} are not supported (only "
                       "function)", "tools")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise _bad(f"tool_choice: type {choice.get('type')!r} is not supported", "tool_choice")
    return choice


def response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's `response_format`."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _bad("text.format: expected an object with a type", "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        keys = ("name", "schema", "strict", "description")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    raise _bad(f"text.format: type {fmt.get('type')!r} is not one of text, json_object, "
               "json_schema", "text.format")  # fmt: skip


def to_chat(req: ResponsesRequest, conversation: list[dict]) -> dict:
    """The chat request body of a Responses request: `conversation` is its earlier turns and
    its own input, as chat messages; `instructions` go first, for this request only."""
    refuse_unimplemented(req)
    messages = list(conversation)
    if req.instructions:  # not carried to the next turn (OpenAI's rule)
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {"model": req.model, "messages": messages, "n": 1, "stream": req.stream}
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in PASSED if k in extra})
    optional = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "tools": chat_tools(req.tools),
                "tool_choice": chat_tool_choice(req.tool_choice),
                "parallel_tool_calls": req.parallel_tool_calls,
                "response_format": response_format(req.text)}  # fmt: skip
    body.update({k: v for k, v in optional.items() if v is not None})
    if LOGPROBS in (req.include or ()):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return body


def renamed(e: RequestError, params: dict[str, str] = PARAMS) -> RequestError:
    """A chat error as the request's own API names it: its parameter by the name the client
    sent (`response_format.json_schema` -> `text.format.json_schema`); `params` maps chat's
    top-level names to the API's."""
    param = getattr(e, "param", None) or ""
    head = param.split(".")[0]
    if head not in params or params[head] == head:
        return e
    new = params[head] + param[len(head) :]
    return RequestError(str(e).replace(param, new, 1), param=new, status_code=e.status_code)


class ResponseStore:
    """The stored responses: id -> (the response object, its conversation as chat messages)."""

    def __init__(self, size: int = STORED):
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def put(self, response: dict, messages: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, messages)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        with self._lock:
            found = self._items.get(rid)
        if found is None:
            raise RequestError(f"Response with id {rid!r} not found (never stored, or dropped: "
                               f"this server keeps the last {self.size})", param=param,
                               status_code=404)  # fmt: skip
        return found

    def delete(self, rid: str) -> None:
        self.get(rid)
        with self._lock:
            self._items.pop(rid, None)


def chat_body(req: ResponsesRequest, store: ResponseStore) -> tuple[bytes, list[dict]]:
    """(the chat body to prepare, the conversation so far: earlier turns and this input)."""
    history = []
    if req.previous_response_id is not None:
        history = store.get(req.previous_response_id, "previous_response_id")[1]
    conversation = [*history, *input_messages(req.input)]
    return json.dumps(to_chat(req, conversation)).encode(), conversation
