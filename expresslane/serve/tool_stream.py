"""Tool calls as they stream: one choice's answer text in, content and `tool_calls` deltas out.

A whole answer is parsed once (tools.parse_calls). A stream decides as the text comes:

- **Content** is the text outside calls. A tail that may begin a call's marker (Hermes
  `<tool_call>`, Mistral `[TOOL_CALLS]`, a Llama 3 answer's leading `{`) is held until it
  cannot, and so is trailing whitespace: a parsed answer's content is stripped when it has calls,
  so the whitespace before a call is never sent; with no call it is sent at the end.
- **A call under a grammar** (`tool_choice` required or named, and `auto` where its free grammar
  applies, tools.answer_grammar: only a call that parses and matches the schema gets through)
  streams as it is written, as vLLM's parsers stream: a delta
  with its id and name once the name is whole, then the arguments' text piece by piece. A long
  argument (a file to write) shows as it is typed, not in one piece at the end.
- **A call no grammar holds** (`auto` where its free grammar does not apply: with min_tokens,
  allowed_token_ids or bad_words, or on an engine without grammars) may not parse, and a sent
  call cannot be taken back. Each
  is held until its JSON object closes, then sent whole if it parses and names a known function.
  If not, it and the rest of the text go out as content at the end, as the parsed answer would
  have it. (One case differs from the parsed answer: calls sent before a broken one stay sent,
  where the parsed answer makes all of the text content.)

A streamed call's arguments are the model's text (a forced call's are compact JSON); a parsed
one's are re-serialized. Both parse to the same object.
"""

from __future__ import annotations

import re

from .tools import ToolPlan, call_id, json_or_none, known_call

_MARKER = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
_PYTHON_TAG = "<|python_tag|>"
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class JsonEnd:
    """Where the JSON value starting at `start` ends, read as its text grows: `end` (the index
    after it) once it has closed, and `args_end` (the index after the last value that closed at
    depth 2: a call object's arguments)."""

    def __init__(self, start: int):
        self.i, self.depth, self.in_str, self.esc = start, 0, False, False
        self.end: int | None = None
        self.args_end: int | None = None

    def feed(self, text: str) -> None:
        while self.end is None and self.i < len(text):
            c, self.i = text[self.i], self.i + 1
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (c == "\\", c != '"')
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self.args_end = self.i
                if self.depth == 0:
                    self.end = self.i


class CallStream:
    """One choice's streamed answer under a ToolPlan (the module docstring)."""

    def __init__(self, plan: ToolPlan):
        # calls held to their schemas by a grammar (forced ones, and `auto` where its free
        # grammar applies: tools.answer_grammar) stream as they are written
        self.plan, self.held = plan, plan.grammar is not None
        self.text, self.pos, self.state = "", 0, "start"
        self.region = 0  # where the call being read began (its marker): content if it breaks
        self.ws = ""  # whitespace held back from the content
        self.calls = 0  # calls sent (each one's first delta)
        self.scan: JsonEnd | None = None
        self.sent: int | None = None  # a held call streaming: the end of its arguments sent

    def push(self, piece: str) -> tuple[str, list[dict]]:
        """(content, tool_call deltas) of the next piece of text."""
        self.text += piece
        content, deltas = [], []
        while self._step(content, deltas):
            pass
        return self._content("".join(content)), deltas

    def finish(self) -> str:
        """The content held back at the end of the answer: a partial marker, whitespace, and a
        call that never closed or did not parse (all of the text after its marker). A forced
        call cut short (`length`) stays as sent, as OpenAI's does."""
        if self.state in ("content", "start"):
            tail = self.text[self.pos :]
        elif self.state in ("bracket", "lead", "call", "broken") and self.sent is None:
            tail = self.text[self.region :]
            if self.calls and self.plan.style == "hermes" and "</tool_call>" not in tail:
                tail = ""  # a call left open after others, cut short: parse_calls drops it too
        else:  # text, trail (a call's end marker cut short), a held call cut short
            tail = ""
        return self._content(tail, final=True)

    # --- the reader: one state change or one piece sent per step --------------------------------
    def _step(self, content: list[str], deltas: list[dict]) -> bool:
        t, style = self.text, self.plan.style
        if self.state == "start":
            if style != "llama3":
                self.state = "content"
                return True
            rest = t[self.pos :].lstrip()
            if not rest:
                return False
            if rest.startswith(_PYTHON_TAG) or rest[0] == "{":
                self.region, self.state = self.pos, "lead"
                self.pos = t.index(rest[0], self.pos) + (len(_PYTHON_TAG) if rest[0] == "<" else 0)
                return True
            if _PYTHON_TAG.startswith(rest):
                return False
            self.state = "text"  # a Llama 3 answer is all calls or all text
            return True
        if self.state == "text":
            content.append(t[self.pos :])
            self.pos = len(t)
            return False
        if self.state == "content":
            return self._read_content(content)
        if self.state == "bracket":
            return self._read_bracket()
        if self.state == "lead":
            return self._read_lead()
        if self.state == "call":
            return self._read_call(deltas)
        if self.state == "trail":
            return self._read_trail()
        return False  # broken: held to the end

    def _read_content(self, content: list[str]) -> bool:
        t, marker = self.text, _MARKER.get(self.plan.style)
        if marker is None:  # Llama 3: text after calls
            self.state = "broken"
            return False
        k = t.find(marker, self.pos)
        if k < 0:
            hold = next((n for n in range(min(len(marker) - 1, len(t) - self.pos), 0, -1)
                         if marker.startswith(t[len(t) - n:])), 0)  # fmt: skip
            content.append(t[self.pos : len(t) - hold])
            self.pos = len(t) - hold
            return False
        content.append(t[self.pos : k])
        self.region, self.pos = k, k + len(marker)
        self.state = "bracket" if self.plan.style == "mistral" else "lead"
        return True

    def _expect(self, char: str) -> int | None:
        """The index of `char`, the next text after whitespace; None while only whitespace has
        come, or when other text has (the state is then broken)."""
        rest = self.text[self.pos :].lstrip()
        if not rest or rest[0] != char:
            self.state = "broken" if rest else self.state
            return None
        return len(self.text) - len(rest)

    def _read_bracket(self) -> bool:
        at = self._expect("[")
        if at is not None:
            self.pos, self.state = at + 1, "lead"
        return at is not None

    def _read_lead(self) -> bool:
        at = self._expect("{")
        if at is not None:
            self.pos, self.scan, self.state = at, JsonEnd(at), "call"
        return at is not None

    def _read_call(self, deltas: list[dict]) -> bool:
        t, scan = self.text, self.scan
        scan.feed(t)
        if self.held and self.sent is None and scan.end is None:
            m = _HEAD.match(t, self.pos)
            name = json_or_none(m.group(1)) if m else None
            if name in self.plan.functions:  # the call's first delta: id and name
                self.sent = m.end()
                deltas.append({"index": self.calls, "id": call_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})  # fmt: skip
        if self.sent is not None:
            upto = scan.i if scan.depth >= 2 else (scan.args_end or self.sent)
            if scan.end is not None:  # the arguments end before the call's closing brace
                upto = len(t[: scan.end - 1].rstrip())
            if upto > self.sent:
                deltas.append({"index": self.calls,
                               "function": {"arguments": t[self.sent : upto]}})  # fmt: skip
                self.sent = upto
        if scan.end is None:
            return False
        if self.sent is None:
            call = known_call(json_or_none(t[self.pos : scan.end]), self.plan)
            if call is None:
                self.state = "broken"
                return False
            deltas.append({"index": self.calls, **call})
        self.calls += 1
        self.sent, self.pos, self.state = None, scan.end, "trail"
        return True

    def _read_trail(self) -> bool:
        t, style = self.text, self.plan.style
        rest = t[self.pos :].lstrip()
        if not rest:
            return False
        at = len(t) - len(rest)
        if style == "hermes":
            end = "</tool_call>"
            if rest.startswith(end):
                self.pos, self.state = at + len(end), "content"
                return True
            if end.startswith(rest):
                return False
        elif rest[0] == ("," if style == "mistral" else ";"):
            self.region, self.pos = self.pos, at + 1
            self.state = "lead"
            return True
        elif style == "mistral" and rest[0] == "]" and not rest[1:].strip():
            self.pos = len(t)
            return False
        self.region, self.state = self.pos, "broken"
        return False

    def _content(self, piece: str, final: bool = False) -> str:
        """`piece` with the whitespace rule of the module docstring."""
        piece = self.ws + piece
        body = piece.rstrip()
        self.ws = piece[len(body) :]
        if final and not self.calls and self.sent is None:
            body, self.ws = piece, ""
        return body


def merge_call_deltas(calls: list[dict], deltas: list[dict]) -> None:
    """Gather streamed `tool_calls` deltas into whole calls ({id, type, function: {name,
    arguments}}) in `calls`, by their index: for a reader that sends each call whole."""
    for d in deltas:
        j = d["index"]
        while len(calls) <= j:
            calls.append({"id": None, "type": "function", "function": {"arguments": ""}})
        call, fn = calls[j], d.get("function") or {}
        call["id"] = d.get("id") or call["id"]
        call["function"]["name"] = fn.get("name") or call["function"].get("name")
        call["function"]["arguments"] += fn.get("arguments") or ""
