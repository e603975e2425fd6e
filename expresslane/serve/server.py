"""The HTTP server: OpenAI-compatible routes, tokenizer routes, health, metrics, playground.

`create_app(engine, tokenizer, served_model_name, api_key)` builds the FastAPI app. The engine
may arrive later (`attach`): until then `/health` and every model route answer 503, as
llama-server does while loading. Handlers validate and tokenize on the event loop, then hand a
`Job` to the single engine thread (worker.py) and relay its events, as one JSON body or as
server-sent events ending in `data: [DONE]`.

A client that goes away cancels its job: a task per request waits for the ASGI
`http.disconnect` message (vLLM's `with_cancellation` idea, for streaming and non-streaming
alike), and leaving a stream early for any reason cancels it too. The engine checks the flag
between prefill chunks and between decode steps.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..config import SamplingParams
from ..engine import Engine
from ..errors import ExpressLaneError, RequestError, TokenizerError
from ..tokenizer import Tokenizer
from . import protocol as P
from .metrics import Metrics
from .protocol import ChatFormat, CompletionFormat
from .worker import ChoiceSpec, Job, Worker, cancel_on_disconnect, coalesce, collect

log = logging.getLogger("expresslane.serve")
PLAYGROUND = Path(__file__).parent / "playground"


class Service:
    """What the handlers share: the engine (once loaded), its worker, names, key, metrics."""

    def __init__(self, names: list[str], api_key: str | None, seed: int | None, root: str):
        self.names, self.api_key, self.root = names, api_key, root
        self.metrics = Metrics(names[0])
        self.rng = random.Random(seed) if seed is not None else None
        self.engine: Engine | None = None
        self.tok: Tokenizer | None = None
        self.worker: Worker | None = None

    def attach(self, engine: Engine, tok: Tokenizer) -> None:
        self.engine, self.tok = engine, tok
        self.text = P.TokenText(tok)
        self.worker = Worker(engine, tok, self.metrics)

    def ready(self) -> Service:
        if self.worker is None:
            raise RequestError("Loading model", status_code=503)
        return self

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested in self.names:
            return requested or self.names[0]
        raise RequestError(
            f"The model `{requested}` does not exist (this server serves "
            f"{', '.join(map(repr, self.names))}).",
            param="model",
            status_code=404,
        )

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            self.engine.check_prompt(ids)
        except RequestError as e:
            msg = str(e).removeprefix("prompt: ")
            raise RequestError(f"{param}: {msg}", param=param) from None

    def sampling(
        self, req: P._SamplingRequest, max_tokens: int, logprobs: int | None, choice: int
    ) -> SamplingParams:
        seed = req.seed
        if seed is None and self.rng is not None:
            seed = self.rng.randrange(2**63)
        if seed is not None and choice:  # the n choices of one request differ, reproducibly
            seed = (seed + choice) % 2**63
        vocab = self.engine.cfg.vocab_size
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise RequestError(
                f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            seed=seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        params.validate()
        return params

    def submit(self, specs: list[ChoiceSpec]) -> Job:
        return self.worker.submit(Job(specs, asyncio.get_running_loop()))


def create_app(
    engine: Engine | None = None,
    tokenizer: Tokenizer | None = None,
    served_model_name: str | list[str] = "expresslane",
    api_key: str | None = None,
    *,
    seed: int | None = None,
    root: str = "",
) -> FastAPI:
    """The server app; pass engine=None to attach() it once loaded (health answers 503 until)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    svc = Service(names, api_key or None, seed, root)
    if engine is not None:
        svc.attach(engine, tokenizer)
    app = FastAPI(title="ExpressLane", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc
    _error_handlers(app)
    app.include_router(_v1_routes(svc))
    app.include_router(_root_routes(svc))
    app.mount("/playground", StaticFiles(directory=PLAYGROUND, html=True), name="playground")
    return app


def attach(app: FastAPI, engine: Engine, tokenizer: Tokenizer) -> None:
    app.state.service.attach(engine, tokenizer)


def _error_handlers(app: FastAPI) -> None:
    def reply(message: str, status: int, param: str | None = None) -> JSONResponse:
        return JSONResponse(P.error_body(message, status, param), status_code=status)

    @app.exception_handler(ExpressLaneError)
    async def _expresslane(request: Request, e: ExpressLaneError):
        return reply(str(e), e.status_code, getattr(e, "param", None))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return reply(str(e.detail), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return reply(f"invalid request: {e.errors()[0].get('msg', e)}", 400)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return reply(f"internal error: {type(e).__name__}: {e}", 500)


# --- /v1 --------------------------------------------------------------------------------------
def _v1_routes(svc: Service) -> APIRouter:
    async def require_key(request: Request) -> None:
        if svc.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), svc.api_key.encode()
        ):
            raise RequestError(
                "Invalid API key: send 'Authorization: Bearer <key>'", status_code=401
            )

    r = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @r.get("/models")
    async def models():
        s = svc.ready()
        card = {"object": "model", "owned_by": "expresslane", "max_model_len": s.engine.max_len}
        now = int(time.time())
        data = [{"id": n, "created": now, "root": s.root or n, **card} for n in s.names]
        return {"object": "list", "data": data}

    @r.post("/completions")
    async def completions(request: Request):
        s = svc.ready()
        req: P.CompletionRequest = P.parse(P.CompletionRequest, await request.body())
        model = s.model_name(req.model)
        prompts = []
        for p in req.prompts():
            # A token-id prompt is used as given: no BOS is added (lm-eval's offsets rely on it).
            ids = s.tok.encode(p, req.add_special_tokens) if isinstance(p, str) else p
            s.check_prompt(ids, "prompt")
            prompts.append((p if isinstance(p, str) else None, ids))
        max_tokens = req.max_tokens if req.max_tokens is not None else s.engine.max_len
        specs = [
            ChoiceSpec(
                i * req.n + j,
                ids,
                s.sampling(req, max_tokens, req.logprobs, j),
                req.stop_strings(),
                req.echo and req.logprobs is not None,
            )
            for i, (_, ids) in enumerate(prompts)
            for j in range(req.n)
        ]
        echo = {}
        if req.echo:
            texts = [text if text is not None else s.tok.decode(ids) for text, ids in prompts]
            echo = {sp.index: texts[sp.index // req.n] for sp in specs}
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        fmt = CompletionFormat(model, s.text, echo, req.logprobs is not None)
        job = s.submit(specs)
        if req.stream:
            return _sse(_stream(job, request, fmt, req.include_usage, prompt_tokens))
        accs = await collect(job, request.receive)
        return fmt.response(
            accs, P.usage(prompt_tokens, sum(a.count for a in accs.values())), job.timings.as_dict()
        )

    @r.post("/chat/completions")
    async def chat(request: Request):
        s = svc.ready()
        req: P.ChatCompletionRequest = P.parse(P.ChatCompletionRequest, await request.body())
        model = s.model_name(req.model)
        ids = _chat_prompt(s.tok, req)
        s.check_prompt(ids, "messages")
        max_tokens = req.max_completion_tokens or req.max_tokens or s.engine.max_len - len(ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        specs = [
            ChoiceSpec(j, ids, s.sampling(req, max_tokens, logprobs, j), req.stop_strings())
            for j in range(req.n)
        ]
        fmt = ChatFormat(model, s.text, req.n, req.logprobs)
        job = s.submit(specs)
        if req.stream:
            return _sse(_stream(job, request, fmt, req.include_usage, len(ids)))
        accs = await collect(job, request.receive)
        return fmt.response(
            accs, P.usage(len(ids), sum(a.count for a in accs.values())), job.timings.as_dict()
        )

    return r


def _chat_prompt(tok: Tokenizer, req: P.ChatCompletionRequest) -> list[int]:
    """Render the chat template; a trailing assistant message is continued, not closed."""
    try:
        messages = [m.for_template() for m in req.messages]
    except ValueError as e:
        raise RequestError(f"messages: {e}", param="messages") from None
    cont = req.continue_final_message
    if cont is None:
        cont = messages[-1]["role"] == "assistant"
    try:
        text = tok.apply_chat_template(
            messages,
            add_generation_prompt=req.add_generation_prompt and not cont,
            continue_final_message=cont,
            **(req.chat_template_kwargs or {}),
        )
    except (TokenizerError, TypeError) as e:
        raise RequestError(f"messages: {e}", param="messages") from None
    # The template writes its own special tokens (BOS included): add none when encoding.
    return tok.encode(text, add_special_tokens=False)


# --- the root: health, metrics, tokenizer, playground -----------------------------------------
def _root_routes(svc: Service) -> APIRouter:
    r = APIRouter()

    @r.get("/health")
    async def health():
        if svc.worker is None:
            return JSONResponse(P.error_body("Loading model", 503), status_code=503)
        return {"status": "ok"}

    @r.get("/metrics")
    async def metrics():
        return Response(svc.metrics.render(), media_type=svc.metrics.content_type)

    @r.get("/")
    async def playground():
        return FileResponse(PLAYGROUND / "index.html")

    @r.get("/tokenizer_info")
    async def tokenizer_info():
        s = svc.ready()
        tok = s.tok
        special = getattr(tok, "special_tokens", {})
        templates = getattr(tok, "chat_templates", None) or {}
        return {
            "bos_token": None if tok.bos_id is None else tok.id_to_piece(tok.bos_id),
            "eos_token": tok.id_to_piece(tok.eos_ids[0]) if tok.eos_ids else None,
            "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"),
            "chat_template": templates.get("default"),
            "model_max_length": s.engine.max_len,
        }

    @r.post("/tokenize")
    async def tokenize(request: Request):
        s = svc.ready()
        req: P.TokenizeRequest = P.parse(P.TokenizeRequest, await request.body())
        if req.messages is not None:
            try:
                text = s.tok.apply_chat_template(
                    [m.for_template() for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt,
                )
                ids = s.tok.encode(text, add_special_tokens=False)
            except (TokenizerError, ValueError) as e:
                raise RequestError(f"messages: {e}", param="messages") from None
        else:
            text = req.prompt if req.prompt is not None else req.content
            if text is None:
                raise RequestError("prompt: required (or messages)", param="prompt")
            add = next(
                (v for v in (req.add_special_tokens, req.add_special) if v is not None), True
            )
            ids = s.tok.encode(text, add_special_tokens=add)
        out = {"count": len(ids), "max_model_len": s.engine.max_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [s.tok.id_to_piece(i) for i in ids]
        return out

    @r.post("/detokenize")
    async def detokenize(request: Request):
        s = svc.ready()
        req: P.DetokenizeRequest = P.parse(P.DetokenizeRequest, await request.body())
        bad = [t for t in req.tokens if not 0 <= t < s.tok.vocab_size]
        if bad:
            raise RequestError(
                f"tokens: {bad[0]} is outside the vocabulary [0, {s.tok.vocab_size})",
                param="tokens",
            )
        return {"prompt": s.tok.decode(req.tokens)}

    return r


# --- streaming ------------------------------------------------------------------------------
def _sse(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _stream(
    job: Job, request: Request, fmt, include_usage: bool, prompt_tokens: int
) -> AsyncIterator[str]:
    """SSE events: one chunk per choice per batch of tokens, usage chunk, then [DONE].

    Every chunk carries `completion_tokens` (so far, all choices) and each finishing chunk the
    request's `timings`; both are extra top-level keys that OpenAI clients ignore.
    """
    base = fmt.envelope()
    if include_usage:
        base["usage"] = None
    generated, failed = 0, False
    try:
        async with cancel_on_disconnect(job, request.receive):
            for choice in fmt.start():
                yield P.sse({**base, "choices": [choice], "completion_tokens": 0})
            while (batch := await job.next_batch()) is not None:
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
                    if ev.kind == "finish":
                        extra["timings"] = job.timings.as_dict()
                    yield P.sse({**base, "choices": [choice], **extra})
        if include_usage and not failed:
            yield P.sse(
                {
                    **base,
                    "choices": [],
                    "usage": P.usage(prompt_tokens, generated),
                    "completion_tokens": generated,
                    "timings": job.timings.as_dict(),
                }
            )
    except Exception as e:  # a bug while streaming: tell the client, keep the server up
        log.exception("stream failed")
        yield P.sse(P.error_of(e))
    yield P.sse("[DONE]")
