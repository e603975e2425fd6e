"""A request's work and its channel: what the HTTP side submits (`Job`, one or more
`ChoiceSpec`s: a prompt, its sampling parameters and stop strings), the `Event`s the engine
thread (worker.py) sends back through the job, and the event loop's side of that channel:
waking only when it waits (a fast decode loop does not pay one cross-thread call per token),
gathering a response (`collect`, `Accumulator`), and cancelling a job whose client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class TokenInfo:
    """One token of a choice: its id, logprob and top alternatives (when asked for)."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    rank: int | None = None  # in the vocabulary, 1 the most likely (vLLM's prompt_logprobs)


@dataclass
class ChoiceSpec:
    """One sequence to generate: choice `index` of a request."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    echo_logprobs: bool = False  # score the prompt first (completions `echo` + `logprobs`)
    include_stop: bool = False  # vLLM's include_stop_str_in_output
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and top n
    pool: str | None = None  # /v1/embeddings: the prompt's pooled vector instead of generating


@dataclass
class Event:
    """What the worker sends back: "echo", "prompt_logprobs", "delta", "embedding", "finish" or
    "error"."""

    kind: str
    index: int = 0
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)  # with logprobs only
    count: int = 0  # generated tokens this event covers
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: Exception | None = None
    vector: torch.Tensor | None = None  # "embedding": the pooled vector (fp32, CPU)


@dataclass
class Timings:
    """Monotonic clock readings and counts for one request, over all its choices."""

    arrival: float
    start: float | None = None
    first_token: float | None = None
    end: float | None = None
    prompt_tokens: int = 0  # distinct prompts (usage)
    cached_tokens: int = 0  # of those, tokens the KV cache already held (prefix reuse)
    prefill_tokens: int = 0  # tokens prefilled, every choice counted
    completion_tokens: int = 0
    prefill_s: float = 0.0  # engine: request start -> first token, summed over choices
    decode_s: float = 0.0  # engine: first token -> last token, summed over choices
    decode_steps: int = 0  # tokens after the first of each choice
    speculative: dict | None = None  # drafted / kept so far, all choices (live; None: off)

    def as_dict(self) -> dict:
        """The `timings` object every response carries (OpenAI clients ignore it)."""

        def ms(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round((b - a) * 1e3, 3)

        end = self.end if self.end is not None else time.monotonic()
        tps = self.decode_steps / self.decode_s if self.decode_steps and self.decode_s else None
        pps = self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else None
        out = {
            "queue_ms": ms(self.arrival, self.start),
            "ttft_ms": ms(self.arrival, self.first_token),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tokens_per_s": None if pps is None else round(pps, 2),
            "completion_tokens": self.completion_tokens,
            "decode_ms": round(self.decode_s * 1e3, 3),
            "decode_tokens_per_s": None if tps is None else round(tps, 2),
            "e2e_ms": ms(self.arrival, end),
        }
        if self.speculative is not None:
            out["speculative"] = self.speculative
        return out


class Job:
    """One request in the queue; a thread-safe channel of Events from the worker to the loop."""

    def __init__(self, choices: list[ChoiceSpec], loop: asyncio.AbstractEventLoop):
        self.choices = choices
        self.cancel = threading.Event()
        self.timings = Timings(arrival=time.monotonic())
        self.seq = -1  # arrival number, set by Worker.submit
        self._loop = loop
        self._lock = threading.Lock()
        self._items: deque[Event] = deque()
        self._wake = asyncio.Event()
        self._waiting = False
        self._closed = False

    def predicted(self) -> dict | None:
        """The speculation figures of a request that brought a prediction (its usage details)."""
        if not any(c.params.prediction for c in self.choices):
            return None
        return self.timings.speculative or {}

    def put(self, event: Event) -> None:
        """Worker side: queue an event, waking the loop only if it sleeps on this job."""
        with self._lock:
            self._items.append(event)
            wake, self._waiting = self._waiting, False
        if wake:
            self._loop.call_soon_threadsafe(self._wake.set)

    def close(self) -> None:
        """Worker side: no more events."""
        with self._lock:
            self._closed = True
            wake, self._waiting = self._waiting, False
        if wake:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def next_batch(self) -> list[Event] | None:
        """Loop side: every event available now (waiting for at least one); None at the end."""
        while True:
            with self._lock:
                if self._items:
                    batch = list(self._items)
                    self._items.clear()
                    return batch
                if self._closed:
                    return None
                self._waiting = True
                self._wake.clear()
            await self._wake.wait()


# --- the event loop's side of a job -----------------------------------------------------------
@dataclass
class Accumulator:
    """One choice of a non-streaming response, built up from the worker's events."""

    pieces: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    echo: list[TokenInfo] = field(default_factory=list)
    prompt: list[TokenInfo] | None = None  # vLLM's prompt_logprobs, when asked
    vector: torch.Tensor | None = None  # /v1/embeddings' pooled vector
    count: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, ev: Event) -> None:
        if ev.kind == "echo":
            self.echo = ev.tokens
        elif ev.kind == "prompt_logprobs":
            self.prompt = ev.tokens
        elif ev.kind == "embedding":
            self.vector = ev.vector
        elif ev.kind == "delta":
            self.pieces.append(ev.text)
            self.tokens.extend(ev.tokens)
            self.count += ev.count
        elif ev.kind == "finish":
            self.finish_reason, self.stop_reason = ev.finish_reason, ev.stop_reason


def coalesce(batch: list[Event]) -> list[Event]:
    """Merge consecutive deltas of one choice: one SSE chunk per choice per wake-up."""
    out: list[Event] = []
    for ev in batch:
        prev = out[-1] if out else None
        if ev.kind == "delta" and prev and prev.kind == "delta" and prev.index == ev.index:
            prev.text += ev.text
            prev.tokens = prev.tokens + ev.tokens
            prev.count += ev.count
        else:
            out.append(ev)
    return out


Receive = Callable[[], Awaitable[dict]]  # the ASGI receive channel of the request


@contextlib.asynccontextmanager
async def cancel_on_disconnect(job: Job, receive: Receive):
    """Cancel `job` when the client disconnects (ASGI `http.disconnect`) or the block exits.

    This is vLLM's `with_cancellation` idea: it works for streaming and non-streaming
    responses alike, and during prefill, when nothing is being sent that could fail.
    """

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        job.cancel.set()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        job.cancel.set()  # a no-op once the job has finished


async def collect(job: Job, receive: Receive) -> dict[int, Accumulator]:
    """Wait for a whole job; an error event is raised."""
    accs = {spec.index: Accumulator() for spec in job.choices}
    async with cancel_on_disconnect(job, receive):
        while (batch := await job.next_batch()) is not None:
            for ev in batch:
                if ev.kind == "error":
                    raise ev.error
                accs[ev.index].add(ev)
    return accs
