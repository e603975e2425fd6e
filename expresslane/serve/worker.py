"""The engine thread: one queue of jobs, one request on the device at a time.

The HTTP side builds a `Job` (jobs.py) and `submit`s it. The worker thread takes jobs by
(priority, arrival): in arrival order while every priority is 0 (--scheduling-policy fcfs), and
runs each choice through `stream_text`, pushing `Event`s back to the event loop through the
job's channel.

Cancellation: `job.cancel` is the engine's own `cancel` event, checked between prefill chunks
and before every decode step; a job cancelled while still queued is skipped. Metrics (queue
time, TTFT, inter-token latency, decode tokens/s, token counters, finish reasons, running and
waiting gauges) are recorded here, where the tokens are produced.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections import deque

import torch

from ..engine import Engine
from ..errors import ExpressLaneError
from ..speculative.drafting import combine
from ..step.pooling import pooled
from ..step.threads import ThreadGovernor, threads_on
from ..textgen import stream_text
from ..tokenizer import Tokenizer
from .jobs import ChoiceSpec, Event, Job, TokenInfo
from .metrics import Metrics

log = logging.getLogger("expresslane.serve")


class Worker:
    """Owns the engine: runs submitted jobs one at a time, in arrival order, on its own thread."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: Metrics,
                 governor: ThreadGovernor | None = None):  # fmt: skip
        self.engine, self.tokenizer, self.metrics = engine, tokenizer, metrics
        self.governor = governor  # a CPU's thread count, revised before each job
        self.metrics.cpu_threads.set(threads_on(getattr(engine, "device", None)) or 0)
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
        getattr(self.governor, "close", lambda: None)()  # its snapshots' thread

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
                    if self.governor is not None:
                        self.metrics.cpu_threads.set(self.governor.revise())
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
            if spec.pool is not None:  # /v1/embeddings: a vector, nothing generated
                vec = pooled(self.engine, spec.prompt_ids, spec.pool, job.cancel)
                job.put(Event("embedding", spec.index, vector=vec))
                continue
            scores = spec.echo_logprobs or spec.prompt_logprobs is not None
            if scores:
                scored = self._prompt_logprobs(spec, job.cancel)
                if scored is None:  # cancelled during the scoring prefill
                    job.put(Event("finish", spec.index, finish_reason="abort"))
                    self.metrics.finished("abort")
                    continue
                if spec.echo_logprobs:
                    job.put(Event("echo", spec.index, tokens=scored[0]))
                if spec.prompt_logprobs is not None:
                    job.put(Event("prompt_logprobs", spec.index, tokens=scored[1]))
            cached = self._generate(job, spec)
            if first and not scores:  # a scoring prefill took the prompt itself just now
                t.cached_tokens += cached
        self.metrics.prompt_tokens.inc(t.prompt_tokens)

    def _prompt_logprobs(self, spec: ChoiceSpec, cancel):
        """The prompt scored: (its tokens with the logprob the model gave each and the top
        `logprobs`, for echo; with each one's vocabulary rank and the top `prompt_logprobs`,
        for vLLM's field); the first token has none. None when cancelled."""
        ids = spec.prompt_ids
        lp = self.engine.prompt_logprobs(ids, cancel=cancel)  # (S, V): row i scores token i+1
        if lp is None:
            return None
        target = torch.tensor(ids[1:], device=lp.device, dtype=torch.long)[:, None]
        chosen = lp[:-1].gather(1, target)  # (S - 1, 1)
        ranks = (lp[:-1] > chosen).sum(-1).add(1).tolist()  # ties share the better rank
        chosen = chosen[:, 0].tolist()

        def scored(n: int, rank: bool) -> list[TokenInfo]:
            top = lp[:-1].topk(n, dim=-1) if n > 0 else None
            top_ids = top.indices.tolist() if top is not None else [[] for _ in chosen]
            top_vals = top.values.tolist() if top is not None else [[] for _ in chosen]
            out = [TokenInfo(ids[0])]
            for i, t in enumerate(ids[1:]):
                out.append(TokenInfo(t, chosen[i], list(zip(top_ids[i], top_vals[i], strict=True)),
                                     ranks[i] if rank else None))  # fmt: skip
            return out

        echo = scored(spec.params.logprobs or 0, False) if spec.echo_logprobs else None
        prompt = spec.prompt_logprobs
        return echo, (scored(prompt, True) if prompt is not None else None)

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
