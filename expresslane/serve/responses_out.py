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
event. A function call streams as the chat stream sends it (serve/tool_stream.py): its item is
added at its first delta (the message, if any, done before it), its arguments come as
`function_call_arguments.delta` pieces, and it is done when the next call opens or the answer
ends. Text after a call (the Hermes convention allows it) comes as a message of its own after
the calls, whole at the end.
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
            if item["type"] == "message":  # two where text came after a call: joined
                text += item["content"][0]["text"]
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
        self.opened, self.finish, self.message_done = False, None, False
        self.open_call: dict | None = None  # the function_call item streaming: item, index
        self.late = ""  # text after a call (Hermes allows it): a message after the calls
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
        if (text or lp) and self.calls:  # text after a call: one message after the calls
            self.late += text
        elif text or lp:
            if not self.opened:
                out += self._open()
            self.text += text
            self.logprobs += lp
            out.append(self.event("response.output_text.delta", **self._where(), delta=text,
                                  logprobs=lp))  # fmt: skip
        for d in delta.get("tool_calls") or []:
            out += self._call_delta(d)
        if choice.get("finish_reason") is not None:
            self.finish = choice["finish_reason"]
        return out

    def _call_delta(self, d: dict) -> list[str]:
        """A call's first delta opens its item (the message, if any, is done first); the next
        ones are its arguments' pieces."""
        out = []
        if d.get("id"):
            out += self._close_call() + self._close_message()
            merge_call_deltas(self.calls, [d])
            item = {**self.shape.call(self.calls[-1]), "arguments": "", "status": "in_progress"}
            self.open_call = {"item": item, "at": self._next_index()}
            out.append(self.event("response.output_item.added", output_index=self.open_call["at"],
                                  item=item))  # fmt: skip
            d = {"index": d["index"], "function": {"arguments": d["function"].get("arguments")}}
        else:
            merge_call_deltas(self.calls, [d])
        piece = d["function"].get("arguments")
        if piece and self.open_call is not None:
            where = {"item_id": self.open_call["item"]["id"], "output_index": self.open_call["at"]}
            out.append(self.event("response.function_call_arguments.delta", **where, delta=piece))
        return out

    def _next_index(self) -> int:
        return self.base + (1 if self.opened else 0) + len(self.calls) - 1

    def _close_message(self, status: str = "completed") -> list[str]:
        if not self.opened or self.message_done:
            return self._close_reasoning()
        self.message_done = True
        msg = self.shape.message(self.text, status, self.logprobs)
        return [
            self.event("response.output_text.done", **self._where(), text=self.text,
                       logprobs=self.logprobs),
            self.event("response.content_part.done", **self._where(), part=msg["content"][0]),
            self.event("response.output_item.done", output_index=self.base, item=msg),
        ]  # fmt: skip

    def _close_call(self) -> list[str]:
        if self.open_call is None:
            return []
        at, j = self.open_call["at"], len(self.calls) - 1
        item, self.open_call = self.shape.call(self.calls[j]), None
        where = {"item_id": item["id"], "output_index": at}
        return [self.event("response.function_call_arguments.done", **where, name=item["name"],
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=at, item=item)]  # fmt: skip

    def finish_events(self, chat_usage: dict, timings: dict | None) -> tuple[dict, list[str]]:
        """(the whole response, the closing events); its output is the items as they streamed."""
        shape, out = self.shape, self._close_call()
        status = "incomplete" if self.finish == "length" else "completed"
        if not self.calls and not self.opened:
            out += self._open()  # an answer of no text and no call: an empty message
        output = [shape.reasoning(self.thought, "completed")] if self.thought else []
        if self.opened:
            # done at the first call: complete then, whatever the finish
            output.append(shape.message(self.text, status if not self.calls else "completed",
                                        self.logprobs))  # fmt: skip
            out += self._close_message(output[-1]["status"])
        output += [shape.call(c) for c in self.calls]
        if self.late:  # text after a call: a message of its own, after the calls
            late = {**shape.message(self.late, status, None), "id": shape.message_id + "_after"}
            out += [self.event("response.output_item.added", output_index=len(output), item=late),
                    self.event("response.output_item.done", output_index=len(output),
                               item=late)]  # fmt: skip
            output.append(late)
        final = shape.finished(output, usage(chat_usage), self.finish, timings)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return final, [*out, self.event(kind, response=final)]

    def error(self, body: dict) -> str:
        """An `error` event from an OpenAI error body (protocol.error_body)."""
        e = body["error"]
        return self.event("error", code=str(e.get("code")), message=e["message"],
                          param=e.get("param"))  # fmt: skip
