"""What the server refuses before doing any work on a request, and the limits behind it.

- `ServeLimits`: the operator's limits (`--max-request-bytes`, `--max-queue`, `--max-n`,
  `--clamp-max-tokens`, `--allowed-origins`, `--allowed-headers`), frozen, filled by argparse.
- `Refusal`: a `RequestError` that carries HTTP headers (`Allow`, `Retry-After`,
  `WWW-Authenticate`).
- `read_json_body`: 415 unless the body is declared JSON (a web page cannot send that without
  a CORS preflight), 413 as soon as the body is known to exceed the limit: from Content-Length
  before reading anything, or while reading, never holding more than the limit. The rest of a
  refused body is read and dropped (up to a bound), so that the client, still sending, gets
  the answer instead of a reset connection.
- `allowed_methods`: what a 405 lists in `Allow`.
- `key_check`: the API key (401 with `WWW-Authenticate`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError, RequestError
from ..sampling.defaults import SamplingDefaults
from ..structured.reasoning import PARSERS
from .tools import TOOL_CALL_PARSERS

if TYPE_CHECKING:  # starlette only where a request is served: `serve --help` and the GPU
    from starlette.requests import Request  # stages import ServeLimits without it

MiB = 1 << 20
DRAIN_LIMIT = 64 * MiB  # beyond this a refused body is not read to its end: the connection closes


POOLING = ("last", "mean")  # /v1/embeddings: the last position's vector, or every position's mean


@dataclass(frozen=True)
class ServeLimits:
    """Limits on what one request may ask of the server (docs/serving.md), and the server-wide
    choices that shape every answer (the reasoning parser, the embeddings' pooling)."""

    max_request_bytes: int = 4 * MiB  # request body size; larger bodies get 413
    max_queue: int = 128  # requests being prepared or waiting for the engine; beyond: 503
    max_n: int = 16  # choices per request (`n`)
    clamp_max_tokens: bool = False  # max_tokens beyond the context: clamp instead of 400
    # vLLM's --scheduling-policy: fcfs (arrival order; a request's priority must be 0) or
    # priority (the lowest `priority` first, ties in arrival order)
    scheduling_policy: str = "fcfs"
    allowed_origins: tuple[str, ...] = ()  # CORS; none by default
    allowed_headers: tuple[str, ...] = ("*",)  # CORS request headers: all, as vLLM allows
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser (structured/reasoning.py)
    pooling: str = "last"  # llama.cpp's --pooling: /v1/embeddings' vector (embeddings.py)
    tool_call_parser: str | None = None  # vLLM's: a native tool template's convention (tools.py)
    # vLLM's --generation-config: the model's sampling defaults (sampling/defaults.py)
    sampling_defaults: SamplingDefaults = SamplingDefaults()

    def validate(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy {self.scheduling_policy}: expected fcfs or "
                              "priority")  # fmt: skip
        if self.reasoning_parser not in (None, *PARSERS):
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser}: expected one of "
                              f"{', '.join(PARSERS)}")  # fmt: skip
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser}: expected one of "
                              f"{', '.join(TOOL_CALL_PARSERS)}")  # fmt: skip
        if self.pooling not in POOLING:
            raise ConfigError(f"--pooling {self.pooling}: expected one of {', '.join(POOLING)}")
        for name in ("max_request_bytes", "max_queue", "max_n"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}: must be at least 1, got {getattr(self, name)}")


class Refusal(RequestError):
    """A refused request whose answer carries headers."""

    def __init__(self, message: str, status_code: int, headers: dict[str, str] | None = None,
                 param: str | None = None):  # fmt: skip
        super().__init__(message, param=param, status_code=status_code)
        self.headers = headers or {}


def is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


async def _drain(request: Request, already: int) -> None:
    """Read and drop the rest of a refused body, up to DRAIN_LIMIT bytes in all."""
    seen = already
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > DRAIN_LIMIT:
            return


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body of a JSON request, refused with 415 or 413 as early as possible."""
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        await _drain(request, 0)
        got = f"got {content_type!r}" if content_type else "none was given"
        raise Refusal(f"Content-Type must be application/json ({got})", 415)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        await _drain(request, 0)
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            await _drain(request, size)
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> Refusal:
    return Refusal(f"request body too large ({size}): the limit is {limit} bytes", 413)


def allowed_methods(app, scope: dict) -> str:
    """The methods some route of `app` accepts at the request's path, for a 405's Allow."""
    return ", ".join(sorted(_methods(app.router.routes, scope)))


def _methods(routes, scope: dict) -> set[str]:
    from starlette.routing import Match

    methods: set[str] = set()
    for route in routes:
        inner = getattr(getattr(route, "original_router", None), "routes", None)
        if inner is not None:  # a router included in the app: its own routes
            methods |= _methods(inner, scope)
            continue
        match, _ = route.matches(scope)  # a wrong method is a partial match, a wrong path none
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or {"GET", "HEAD"})  # a mount: files
    return methods


def key_check(svc):
    """The dependency that guards a route with `svc.api_key` (when the server has one): 401.
    The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>`
    (Anthropic's)."""
    from fastapi import Depends
    from starlette.requests import Request

    async def require_key(request: Request) -> None:
        if svc.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" and "x-api-key" in request.headers:  # Anthropic's header
            scheme, token = "bearer", request.headers["x-api-key"]
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), svc.api_key.encode()
        ):
            challenge = 'Bearer error="invalid_token"' if token.strip() else "Bearer"
            raise Refusal(
                "Invalid API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                401,
                {"WWW-Authenticate": challenge},
            )

    # FastAPI reads the parameter's type from the annotation; under postponed annotations that is
    # the string "Request", which this module's globals cannot resolve (starlette is imported
    # lazily, so that GPU stages import ServeLimits without it): give it the class itself.
    require_key.__annotations__["request"] = Request
    return Depends(require_key)
