"""Server-sent event streams: chat and completion chunks ending in `data: [DONE]`, and the typed
events of OpenAI's Responses API (responses_out.py) and Anthropic's Messages API
(messages_out.py).

Both relay a job's event batches as they come, under `cancel_on_disconnect` (a client that
leaves cancels its job), and turn a failure into an error event rather than a cut stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from . import protocol as P
from .formats import usage_of
from .jobs import Job, cancel_on_disconnect, coalesce
from .messages_out import MessageEvents, MessageShape
from .prepare import Prepared
from .responses_out import ResponseEvents, ResponseShape

log = logging.getLogger("expresslane.serve")


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def chat_stream(job: Job, request: Request, fmt, include_usage: bool, prompt_tokens: int,
                      continuous: bool = False) -> AsyncIterator[str]:  # fmt: skip
    """SSE events: one chunk per choice per batch of tokens, usage chunk, then [DONE].

    Every chunk carries `completion_tokens` (so far, all choices) and each finishing chunk the
    request's `timings`; both are extra top-level keys that OpenAI clients ignore. `continuous`
    (vLLM's stream_options.continuous_usage_stats): each chunk's `usage` is the counts so far.
    """
    base = fmt.envelope()
    if include_usage:
        base["usage"] = None
    generated, failed = 0, False
    try:
        async with cancel_on_disconnect(job, request.receive):
            for choice in fmt.start():
                first = {"usage": usage_of(prompt_tokens, 0, 0)} if continuous else {}
                yield P.sse({**base, "choices": [choice], "completion_tokens": 0, **first})
            while (batch := await job.next_batch()) is not None:
                fmt.tally(batch)
                for ev in coalesce(batch):
                    if ev.kind == "error":
                        failed = True
                        yield P.sse(P.error_of(ev.error))
                        continue
                    generated += ev.count
                    choice = fmt.chunk(ev)
                    if choice is None:
                        continue
                    extra = {"completion_tokens": generated}
                    if continuous:
                        extra["usage"] = usage_of(prompt_tokens, generated,
                                                  job.timings.cached_tokens)  # fmt: skip
                    if job.timings.speculative is not None:  # live, for the playground
                        extra["speculative"] = job.timings.speculative
                    if ev.kind == "finish":
                        extra["timings"] = job.timings.as_dict()
                    yield P.sse({**base, "choices": [choice], **extra})
        if include_usage and not failed:
            counts = usage_of(prompt_tokens, generated, job.timings.cached_tokens, job.predicted())
            yield P.sse(
                {
                    **base,
                    "choices": [],
                    "usage": fmt.count_reasoning(counts),
                    "completion_tokens": generated,
                    "timings": job.timings.as_dict(),
                }
            )
    except Exception as e:  # a bug while streaming: tell the client, keep the server up
        log.exception("stream failed")
        yield P.sse(P.error_of(e))
    yield P.sse("[DONE]")


def response_stream(
    job: Job, request: Request, prep: Prepared, shape: ResponseShape, done: Callable[[dict], None]
) -> AsyncIterator[str]:
    """The Responses API's events for one job (responses_out.py); `done(response)` gets the
    whole response once it completed (to store it). No `[DONE]`: OpenAI sends none here."""
    events = ResponseEvents(shape)

    def finish(generated: int) -> list[str]:
        usage = prep.fmt.count_reasoning(
            usage_of(prep.prompt_tokens, generated, job.timings.cached_tokens)
        )
        final, frames = events.finish_events(usage, job.timings.as_dict())
        done(final)
        return frames

    return typed_stream(job, request, prep, events, finish)


def message_stream(job: Job, request: Request, prep: Prepared, shape: MessageShape
                   ) -> AsyncIterator[str]:  # fmt: skip
    """Anthropic's Messages events for one job (messages_out.py)."""
    events = MessageEvents(shape, prep.prompt_tokens)
    return typed_stream(
        job,
        request,
        prep,
        events,
        lambda generated: events.finish_events({"completion_tokens": generated}),
    )


async def typed_stream(job: Job, request: Request, prep: Prepared, events,
                       finish: Callable[[int], list[str]]) -> AsyncIterator[str]:  # fmt: skip
    """A job's chat chunks (prep.fmt) as an API's typed events: `events` (ResponseEvents or
    MessageEvents) gives the opening frames, a chunk's frames and an error's; `finish(tokens
    generated)` the closing ones."""
    generated = 0
    try:
        async with cancel_on_disconnect(job, request.receive):
            for frame in events.start():
                yield frame
            while (batch := await job.next_batch()) is not None:
                prep.fmt.tally(batch)
                for ev in coalesce(batch):
                    if ev.kind == "error":
                        yield events.error(P.error_of(ev.error))
                        return
                    generated += ev.count
                    choice = prep.fmt.chunk(ev)
                    for frame in events.chunk(choice) if choice is not None else ():
                        yield frame
        for frame in finish(generated):
            yield frame
    except Exception as e:  # a bug while streaming: tell the client, keep the server up
        log.exception("stream failed")
        yield events.error(P.error_of(e))
