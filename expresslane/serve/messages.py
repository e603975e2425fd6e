"""Anthropic's Messages API in: `/v1/messages` requests as chat requests (vLLM's and llama.cpp's
servers take them too, so that Claude Code and the `anthropic` client can drive a local model).

As with the Responses API (responses.py), a request becomes the chat request it stands for, so
the template, tool calls, grammars, sampling, prefix reuse and errors are the chat route's:

- `system` (a string or text blocks) -> a first system message;
- `messages`: user and assistant turns whose `content` is a string or blocks: `text`;
  `tool_use` (an assistant's call: id, name, input) -> the assistant's `tool_calls`;
  `tool_result` (in a user turn: tool_use_id, content) -> a `role: "tool"` message, before the
  turn's text; `thinking` / `redacted_thinking` blocks of earlier turns are skipped (this
  engine produces none); images and documents are a 400 naming them;
- `tools` (`name`, `description`, `input_schema`) -> function tools; `tool_choice` `auto`,
  `any` (-> required), `tool` (-> that function), `none`; `disable_parallel_tool_use` ->
  `parallel_tool_calls: false`;
- `max_tokens` (required, as Anthropic has it), `temperature`, `top_p`, `top_k`,
  `stop_sequences` -> the chat fields (the current `anthropic` client sends the sampling ones
  through `extra_body`);
- `output_config.format` (`{"type": "json_schema", "schema": ...}`: structured outputs, what
  `client.messages.parse(output_format=PydanticModel)` sends) -> `response_format`.

Accepted and not applied, as the servers above take them: `metadata`, `service_tier`,
`thinking` and `output_config.effort` (a model's thinking is its template's, shown as `thinking`
blocks with `serve --reasoning-parser`), `cache_control` on blocks (prefix reuse needs no hint).
`structured_outputs` passes through, as vLLM's extension.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from ..errors import RequestError
from . import protocol as P
from .responses import renamed as rename_param

PASSED = ("seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "min_tokens", "ignore_eos", "chat_template_kwargs", "priority",
          "structured_outputs")  # fmt: skip
SKIPPED_BLOCKS = ("thinking", "redacted_thinking")
# chat's parameter names as an Anthropic client knows them (in errors)
PARAMS = {"messages": "messages", "max_completion_tokens": "max_tokens", "stop": "stop_sequences",
          "response_format": "output_config.format"}  # fmt: skip


class MessagesRequest(P._Request):
    """`POST /v1/messages`: Anthropic's fields (the blocks are checked by `to_chat`)."""

    model_config = P.ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: P.Int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: P.Bool = False
    temperature: P.Float | None = Field(None, ge=0, le=1)
    top_p: P.Float | None = Field(None, gt=0, le=1)
    top_k: P.Int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(msg, param=param)


def _text(blocks: Any, where: str, param: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where}: expected a string or a list of content blocks", param)
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}[{j}]: block of type {kind!r} is not supported here (text)", param)
        out.append(b["text"])
    return "".join(out)


def _tool_use(b: dict, where: str) -> dict:
    for key in ("id", "name"):
        if not isinstance(b.get(key), str):
            raise _bad(f"{where}.{key}: required, a string", "messages")
    if not isinstance(b.get("input"), dict):
        raise _bad(f"{where}.input: required, an object", "messages")
    return {"id": b["id"], "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(b["input"])}}  # fmt: skip


def turn_messages(i: int, turn: dict) -> list[dict]:
    """One Anthropic turn as chat messages."""
    where, role = f"messages[{i}]", turn.get("role")
    if role not in ("user", "assistant"):
        raise _bad(f"{where}.role: expected user or assistant, got {role!r}", "messages")
    content = turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: expected a string or a list of blocks", "messages")
    text, calls, results = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(b, at))
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{at}.tool_use_id: required, a string", "messages")
            body = _text(b.get("content", ""), f"{at}.content", "messages")
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": body})
        elif kind not in SKIPPED_BLOCKS:
            raise _bad(f"{at}: block of type {kind!r} is not supported in a {role} turn "
                       "(text, tool_use, tool_result)", "messages")  # fmt: skip
    out = list(results)
    if text or calls or not results:
        msg: dict = {"role": role, "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom"):  # Anthropic's server tools (web search, ...)
            raise _bad(f"tools[{i}]: tools of type {t.get('type')!r} are not supported (client "
                       "tools: name, input_schema)", "tools")  # fmt: skip
        fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
        if "description" in t:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    raise _bad(f"tool_choice: type {kind!r} is not one of auto, any, tool, none", "tool_choice")


def response_format(config: dict | None) -> dict | None:
    """`output_config.format` as chat's `response_format`."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
        raise _bad("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
                   "output_config.format")  # fmt: skip
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat(req: MessagesRequest) -> dict:
    """The chat request body of a Messages request."""
    messages = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system, "system", "system")})
    for i, turn in enumerate(req.messages):
        messages += turn_messages(i, turn)
    choice, parallel = chat_tool_choice(req.tool_choice)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "n": 1, "stream": req.stream,
                            "max_completion_tokens": req.max_tokens}  # fmt: skip
    extra = req.model_extra or {}
    body.update({k: extra[k] for k in PASSED if k in extra})
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "stop": req.stop_sequences, "tools": chat_tools(req.tools),
                "tool_choice": choice, "parallel_tool_calls": parallel,
                "response_format": response_format(req.output_config)}  # fmt: skip
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def renamed(e: RequestError) -> RequestError:
    """A chat error under the Messages request's parameter name."""
    return rename_param(e, PARAMS)


def chat_body(req: MessagesRequest) -> bytes:
    return json.dumps(to_chat(req)).encode()


def counted(body: bytes) -> bytes:
    """A /v1/messages/count_tokens body: `max_tokens` (which counting ignores) filled in when
    left out; anything but a JSON object is left for the parser to name."""
    try:
        obj = json.loads(body or b"null")
    except ValueError:
        return body
    if not isinstance(obj, dict) or "max_tokens" in obj:
        return body
    return json.dumps({**obj, "max_tokens": 1}).encode()
