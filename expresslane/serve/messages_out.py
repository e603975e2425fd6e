"""Anthropic's Messages API out: a chat answer as a `message`, and its stream of events.

`content` holds a `text` block (absent when the answer is only tool calls) and one `tool_use`
block per call (`input`: the call's arguments as an object). `stop_reason`: `end_turn`,
`max_tokens`, `stop_sequence` (with the `stop_sequence` that matched) or `tool_use`. Usage:
`input_tokens`, `output_tokens`, and `cache_read_input_tokens` for the prompt tokens the KV
cache already held (prefix reuse; `cache_creation_input_tokens` is 0: nothing is billed here).

With `serve --reasoning-parser` (structured/reasoning.py), a thinking model's reasoning comes
first, as a `thinking` block (its `signature` empty: nothing here signs it), streamed as
`thinking_delta`s.

A stream is Anthropic's events (`event: <type>`, `data: <json>`): `message_start`, then per block
`content_block_start`, its deltas (`text_delta`; a tool call's arguments as `input_json_delta`s,
as the chat stream sends them: piece by piece for a forced call, serve/tool_stream.py) and
`content_block_stop`, then `message_delta` (stop reason, output tokens) and `message_stop`. A
failure is an `error` event.
"""

from __future__ import annotations

import json
import uuid

from .tool_stream import merge_call_deltas


def _usage(chat_usage: dict) -> dict:
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": chat_usage["completion_tokens"]}  # fmt: skip


def _stop(finish: str | None, stop_reason, calls: bool) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that matched) of chat's finish."""
    if calls:
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):  # vLLM's stop_reason: the stop string that matched
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:  # an `auto` call whose arguments do not parse: kept as text
        args = {"arguments": call["function"]["arguments"]}
    if not isinstance(args, dict):
        args = {"value": args}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": args}


class MessageShape:
    """One request's answer in the Messages shape."""

    def __init__(self, model: str):
        self.model, self.id = model, f"msg_{uuid.uuid4().hex}"

    def envelope(self, content: list, stop: tuple, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": usage}  # fmt: skip

    @staticmethod
    def content(text: str, calls: list[dict], thought: str | None = None) -> list[dict]:
        blocks = [_tool_use(c) for c in calls]
        if text or not calls:
            blocks.insert(0, {"type": "text", "text": text})
        if thought:
            blocks.insert(0, {"type": "thinking", "thinking": thought, "signature": ""})
        return blocks

    def message(self, chat: dict) -> dict:
        """The `message` of a chat completion (formats.ChatFormat.response)."""
        choice = chat["choices"][0]
        msg, calls = choice["message"], choice["message"].get("tool_calls") or []
        stop = _stop(choice["finish_reason"], choice.get("stop_reason"), bool(calls))
        blocks = self.content(msg.get("content") or "", calls, msg.get("reasoning_content"))
        out = self.envelope(blocks, stop, _usage(chat["usage"]))
        if chat.get("timings") is not None:
            out["timings"] = chat["timings"]  # an extra key, as on chat
        return out


class MessageEvents:
    """The event stream of one message (module docstring), fed chat stream chunks. Blocks are
    opened as their first delta comes, in order (thinking, text, each tool_use), and each is
    closed when the next opens or the answer ends."""

    def __init__(self, shape: MessageShape, prompt_tokens: int):
        self.shape, self.prompt_tokens = shape, prompt_tokens
        self.open: str | None = None  # the kind of the block now open: thinking, text, tool_use
        self.blocks = 0  # blocks started so far; the open one is blocks - 1
        self.texts = 0  # text blocks started
        self.calls: list[dict] = []
        self.finish, self.stop_reason = None, None

    @staticmethod
    def event(kind: str, **fields) -> str:
        return (
            f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"
        )

    def start(self) -> list[str]:
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        msg = self.shape.envelope([], (None, None), usage)
        return [self.event("message_start", message=msg)]

    def _block(self, kind: str, block: dict) -> list[str]:
        """Close the open block and start `block`."""
        out = self._close()
        self.open, self.blocks = kind, self.blocks + 1
        return [*out, self.event("content_block_start", index=self.blocks - 1,
                                 content_block=block)]  # fmt: skip

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.blocks - 1)]

    def _delta(self, delta: dict) -> str:
        return self.event("content_block_delta", index=self.blocks - 1, delta=delta)

    def chunk(self, choice: dict) -> list[str]:
        out, delta = [], choice.get("delta") or {}
        thought, text = delta.get("reasoning_content"), delta.get("content")
        if thought:
            if self.open != "thinking":
                out += self._block("thinking", {"type": "thinking", "thinking": "",
                                                "signature": ""})  # fmt: skip
            out.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if text:
            if self.open != "text":
                out += self._block("text", {"type": "text", "text": ""})
                self.texts += 1
            out.append(self._delta({"type": "text_delta", "text": text}))
        for d in delta.get("tool_calls") or []:
            if d.get("id"):  # a call's first delta: its block opens
                name = d["function"]["name"]
                out += self._block("tool_use", {"type": "tool_use", "id": d["id"], "name": name,
                                                "input": {}})  # fmt: skip
            piece = (d.get("function") or {}).get("arguments")
            if piece:
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
        merge_call_deltas(self.calls, delta.get("tool_calls") or [])
        if choice.get("finish_reason") is not None:
            self.finish, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return out

    def finish_events(self, chat_usage: dict) -> list[str]:
        out = []
        if not self.calls and not self.texts:
            out += self._block("text", {"type": "text", "text": ""})  # a message has a block
        out += self._close()
        stop = _stop(self.finish, self.stop_reason, bool(self.calls))
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        usage = {"output_tokens": chat_usage["completion_tokens"]}
        return [*out, self.event("message_delta", delta=delta, usage=usage),
                self.event("message_stop")]  # fmt: skip

    def error(self, body: dict) -> str:
        e = body["error"]
        return self.event("error", error={"type": e.get("type"), "message": e["message"]})
