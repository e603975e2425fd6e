"""Responses assembled from the worker's events: one JSON body, or the chunks of a stream.

`CompletionFormat` (/v1/completions, with echo and logprobs) and `ChatFormat`
(/v1/chat/completions) build OpenAI's shapes; schema.py documents them.
"""

from __future__ import annotations

import dataclasses
import time

from ..structured.reasoning import ReasoningStream, split, thought_tokens
from .jobs import Accumulator, Event, TokenInfo
from .logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from .protocol import new_id
from .tool_stream import CallStream
from .tools import ToolPlan, parse_calls


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          predicted: dict | None = None) -> dict:  # fmt: skip
    """OpenAI's usage; `predicted`: a prediction's speculation figures (SpecStats.as_dict)."""
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},  # prefix reuse
    }
    if predicted is not None:  # OpenAI's counts: drafts from the prediction kept, not kept
        names = ("accepted_prediction_tokens", "rejected_prediction_tokens")
        out["completion_tokens_details"] = {k: predicted.get(k, 0) for k in names}
    return out


class _Format:
    def __init__(self, model: str, text: TokenText, prefix: str):
        self.model, self.text = model, text
        self.rid, self.created = new_id(prefix), int(time.time())

    def envelope(self, obj: str | None = None) -> dict:
        return {
            "id": self.rid,
            "object": obj or self.chunk_object,
            "created": self.created,
            "model": self.model,
        }

    def tally(self, batch: list[Event]) -> None:
        """A stream's events as the worker sent them, a token each, before they are merged."""

    def count_reasoning(self, usage: dict, accs: dict[int, Accumulator] | None = None) -> dict:
        """`usage`, with the reasoning's token count where the format splits reasoning out."""
        return usage


class CompletionFormat(_Format):
    """`/v1/completions`: the response and its stream chunks.

    `echo` maps a choice to its echoed prompt text; `added` to how many of its prompt tokens the
    tokenizer put before and after that text (zero-width in `text_offset`).
    """

    chunk_object = "text_completion"

    def __init__(
        self,
        model: str,
        text: TokenText,
        echo: dict[int, str],
        logprobs: bool,
        added: dict[int, tuple[int, int]] | None = None,
        contexts: dict[int, list[int]] | None = None,
        skip_special_tokens: bool = False,
    ):
        super().__init__(model, text, "cmpl")
        self.skip = skip_special_tokens  # as the generated text was decoded
        self.echo, self.logprobs, self.added = echo, logprobs, added or {}
        self.contexts = contexts or {}  # a choice's prompt ids: the generated text's context
        self._sent: dict[int, int] = {}  # streaming: characters sent per choice
        self._offsets: dict[int, TextOffsets] = {}

    def _choice(
        self,
        i: int,
        text: str,
        lp: dict | None = None,
        finish: str | None = None,
        stop: int | str | None = None,
    ) -> dict:
        return {
            "index": i,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": stop,
        }

    def _echo_offsets(self, i: int, tokens: list[TokenInfo]) -> list[int]:
        before, after = self.added.get(i, (0, 0))
        n = len(tokens)
        zero = [k < before or k >= n - after for k in range(n)]
        echo = self.echo.get(i, "")
        return TextOffsets(self.text.tok).take([t.id for t in tokens], len(echo), zero)

    def _generated_offsets(self, i: int, start: int) -> TextOffsets:
        return TextOffsets(self.text.tok, start, self.contexts.get(i, ()), self.skip)

    def start(self) -> list[dict]:
        # With logprobs the echo comes from the worker, scored; without, it is sent at once.
        if self.logprobs:
            return []
        self._sent = {i: len(t) for i, t in self.echo.items()}
        return [self._choice(i, t) for i, t in self.echo.items()]

    def chunk(self, ev: Event) -> dict | None:
        i = ev.index
        if ev.kind == "echo":
            echo = self.echo.get(i, "")
            self._sent[i] = len(echo)
            lp = completion_logprobs(ev.tokens, self.text, self._echo_offsets(i, ev.tokens))
            return self._choice(i, echo, lp)
        if ev.kind == "delta":
            if not ev.text and not ev.tokens:
                return None
            start = self._sent.get(i, 0)
            self._sent[i] = start + len(ev.text)
            lp = None
            if self.logprobs:
                track = self._offsets.setdefault(i, self._generated_offsets(i, start))
                offsets = track.take([t.id for t in ev.tokens], self._sent[i])
                lp = completion_logprobs(ev.tokens, self.text, offsets)
            return self._choice(i, ev.text, lp)
        return self._choice(i, "", None, ev.finish_reason, ev.stop_reason)

    def response(self, accs: dict[int, Accumulator], usage: dict, timings: dict) -> dict:
        choices = []
        for i, a in sorted(accs.items()):
            echo = self.echo.get(i, "")
            text = echo + a.text
            lp = None
            if self.logprobs:
                offsets = self._echo_offsets(i, a.echo) + self._generated_offsets(
                    i, len(echo)
                ).take([t.id for t in a.tokens], len(text))
                lp = completion_logprobs(a.echo + a.tokens, self.text, offsets)
            choices.append(self._choice(i, text, lp, a.finish_reason, a.stop_reason))
            if a.prompt is not None:  # vLLM's, per choice
                choices[-1]["prompt_logprobs"] = prompt_logprobs(a.prompt, self.text)
        return {**self.envelope(), "choices": choices, "usage": usage, "timings": timings}


class ChatFormat(_Format):
    """`/v1/chat/completions`: the response and its stream chunks."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, text: TokenText, n: int, logprobs: bool,
                 tools: ToolPlan | None = None, echo: str = "", reasoning: str | None = None,
                 include_reasoning: bool = True):  # fmt: skip
        """`echo`: text every answer begins with (vLLM's chat echo of a trailing assistant
        message). `reasoning`: the parser splitting the reasoning out (structured/reasoning.py)."""
        super().__init__(model, text, "chatcmpl")
        self.n, self.logprobs, self.echo = n, logprobs, echo
        self.tools = tools  # its calls are parsed out of the text (tools.py)
        self._calls: dict[int, CallStream] = {}  # per choice, streaming with tools
        self.parser, self.show = reasoning, include_reasoning
        self._thought: dict[int, ReasoningStream] = {}  # per choice, streaming
        self._pieces: dict[int, list[str]] = {}  # per choice, streaming: each token's text

    def tally(self, batch: list[Event]) -> None:
        if self.parser:  # where the thought ends in tokens, which merged chunks no longer show
            for ev in batch:
                if ev.kind == "delta":
                    self._pieces.setdefault(ev.index, []).append(ev.text)

    def count_reasoning(self, usage: dict, accs: dict[int, Accumulator] | None = None) -> dict:
        """OpenAI's `completion_tokens_details.reasoning_tokens`, all choices', with a parser:
        from the accumulated answers, or from a stream's tally."""
        if not self.parser:
            return usage
        pieces = {i: a.pieces for i, a in accs.items()} if accs is not None else self._pieces
        n = sum(thought_tokens(p, self.parser) for p in pieces.values())
        details = {**usage.get("completion_tokens_details", {}), "reasoning_tokens": n}
        return {**usage, "completion_tokens_details": details}

    def _lp(self, tokens: list[TokenInfo]) -> dict | None:
        return {"content": chat_logprobs(tokens, self.text)} if self.logprobs else None

    def start(self) -> list[dict]:
        return [
            {
                "index": j,
                "delta": {"role": "assistant", "content": self.echo},
                "logprobs": None,
                "finish_reason": None,
            }
            for j in range(self.n)
        ]

    def chunk(self, ev: Event) -> dict | None:
        if self.parser is None or ev.kind not in ("delta", "finish"):
            return self._answer_chunk(ev)
        stream = self._thought.setdefault(ev.index, ReasoningStream(self.parser))
        if ev.kind == "delta":
            thought, text = stream.push(ev.text)
            out = self._answer_chunk(dataclasses.replace(ev, text=text))
        else:  # what the parser held back is answer text: sent as a delta, then the finish
            thought, text = stream.flush()
            early = self._answer_chunk(Event("delta", ev.index, text)) if text else None
            out = self._answer_chunk(ev)
            if early and out:
                out["delta"] = _joined(early["delta"], out["delta"])
        if not (thought and self.show):
            return out
        out = out or {"index": ev.index, "delta": {}, "logprobs": None, "finish_reason": None}
        if not out["delta"].get("content"):
            out["delta"].pop("content", None)
        out["delta"] = {"reasoning_content": thought, "reasoning": thought, **out["delta"]}
        return out

    def _answer_chunk(self, ev: Event) -> dict | None:
        if self.tools is not None and ev.kind in ("delta", "finish"):
            return self._tool_chunk(ev)
        if ev.kind == "delta":
            if not ev.text and not ev.tokens:
                return None
            return {
                "index": ev.index,
                "delta": {"content": ev.text},
                "logprobs": self._lp(ev.tokens),
                "finish_reason": None,
            }
        if ev.kind == "finish":
            return {
                "index": ev.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": ev.finish_reason,
                "stop_reason": ev.stop_reason,
            }
        return None

    def _tool_chunk(self, ev: Event) -> dict | None:
        """A stream chunk where the text may hold tool calls (serve/tool_stream.py): content
        and `tool_calls` deltas as the text comes, what was held back at the finish."""
        i = ev.index
        stream = self._calls.setdefault(i, CallStream(self.tools))
        if ev.kind == "delta":
            content, calls = stream.push(ev.text)
            lp = self._lp(ev.tokens)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
            return {"index": i, "delta": delta, "logprobs": lp,
                    "finish_reason": None} if delta or lp else None  # fmt: skip
        rest, finish = stream.finish(), ev.finish_reason
        return {"index": i, "delta": {"content": rest} if rest else {}, "logprobs": None,
                "finish_reason": "tool_calls" if stream.calls and finish == "stop" else finish,
                "stop_reason": ev.stop_reason}  # fmt: skip

    def _message(self, text: str, finish: str | None) -> tuple[dict, str]:
        """(the message, the finish reason): calls parsed when tools apply."""
        msg: dict = {"role": "assistant", "content": text}
        if self.tools is None or not text:
            return msg, finish
        content, calls = parse_calls(text, self.tools)
        if not calls:
            return msg, finish
        msg["content"], msg["tool_calls"] = content, calls
        return msg, "tool_calls" if finish == "stop" else finish

    def response(self, accs: dict[int, Accumulator], usage: dict, timings: dict) -> dict:
        choices = []
        for i, a in sorted(accs.items()):
            thought, answer = split(a.text, self.parser) if self.parser else (None, a.text)
            message, finish = self._message(answer, a.finish_reason)
            if self.parser and self.show:  # vLLM's field and llama.cpp's, the same text
                message["reasoning_content"] = message["reasoning"] = thought or None
            if self.echo:
                message["content"] = self.echo + (message.get("content") or "")
            choices.append({"index": i, "message": message, "logprobs": self._lp(a.tokens),
                            "finish_reason": finish, "stop_reason": a.stop_reason})  # fmt: skip
        out = {**self.envelope("chat.completion"), "choices": choices,
               "usage": self.count_reasoning(usage, accs), "timings": timings}  # fmt: skip
        scored = next((a.prompt for a in accs.values() if a.prompt is not None), None)
        if scored is not None:  # vLLM's, once for the request: its choices share the prompt
            out["prompt_logprobs"] = prompt_logprobs(scored, self.text)
        return out


def _joined(a: dict, b: dict) -> dict:
    """Two deltas as one: their content and tool_calls in order."""
    out = {**a, **b}
    for key in ("content", "tool_calls"):
        if a.get(key) and b.get(key):
            out[key] = a[key] + b[key]
    return out
