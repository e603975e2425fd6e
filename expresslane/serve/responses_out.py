"""OpenAI's Responses API out: a chat answer as a `response` object, and its stream of events.

The chat path answers (formats.ChatFormat: text, tool calls parsed by the template's
convention, logprobs); this file re-shapes that answer. Output items: one `message` with one
`output_text` part (absent when the answer is tool calls alone), then one `function_call` item
per call. `finish_reason: "length"` is `status: "incomplete"` with `incomplete_details.reason:
"max_output_tokens"`. Usage is `input_tokens` / `output_tokens` (cached input tokens: prefix
reuse).

With `serve --reasoning-parser` (structured/reasoning.py), a thinking model's reasoning comes
first, as a `reasoning` item whose `content` is one `reasoning_text` part (streamed as
`response.reasoning_text.delta` events), and goes back into the conversation with the turn.

A stream is the events OpenAI sends, each `event: <type>` and `data: <json>` with a
`sequence_number`: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, (`response.content_part.added`, `response.output_text.delta` ...,
`response.output_text.done`, `response.content_part.done`) or
(`response.function_call_arguments.delta`, `.done`), `response.output_item.done`, and last
`response.completed` (or `response.incomplete`) with the whole response. A failure is an `error`
event. Tool calls are sent whole when the answer ends (the chat stream's call deltas gathered
by tool_stream.merge_call_deltas), so their arguments are one delta.
"""

from __future__ import annotations

import json
import time
import uuid

from .responses import ResponsesRequest
from .tool_stream import merge_call_deltas


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict) -> dict:
    """Chat's usage in the Responses API's names."""
    cached = chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    thought = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": chat_usage["total_tokens"]}  # fmt: skip


class ResponseShape:
    """One request's answer in the Responses shape: its ids, the request's echoed settings."""

    def __init__(self, req: ResponsesRequest, model: str, conversation: list[dict]):
        self.req, self.model, self.conversation = req, model, conversation
        self.id, self.message_id, self.reasoning_id = _id("resp"), _id("msg"), _id("rs")
        self.created = int(time.time())

    def envelope(self, status: str, output: list[dict], usage_: dict | None = None,
                 finish: str | None = None) -> dict:  # fmt: skip
        r = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
            "usage": usage_, "metadata": r.metadata or {}, "user": r.user,
        }  # fmt: skip

    def message(self, text: str, status: str, logprobs: list | None) -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [part]}  # fmt: skip

    def reasoning(self, text: str, status: str) -> dict:
        part = {"type": "reasoning_text", "text": text}
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": [part],
                "status": status}  # fmt: skip

    @staticmethod
    def call(c: dict) -> dict:
        """A chat tool call as a `function_call` item."""
        return {"type": "function_call", "id": "fc_" + c["id"].rsplit("_", 1)[-1],
                "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"], "status": "completed"}  # fmt: skip

    def output(self, text: str, calls: list[dict], finish: str | None, lp: list | None,
               reasoning: str | None = None) -> list:  # fmt: skip
        items = [self.call(c) for c in calls]
        status = "incomplete" if finish == "length" else "completed"
        if text or not calls:
            items.insert(0, self.message(text, status, lp))
        if reasoning:
            items.insert(0, self.reasoning(reasoning, "completed"))
        return items

    def response(self, chat: dict) -> dict:
        """The `response` object of a chat completion (formats.ChatFormat.response)."""
        choice = chat["choices"][0]
        msg, finish = choice["message"], choice["finish_reason"]
        lp = choice["logprobs"]["content"] if choice.get("logprobs") else None
        output = self.output(msg.get("content") or "", msg.get("tool_calls") or [], finish, lp,
                             msg.get("reasoning_content"))  # fmt: skip
        return self.finished(output, usage(chat["usage"]), finish, chat.get("timings"))

    def finished(self, output: list, usage_: dict, finish: str | None, timings) -> dict:
        status = "incomplete" if finish == "length" else "completed"
        out = self.envelope(status, output, usage_, finish)
        out["completed_at"] = int(time.time())
        if timings is not None:
            out["timings"] = timings  # an extra key, as on chat: clients ignore it
        return out

    def turn(self, response: dict) -> list[dict]:
        """The conversation after this response, as chat messages (for previous_response_id)."""
        text, calls, thought = "", [], None
        for item in response["output"]:
            if item["type"] == "message":
                text = item["content"][0]["text"]
            elif item["type"] == "reasoning":
                thought = item["content"][0]["text"]
            else:
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"],
                                           "arguments": item["arguments"]}})  # fmt: skip
        reply: dict = {"role": "assistant", "content": text}
        if thought:  # the chat template sees it as reasoning_content (tokenizer/chat.py)
            reply["reasoning_content"] = thought
        if calls:
            reply["tool_calls"] = calls
        return [*self.conversation, reply]


class ResponseEvents:
    """The event stream of one response (module docstring), fed chat stream chunks."""

    def __init__(self, shape: ResponseShape):
        self.shape, self.seq = shape, 0
        self.text, self.logprobs, self.calls = "", [], []
        self.opened, self.finish = False, None
        self.thought, self.thinking, self.base = "", False, 0  # base: the message's index

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        r = self.shape.envelope("in_progress", [])
        return [self.event("response.created", response=r),
                self.event("response.in_progress", response=r)]  # fmt: skip

    def _where(self) -> dict:
        return {"item_id": self.shape.message_id, "output_index": self.base, "content_index": 0}

    def _open(self) -> list[str]:
        out, self.opened = self._close_reasoning(), True
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            *out,
            self.event("response.output_item.added", output_index=self.base,
                       item={**self.shape.message("", "in_progress", None), "content": []}),
            self.event("response.content_part.added", **self._where(), part=empty),
        ]  # fmt: skip

    def _reasoning_delta(self, text: str) -> list[str]:
        where = {"item_id": self.shape.reasoning_id, "output_index": 0, "content_index": 0}
        out = []
        if not self.thinking:
            self.thinking, self.base = True, 1
            item = {**self.shape.reasoning("", "in_progress"), "content": []}
            out += [self.event("response.output_item.added", output_index=0, item=item),
                    self.event("response.content_part.added", **where,
                               part={"type": "reasoning_text", "text": ""})]  # fmt: skip
        self.thought += text
        return [*out, self.event("response.reasoning_text.delta", **where, delta=text)]

    def _close_reasoning(self) -> list[str]:
        if not self.thinking:
            return []
        self.thinking = False
        where = {"item_id": self.shape.reasoning_id, "output_index": 0, "content_index": 0}
        item = self.shape.reasoning(self.thought, "completed")
        return [self.event("response.reasoning_text.done", **where, text=self.thought),
                self.event("response.content_part.done", **where, part=item["content"][0]),
                self.event("response.output_item.done", output_index=0, item=item)]  # fmt: skip

    def chunk(self, choice: dict) -> list[str]:
        """Events for one chat stream choice (a delta, or the finishing one)."""
        out, delta = [], choice.get("delta") or {}
        if delta.get("reasoning_content"):
            out += self._reasoning_delta(delta["reasoning_content"])
        text = delta.get("content") or ""
        lp = (choice.get("logprobs") or {}).get("content") or []
        if text or lp:
            if not self.opened:
                out += self._open()
            self.text += text
            self.logprobs += lp
            out.append(self.event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=lp))  # fmt: skip
        merge_call_deltas(self.calls, delta.get("tool_calls") or [])
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        return out

    def finish_events(self, chat_usage: dict, timings: dict | None) -> tuple[dict, list[str]]:
        """(the whole response, the closing events)."""
        shape, out = self.shape, self._close_reasoning()
        output = shape.output(self.text, self.calls, self.finish, self.logprobs,
                              self.thought or None)  # fmt: skip
        at = self.base
        if at < len(output) and output[at]["type"] == "message":
            if not self.opened:
                out += self._open()
            msg = output[at]
            out += [
                self.event("response.output_text.done", **self._where(), text=self.text,
                           logprobs=self.logprobs),
                self.event("response.content_part.done", **self._where(),
                           part=msg["content"][0]),
                self.event("response.output_item.done", output_index=at, item=msg),
            ]  # fmt: skip
            at += 1
        for j, item in enumerate(output[at:], start=at):
            where = {"item_id": item["id"], "output_index": j}
            out += [
                self.event("response.output_item.added", output_index=j,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **where,
                           delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **where,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=j, item=item),
            ]  # fmt: skip
        final = shape.finished(output, usage(chat_usage), self.finish, timings)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return final, [*out, self.event(kind, response=final)]

    def error(self, body: dict) -> str:
        """An `error` event from an OpenAI error body (protocol.error_body)."""
        e = body["error"]
        return self.event("error", code=str(e.get("code")), message=e["message"],
                          param=e.get("param"))  # fmt: skip
