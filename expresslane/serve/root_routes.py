"""The server's routes outside /v1: health, vLLM's /ping and /version, metrics, the tokenizer's
routes and the playground page; and the two helpers every route file uses (GET with its HEAD,
a JSON answer serialised off the event loop)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from .. import __version__
from . import protocol as P
from .guards import key_check
from .schema import route_docs


def as_json(fn):
    """`fn` returning its dict as a JSON response, serialised where `fn` runs (P.json_bytes):
    a 4 MB answer (a /tokenize of 690k ids) serialised on the event loop stalled /health for a
    second."""
    return lambda *args: Response(P.json_bytes(fn(*args)), media_type="application/json")


def get_route(r: APIRouter, path: str, **docs):
    """A GET route and HEAD beside it (HEAD kept out of the schema), as HTTP asks of servers:
    `HEAD /health` was a 405."""

    def register(fn):
        r.add_api_route(path, fn, methods=["HEAD"], include_in_schema=False)
        return r.get(path, **docs)(fn)

    return register


def root_routes(svc, pages: Path) -> APIRouter:
    """The routes outside /v1 on `svc` (server.py's Service); `pages`: the playground's folder."""
    r = APIRouter()

    @get_route(r, "/health", **route_docs("health"))
    async def health():
        if svc.worker is None:
            return JSONResponse(P.error_body("Loading model", 503), status_code=503)
        return {"status": "ok"}

    # vLLM's: /ping is /health for load balancers that probe it (SageMaker), GET or POST
    @get_route(r, "/ping", **route_docs("ping"))
    async def ping():
        return await health()

    r.add_api_route("/ping", ping, methods=["POST"], include_in_schema=False)

    @get_route(r, "/version", **route_docs("version"))
    async def version():
        return {"version": __version__}

    @get_route(r, "/metrics", **route_docs("metrics"))
    async def metrics():
        return Response(svc.metrics.render(), media_type=svc.metrics.content_type)

    @get_route(r, "/", include_in_schema=False)
    async def playground():
        return FileResponse(pages / "index.html")

    @get_route(r, "/tokenizer_info", **route_docs("tokenizer_info"))
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

    # Unlike vLLM, the key guards these two as well: tokenizing costs CPU in proportion to the
    # body (lm-eval's remote tokenizer sends the key it is given).
    @r.post("/tokenize", dependencies=[key_check(svc)], **route_docs("tokenize"))
    async def tokenize(request: Request):
        s = svc.ready()
        return await s.prepare(request, as_json(s.preparer.tokenize))

    @r.post("/detokenize", dependencies=[key_check(svc)], **route_docs("detokenize"))
    async def detokenize(request: Request):
        s = svc.ready()
        return await s.prepare(request, as_json(s.preparer.detokenize))

    return r
