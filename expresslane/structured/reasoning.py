"""A thinking model's reasoning, split from its answer: `serve --reasoning-parser`, as vLLM's.

Thinking models (DeepSeek-R1 and its distills, QwQ, Qwen3) write their reasoning first, between
<think> and </think>, then the answer. With a parser chosen at `serve`, the chat route returns
the reasoning apart from the answer, in `reasoning_content` (llama.cpp's server and DeepSeek's API)
and in `reasoning` (vLLM's name since 0.11): the same text in both, since clients read one or the
other. The answer's `content` and its tool calls come from the text after </think> alone. The
Responses API returns the reasoning as a `reasoning` item, the Messages API as a `thinking`
block. A request's `include_reasoning: false` (vLLM's) leaves it out.

The rules, vLLM's parsers':
- `deepseek_r1`: the output is reasoning until </think> (the template opens <think> in the
  prompt; a <think> the model writes anyway is dropped). No </think>: all of it is reasoning, a
  thought cut short by max_tokens.
- `qwen3`: reasoning only when the output opens with <think>. With `chat_template_kwargs:
  {"enable_thinking": false}` the template writes an empty <think></think> into the prompt, and
  the answer comes with no tags: all of it is content.
The answer after </think> loses its leading whitespace (the template's blank line).

A grammar (response_format, structured_outputs, a forced tool call) holds the answer after the
thought: structured/grammar.py wraps it, unless the request turns thinking off, and
structured/decoding.py ends a thought that would leave the answer no room.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def split(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output; reasoning None where the output has none."""
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START) :]
    elif parser == "qwen3":
        return None, text
    else:
        body = text
    head, sep, tail = body.partition(END)
    return head, tail.lstrip() if sep else ""


def thought_end(text: str, parser: str) -> int:
    """How many characters of `text` the thought takes, its tags included (0 where it has
    none): `split`'s rules, as positions."""
    body = text.lstrip()
    if body.startswith(START):
        start = len(text) - len(body) + len(START)
    elif parser == "qwen3":
        return 0
    else:
        start = 0
    at = text.find(END, start)
    return len(text) if at < 0 else at + len(END)


def thought_tokens(pieces: list[str], parser: str) -> int:
    """How many of an output's tokens belong to the thought (OpenAI's `reasoning_tokens`):
    those that begin before its end. `pieces`: each token's text in order, "" for a token whose
    bytes the next one completes."""
    text = "".join(pieces)
    end, at, n = thought_end(text, parser), 0, 0
    if end == len(text) and not text.endswith(END) and split(text, parser)[0] is not None:
        return len(pieces)  # a thought never closed (cut by max_tokens): all of it
    for piece in pieces:
        if at >= end:
            break
        n, at = n + 1, at + len(piece)
    return n


def _partial_end(text: str) -> int:
    """The length of the longest end of `text` that begins END (held back: it may become one)."""
    for n in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """`split` over streamed text: push(text) -> (reasoning delta, content delta), holding back
    what may still turn out to be a tag; flush() at the end. The deltas of any chunking add up to
    split(whole text), an empty reasoning standing for none (as the answers show it)."""

    def __init__(self, parser: str):
        self.parser, self.state, self.held = parser, "start", ""

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                body = self.held.lstrip()
                if len(body) < len(START) and START.startswith(body):
                    return reasoning, content  # still may open with <think>
                if body.startswith(START):
                    self.held, self.state = body[len(START) :], "think"
                elif self.parser == "qwen3":
                    self.state = "answer"
                else:
                    self.state = "think"
            elif self.state == "think":
                at = self.held.find(END)
                if at < 0:
                    keep = _partial_end(self.held)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep :]
                    return reasoning, content
                reasoning += self.held[:at]
                self.held, self.state = self.held[at + len(END) :], "gap"
            elif self.state == "gap":  # the whitespace after </think>
                body = self.held.lstrip()
                if not body:
                    self.held = ""
                    return reasoning, content
                self.held, self.state = body, "answer"
            else:
                content, self.held = content + self.held, ""
                return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What was held back, at the end of the output."""
        held, self.held = self.held, ""
        if self.state == "start":
            if self.parser == "qwen3":
                return "", held
            return held, ""
        return (held, "") if self.state == "think" else ("", "")
