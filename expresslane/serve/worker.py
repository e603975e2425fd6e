"""The engine thread: one FIFO queue of jobs, one request on the device at a time.

The HTTP side builds a `Job` (one or more `ChoiceSpec`s: a prompt, its sampling parameters and
stop strings) and `submit`s it. The worker thread takes jobs in arrival order and runs each
choice through `stream_text`, pushing `Event`s back to the event loop through the job's
channel. The event loop is woken only when it is actually waiting, so a fast decode loop does
not pay one cross-thread call per token.

Cancellation: `job.cancel` is the engine's own `cancel` event, checked between prefill chunks
and before every decode step; a job cancelled while still queued is skipped. Metrics (queue
time, TTFT, inter-token latency, decode tokens/s, token counters, finish reasons, running and
waiting gauges) are recorded here, where the tokens are produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from ..config import SamplingParams
from ..engine import Engine
from ..errors import ExpressLaneError
from ..speculative.drafting import combine
from ..textgen import stream_text
from ..tokenizer import Tokenizer
from .metrics import Metrics

log = logging.getLogger("expresslane.serve")


@dataclass
class TokenInfo:
    """One token of a choice: its id, logprob and top alternatives (when asked for)."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class ChoiceSpec:
    """One sequence to generate: choice `index` of a request."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    echo_logprobs: bool = False  # score the prompt first (completions `echo` + `logprobs`)
    include_stop: bool = False  # vLLM's include_stop_str_in_output


@dataclass
class Event:
    """What the worker sends back: "echo", "delta", "finish" or "error"."""

    kind: str
    index: int = 0
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)  # with logprobs only
    count: int = 0  # generated tokens this event covers
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: Exception | None = None


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


class Worker:
    """Owns the engine: runs submitted jobs one at a time, in arrival order, on its own thread."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics):
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.served: deque[int] = deque(maxlen=10_000)  # job seqs in service order (tests, logs)
        # (priority, arrival, job): the lowest priority first, ties in arrival order
        self._queue: queue.PriorityQueue[tuple[float, int, Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self.mean_job_s = 1.0  # moving average of a job's time on the engine (Retry-After)
        self.metrics.capture_seconds.set(getattr(engine, "capture_s", 0.0))
        self.metrics.warmup_seconds.set(getattr(engine, "warmup_s", 0.0))
        cache = getattr(engine, "cache", None)
        if cache is not None:  # --kv-cache-dtype as loaded
            dtype = str(cache.k[0].dtype).removeprefix("torch.")
            self.metrics.cache_config(dtype, cache.max_len, cache.nbytes)
        self._thread = threading.Thread(target=self._loop, name="expresslane-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job, priority: int = 0) -> Job:
        """Queue a job: served by (priority, arrival), so in arrival order while every priority
        is 0 (--scheduling-policy fcfs allows no other)."""
        job.seq = next(self._seq)
        self.metrics.waiting.inc()
        self._queue.put((priority, job.seq, job))
        return job

    def queued(self) -> int:
        """Jobs waiting for the engine (not the one running)."""
        return self._queue.qsize()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._queue.put((math.inf, next(self._seq), None))  # after every waiting job
        self._thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------
    def _next(self) -> Job | None:
        """The next job. An engine of several ranks is kept in touch while idle (`idle()`)."""
        while True:
            try:
                return self._queue.get(timeout=getattr(self.engine, "idle_interval", None))[2]
            except queue.Empty:
                try:
                    self.engine.idle()  # keeps ranks in touch; captures what requests missed
                except ExpressLaneError as e:  # the group is lost: later jobs get the error
                    log.error("%s", e)
                self.metrics.capture_seconds.set(getattr(self.engine, "capture_s", 0.0))

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            self.metrics.waiting.dec()
            self.served.append(job.seq)
            job.timings.start = time.monotonic()
            self.metrics.queue_time.observe(job.timings.start - job.timings.arrival)
            self.metrics.running.inc()
            try:
                if job.cancel.is_set():
                    for spec in job.choices:
                        job.put(Event("finish", spec.index, finish_reason="abort"))
                        self.metrics.finished("abort")
                else:
                    self._run(job)
            except ExpressLaneError as e:  # a request the handler's checks let through
                job.put(Event("error", error=e))
            except Exception as e:  # a bug: log it, answer 500, keep serving
                log.exception("request %d failed", job.seq)
                job.put(Event("error", error=e))
            finally:
                job.timings.end = time.monotonic()
                self.mean_job_s += 0.2 * (job.timings.end - job.timings.start - self.mean_job_s)
                self.metrics.e2e.observe(job.timings.end - job.timings.arrival)
                self.metrics.running.dec()
                job.close()

    def _run(self, job: Job) -> None:
        t = job.timings
        seen: set[int] = set()
        for spec in job.choices:
            first = id(spec.prompt_ids) not in seen  # the n choices of one prompt share its list
            if first:
                seen.add(id(spec.prompt_ids))
                t.prompt_tokens += len(spec.prompt_ids)
            if job.cancel.is_set():
                job.put(Event("finish", spec.index, finish_reason="abort"))
                self.metrics.finished("abort")
                continue
            if spec.echo_logprobs:
                echo = self._prompt_logprobs(spec, job.cancel)
                if echo is None:  # cancelled during the scoring prefill
                    job.put(Event("finish", spec.index, finish_reason="abort"))
                    self.metrics.finished("abort")
                    continue
                job.put(Event("echo", spec.index, tokens=echo))
            cached = self._generate(job, spec)
            if first and not spec.echo_logprobs:  # an echo scored the prompt itself just now
                t.cached_tokens += cached
        self.metrics.prompt_tokens.inc(t.prompt_tokens)

    def _prompt_logprobs(self, spec: ChoiceSpec, cancel) -> list[TokenInfo] | None:
        """The prompt's tokens with the logprob the model gave each (the first has none)."""
        ids = spec.prompt_ids
        lp = self.engine.prompt_logprobs(ids, cancel=cancel)  # (S, V): row i scores token i+1
        if lp is None:
            return None
        target = torch.tensor(ids[1:], device=lp.device, dtype=torch.long)[:, None]
        chosen = lp[:-1].gather(1, target)[:, 0].tolist()
        n = spec.params.logprobs or 0
        top = lp[:-1].topk(n, dim=-1) if n > 0 else None
        top_ids = top.indices.tolist() if top is not None else [[] for _ in chosen]
        top_vals = top.values.tolist() if top is not None else [[] for _ in chosen]
        out = [TokenInfo(ids[0])]
        for i, t in enumerate(ids[1:]):
            out.append(TokenInfo(t, chosen[i], list(zip(top_ids[i], top_vals[i], strict=True))))
        return out

    def _generate(self, job: Job, spec: ChoiceSpec) -> int:
        """Run one choice, relaying its tokens; returns the prompt tokens the cache held."""
        engine, m, t = self.engine, self.metrics, job.timings
        params = spec.params
        want_lp = params.logprobs is not None
        last = None
        n = 0
        finish, stop_reason = None, None
        before, live = t.speculative, None  # the speculation figures of earlier choices
        for text, step in stream_text(
            engine,
            self.tokenizer,
            spec.prompt_ids,
            params,
            spec.stop,
            job.cancel,
            spec.include_stop,
        ):
            if engine.stats.extra.get("speculative") is not live:  # a new verify step
                live = engine.stats.extra["speculative"]
                t.speculative = combine(before, live)
            now = time.monotonic()
            if last is None:
                if t.first_token is None:
                    t.first_token = now
                    m.ttft.observe(now - t.arrival)
            else:
                m.itl.observe(now - last)
            last = now
            n += 1
            info = [TokenInfo(step.token, step.logprob, step.top_logprobs)] if want_lp else []
            job.put(Event("delta", spec.index, text, info, count=1))
            if step.finish_reason:
                finish = step.finish_reason
                if finish == "stop" and step.stop_string is not None:
                    stop_reason = step.stop_string  # vLLM's: the stop string, or the stop id
                elif finish == "stop" and step.token in params.stop_token_ids:
                    stop_reason = step.token
        st = engine.stats
        if st.cached_tokens is not None and engine.prefix.enabled:
            m.prefix_lookup(len(spec.prompt_ids), st.cached_tokens)
        if st.extra.get("speculative") is not None:  # a verify after the last token seen
            live = st.extra["speculative"]
            t.speculative = combine(before, live)
        finish = finish or st.finish_reason or "abort"
        t.completion_tokens += n
        if n:
            t.prefill_tokens += len(spec.prompt_ids)
            t.prefill_s += st.ttft_s
            t.decode_s += st.decode_s
            t.decode_steps += n - 1
            if n > 1 and st.decode_s > 0:
                m.decode_tps.observe((n - 1) / st.decode_s)
        m.generation_tokens.inc(n)
        if live is not None:
            m.speculated(live)
        m.finished(finish)
        job.put(Event("finish", spec.index, finish_reason=finish, stop_reason=stop_reason))
        return st.cached_tokens or 0


# --- the event loop's side of a job -----------------------------------------------------------
@dataclass
class Accumulator:
    """One choice of a non-streaming response, built up from the worker's events."""

    pieces: list[str] = field(default_factory=list)
    tokens: list[TokenInfo] = field(default_factory=list)
    echo: list[TokenInfo] = field(default_factory=list)
    count: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, ev: Event) -> None:
        if ev.kind == "echo":
            self.echo = ev.tokens
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
