"""`run --interactive` (`-i`): a conversation in the terminal, as llama.cpp's conversation mode
and gpt-fast's `--interactive` offer.

Each line read is a user turn; the answer streams back, and the whole conversation so far is the
next turn's prompt, rendered with the chat template. The KV cache still holds the earlier turns
(prefix reuse), so a turn prefills only its new tokens: the figures after each answer say how
many prompt tokens were reused. `/reset` starts a new conversation, `/exit` (or the end of the
input, Ctrl-D) ends; Ctrl-C stops an answer where it is (it is kept, as said so far), and a
second Ctrl-C at the prompt ends. A conversation that no longer fits the context is refused,
naming it, and the prompt comes back: `/reset` makes room.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import TextIO

from ..errors import RequestError
from ..sampling.params import SamplingParams
from ..textgen import stream_text
from ..tokenizer import Tokenizer

HELP = "(a conversation: a line is a turn; /reset starts over, /exit or Ctrl-D ends)"


def chat_loop(engine, tok: Tokenizer, params: SamplingParams, out: TextIO,
              read: Callable[[str], str] = input, stop: tuple[str, ...] = ()) -> int:  # fmt: skip
    """Turns from `read` until /exit or its end; answers and figures to `out`. Returns 0."""
    out.write(HELP + "\n")
    history: list[dict] = []
    while True:
        try:
            text = read("> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = []
            out.write("(a new conversation)\n")
            continue
        if not text:
            continue
        turn = [*history, {"role": "user", "content": text}]
        ids = tok.encode(tok.apply_chat_template(turn), add_special_tokens=False)
        try:
            engine.check_prompt(ids)
        except RequestError as e:
            out.write(f"error: {e} (/reset starts a new conversation)\n")
            continue
        answer = _answer(engine, tok, ids, params, stop, out)
        history = [*turn, {"role": "assistant", "content": answer}]


def _answer(engine, tok, ids, params, stop, out: TextIO) -> str:
    pieces: list[str] = []
    with _stoppable() as cancel:
        for piece, _ in stream_text(engine, tok, ids, params, stop, cancel):
            pieces.append(piece)
            out.write(piece)
            out.flush()
    st = engine.stats
    out.write(f"\n[{st.prompt_tokens} prompt tokens, {st.cached_tokens} reused, time to first "
              f"token {st.ttft_s * 1e3:.1f} ms, {st.decode_tokens_per_s:.1f} tokens/s, "
              f"{st.generated_tokens} tokens, finish: {st.finish_reason}]\n")  # fmt: skip
    return "".join(pieces)


@contextmanager
def _stoppable():
    """A cancel event that Ctrl-C sets while an answer streams (the engine stops between two
    steps, its cache consistent), where Python would raise inside the step. Off the main
    thread (no signals there) the event is simply never set."""
    cancel = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return
    before = signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, before)
