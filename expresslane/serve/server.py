"""The HTTP server: OpenAI-compatible routes, tokenizer routes, health, metrics, playground.

`create_app(engine, tokenizer, served_model_name, api_key, limits=...)` builds the FastAPI app.
The engine may arrive later (`attach`): until then `/health` and every model route answer 503,
as llama-server does while loading.

A request's way through: the API key (401), the queue limit (503 with Retry-After beyond
`--max-queue`), the body read under `--max-request-bytes` (415 unless JSON, 413), then parsing,
templating and tokenizing on the `Preparer`'s threads (prepare.py), never on the event loop, so
/health and running streams keep answering whatever a request costs. The prepared `Job` goes to
the single engine thread (worker.py), whose events are relayed as one JSON body or as
server-sent events ending in `data: [DONE]`.

A client that goes away cancels its job: a task per request waits for the ASGI
`http.disconnect` message (vLLM's `with_cancellation` idea, for streaming and non-streaming
alike), and leaving a stream early for any reason cancels it too. The engine checks the flag
between prefill chunks and between decode steps.

Error answers never show the server's paths (the model folder becomes the model's name) nor
Python internals: an unexpected exception is logged and answered with a plain 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import time
from functools import partial
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..engine import Engine
from ..errors import ExpressLaneError, RequestError
from ..step.threads import ThreadGovernor
from ..tokenizer import Tokenizer
from . import protocol as P
from .embeddings import add_route as add_embeddings
from .formats import usage_of
from .guards import Refusal, ServeLimits, allowed_methods, key_check, read_json_body
from .jobs import ChoiceSpec, Job, collect
from .metrics import Metrics
from .prepare import Preparer
from .responses import ResponseStore
from .root_routes import as_json, get_route, root_routes
from .schema import install_openapi, route_docs
from .streams import chat_stream, message_stream, response_stream, sse_response
from .worker import Worker

log = logging.getLogger("expresslane.serve")
PLAYGROUND = Path(__file__).parent / "playground"


class Service:
    """What the handlers share: the engine (once loaded), its worker, names, key, limits."""

    def __init__(
        self,
        names: list[str],
        aliases: list[str],
        api_key: str | None,
        seed: int | None,
        root: str,
        limits: ServeLimits,
    ):
        self.names, self.aliases, self.api_key = names, aliases, api_key
        self.root, self.limits = root, limits
        self.metrics = Metrics(names[0])
        self.rng = random.Random(seed) if seed is not None else None
        self.engine: Engine | None = None
        self.tok: Tokenizer | None = None
        self.worker: Worker | None = None
        self.preparer: Preparer | None = None
        self.preparing = 0  # requests admitted and not yet submitted (body, template, tokens)
        self.stored = ResponseStore()  # the Responses API's stored responses (responses.py)
        self.private: list[str] = []  # server paths that answers must not show
        self._hide(*aliases, root)

    def _hide(self, *paths: str | os.PathLike) -> None:
        for p in paths:
            if p and str(p) not in self.names:
                self.private += [str(p), os.path.abspath(p), os.path.realpath(p)]
        self.private.sort(key=len, reverse=True)  # the longest first: no half-replaced paths

    def attach(self, engine: Engine, tok: Tokenizer, governor: ThreadGovernor | None = None):
        self._hide(tok.folder)
        self.engine, self.tok = engine, tok
        self.preparer = Preparer(engine, tok, self.limits, self.model_name, self.rng)
        self.worker = Worker(engine, tok, self.metrics, governor)

    def shutdown(self) -> None:
        """Stop the engine thread and the preparation threads (the server has stopped)."""
        if self.worker is not None:
            self.worker.shutdown()
        if self.preparer is not None:
            self.preparer.shutdown()

    def ready(self) -> Service:
        if self.worker is None:
            raise RequestError("Loading model", status_code=503)
        return self

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.names:
            return requested or self.names[0]
        if requested in self.aliases:
            return self.names[0]
        raise RequestError(
            f"The model `{requested}` does not exist (this server serves "
            f"{', '.join(map(repr, self.names))}).",
            param="model",
            status_code=404,
        )

    def public(self, message: str) -> str:
        """An error message as a client may see it: no server paths."""
        for p in self.private:
            message = message.replace(p, self.names[0])
        return message

    @contextlib.contextmanager
    def admitted(self):
        """Hold a place in the queue while the request is read and prepared; 503 when full."""
        depth = self.preparing + (self.worker.queued() if self.worker else 0)
        if depth >= self.limits.max_queue:
            self.metrics.rejected("queue_full")
            wait = math.ceil(self.worker.mean_job_s) if self.worker else 1
            raise Refusal(
                f"the server is busy: {depth} requests are already waiting "
                f"(--max-queue {self.limits.max_queue}); retry later",
                503,
                {"Retry-After": str(min(max(wait, 1), 60))},
            )
        self.preparing += 1
        self.metrics.preparing.inc()
        try:
            yield
        finally:
            self.preparing -= 1
            self.metrics.preparing.dec()

    async def body(self, request: Request) -> bytes:
        try:
            return await read_json_body(request, self.limits.max_request_bytes)
        except Refusal as e:
            if e.status_code == 413:
                self.metrics.rejected("too_large")
            raise

    async def prepare(self, request: Request, fn):
        """Read the body and run `fn` on it on the preparer's threads, holding a queue place."""
        with self.admitted():
            return await self.preparer.run(fn, await self.body(request))

    async def reply(self, fn, *args) -> Response:
        """`fn(*args)` as a JSON response, built on the preparer's threads (as_json)."""
        return await self.preparer.run(as_json(fn), *args)

    def submit(self, specs: list[ChoiceSpec], priority: int = 0) -> Job:
        return self.worker.submit(Job(specs, asyncio.get_running_loop()), priority)


def create_app(
    engine: Engine | None = None,
    tokenizer: Tokenizer | None = None,
    served_model_name: str | list[str] = "expresslane",
    api_key: str | None = None,
    *,
    seed: int | None = None,
    root: str = "",
    aliases: list[str] | tuple[str, ...] = (),
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The server app; pass engine=None to attach() it once loaded (health answers 503 until).

    `aliases` are further model names requests may use (the path the model was loaded from);
    they are accepted but never listed or shown.
    """
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    limits = limits or ServeLimits()
    limits.validate()
    svc = Service(names, list(aliases), api_key or None, seed, root, limits)
    if engine is not None:
        svc.attach(engine, tokenizer)
    app = FastAPI(
        title="ExpressLane",
        summary="OpenAI-compatible API of a batch-1 inference engine",
        docs_url="/docs",
        redoc_url="/redoc",
        openapi_url="/openapi.json",
    )
    app.state.service = svc
    _error_handlers(app, svc)
    app.include_router(_v1_routes(svc))
    app.include_router(root_routes(svc, PLAYGROUND))
    app.mount("/playground", StaticFiles(directory=PLAYGROUND, html=True), name="playground")
    if limits.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(limits.allowed_origins),
            allow_methods=["GET", "HEAD", "POST", "DELETE", "OPTIONS"],
            allow_headers=list(limits.allowed_headers),
            max_age=600,
        )
    install_openapi(app, limits, names)
    return app


def attach(app: FastAPI, engine: Engine, tokenizer: Tokenizer, governor=None) -> None:
    app.state.service.attach(engine, tokenizer, governor)  # governor: step/threads.py's


def _error_handlers(app: FastAPI, svc: Service) -> None:
    def reply(message: str, status: int, param: str | None = None, headers=None) -> JSONResponse:
        body = P.error_body(svc.public(message), status, param)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ExpressLaneError)
    async def _expresslane(request: Request, e: ExpressLaneError):
        return reply(str(e), e.status_code, getattr(e, "param", None), getattr(e, "headers", None))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        headers = dict(e.headers or {})
        if e.status_code == 405:
            # Starlette names the first route that matched the path only (GET or HEAD)
            headers["Allow"] = allowed_methods(app, request.scope)
        return reply(str(e.detail), e.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return reply(f"invalid request: {e.errors()[0].get('msg', e)}", 400)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return reply(P.INTERNAL_ERROR, 500)


# --- /v1 --------------------------------------------------------------------------------------
def _v1_routes(svc: Service) -> APIRouter:
    r = APIRouter(prefix="/v1", dependencies=[key_check(svc)])

    @get_route(r, "/models", **route_docs("models"))
    async def models():
        s = svc.ready()
        card = {"object": "model", "owned_by": "expresslane", "max_model_len": s.engine.max_len}
        now = int(time.time())
        data = [{"id": n, "created": now, "root": s.root or n, **card} for n in s.names]
        return {"object": "list", "data": data}

    async def generate(request: Request, fn) -> Response | dict:
        s = svc.ready()
        prep = await s.prepare(request, fn)
        job = s.submit(prep.specs, prep.priority)
        if prep.stream:
            return sse_response(
                chat_stream(
                    job,
                    request,
                    prep.fmt,
                    prep.include_usage,
                    prep.prompt_tokens,
                    prep.continuous_usage,
                )  # fmt: skip
            )
        return await answer(s, job, request, prep)

    async def answer(s: Service, job: Job, request: Request, prep, reshape=None) -> Response:
        """The job's whole answer as one JSON body: the format's response (completion or chat),
        or `reshape` of the chat one (the Responses or Messages shape). Built on the preparer's
        threads: detokenizing thousands of echoed tokens for text_offset is no work for the
        loop either."""
        accs = await collect(job, request.receive)
        n = sum(a.count for a in accs.values())
        usage = usage_of(prep.prompt_tokens, n, job.timings.cached_tokens, job.predicted())

        def build() -> dict:
            out = prep.fmt.response(accs, usage, job.timings.as_dict())
            return out if reshape is None else reshape(out)

        return await s.reply(build)

    @r.post("/completions", **route_docs("completions"))
    async def completions(request: Request):
        return await generate(request, svc.ready().preparer.completion)

    @r.post("/chat/completions", **route_docs("chat"))
    async def chat(request: Request):
        return await generate(request, svc.ready().preparer.chat)

    add_embeddings(r, svc, route_docs("embeddings"))

    @r.post("/responses", **route_docs("responses"))
    async def responses(request: Request):
        s = svc.ready()
        prep, shape = await s.prepare(request, partial(s.preparer.responses, store=s.stored))
        job = s.submit(prep.specs, prep.priority)

        def done(response: dict) -> dict:
            if shape.req.store:
                s.stored.put(response, shape.turn(response))
            return response

        if prep.stream:
            return sse_response(response_stream(job, request, prep, shape, done))
        return await answer(s, job, request, prep, lambda chat: done(shape.response(chat)))

    @r.post("/messages", **route_docs("messages"))
    async def messages(request: Request):
        s = svc.ready()
        prep, shape = await s.prepare(request, s.preparer.messages)
        job = s.submit(prep.specs, prep.priority)
        if prep.stream:
            return sse_response(message_stream(job, request, prep, shape))
        return await answer(s, job, request, prep, shape.message)

    @r.post("/messages/count_tokens", **route_docs("count_tokens"))
    async def count_tokens(request: Request):
        s = svc.ready()
        prep, _ = await s.prepare(request, partial(s.preparer.messages, count=True))
        return {"input_tokens": prep.prompt_tokens}

    @get_route(r, "/responses/{response_id}", **route_docs("response"))
    async def stored_response(response_id: str):
        return svc.stored.get(response_id)[0]

    @r.delete("/responses/{response_id}", **route_docs("response_deleted"))
    async def delete_response(response_id: str):
        svc.stored.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return r
