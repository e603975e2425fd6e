"""OpenAI's `POST /v1/embeddings`: a vector for each input, from the served model.

A decoder-only model has no embedding head. As vLLM pools a decoder model served as an embedder
(its LAST pooling, normalised) and llama.cpp's server does with `--embeddings --pooling last`,
the vector is what the LM head reads at the input's last token (the final norm and lane
aggregation: Laneformer.head_input), L2-normalised; `serve --pooling mean` averages every
position's instead (llama.cpp's `--pooling mean`). Decided: the route is always served, where
llama.cpp needs `--embeddings` and vLLM a pooling runner: it costs nothing until asked, and a
client (a RAG framework pointed at this server) gets the model's vectors instead of a 404.

The request: `input` is a string, a list of strings, a list of token ids or a list of such
lists (at most 2,048 inputs, none empty: OpenAI's limits); `encoding_format` "float" or
"base64" (little-endian float32, which the `openai` client asks for and decodes); `dimensions`
only the model's own (the vectors are not Matryoshka-trained: a 400 otherwise, as vLLM
answers); `user` is ignored. vLLM's `truncate_prompt_tokens` (the last N tokens; -1: as many as
the context holds), `add_special_tokens` (strings only: token ids are used as given) and
`normalize` (true by default) are taken too.

The work runs on the engine thread like any request, one input after another: each is
prefilled in chunks into the KV cache, which then holds it as a scoring prefill leaves it
(prefix reuse stays coherent), and a client that leaves cancels it between chunks. An engine
spread over several devices does not serve it (a 400 naming the route).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import torch.nn.functional as F
from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from ..errors import RequestError
from ..model import Laneformer
from ..sampling.params import SamplingParams
from . import protocol as P
from .jobs import Accumulator, ChoiceSpec, collect

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
INPUT_SCHEMA = {**P.PROMPT_SCHEMA, "description": "A string, a list of token ids, or a batch of "
                "either (at most 2,048; token ids get no BOS)."}  # fmt: skip


class EmbeddingRequest(P._Request):
    model: str | None = None
    input: Any = Field(json_schema_extra=INPUT_SCHEMA)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: P.Int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: P.Int | None = Field(None, ge=-1)  # vLLM's: the last N tokens
    add_special_tokens: P.Bool = True  # vLLM's; strings only
    normalize: P.Bool = True  # vLLM's

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        v = P._integral(v)
        if isinstance(v, str) or (P._token_ids(v) and v):
            v = [v]
        ok = isinstance(v, list) and v and all(
            (isinstance(x, str) or P._token_ids(x)) and len(x) > 0 for x in v)  # fmt: skip
        if not ok:
            raise ValueError("must be a non-empty string, a non-empty list of token ids, or a "
                             "non-empty list of either, none of them empty")  # fmt: skip
        if len(v) > MAX_INPUTS:
            raise ValueError(f"{len(v)} inputs are more than {MAX_INPUTS}")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("must be -1 (the whole context) or at least 1")
        return v


def served(engine) -> bool:
    """Whether the engine's model can give its hidden states (one device, the model's own)."""
    return isinstance(getattr(engine, "model", None), Laneformer)


def prepare(prep, pooling: str, body: bytes) -> tuple[EmbeddingRequest, str, list[ChoiceSpec]]:
    """(the request, the model's name, one spec per input): parsed, tokenized and checked on
    the preparer's threads."""
    req: EmbeddingRequest = P.parse(EmbeddingRequest, body)
    model = prep.model_name(req.model)
    if not served(prep.engine):
        raise RequestError("embeddings: this server's engine spans several devices; "
                           "/v1/embeddings runs on one", param=None)  # fmt: skip
    width = prep.engine.model.head_width
    if req.dimensions is not None and req.dimensions != width:
        raise RequestError(f"dimensions: this model's vectors have {width} dimensions and are "
                           f"not Matryoshka-trained; {req.dimensions} cannot be served",
                           param="dimensions")  # fmt: skip
    vocab, max_len = prep.engine.cfg.vocab_size, prep.engine.max_len
    keep = req.truncate_prompt_tokens
    specs = []
    for i, x in enumerate(req.input):
        where = f"input[{i}]" if len(req.input) > 1 else "input"
        if isinstance(x, str):
            if keep is None:
                prep.check_text(x, where)
            ids = prep.tok.encode(x, req.add_special_tokens)
        else:
            bad = [t for t in x if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{where}: token id {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab})", param="input")  # fmt: skip
            ids = list(x)
        if keep is not None:
            ids = ids[-(max_len if keep == -1 else keep) :]
        if not ids:
            raise RequestError(f"{where}: no tokens to embed", param="input")
        if len(ids) > max_len:  # the whole context may be used: nothing is generated after
            raise RequestError(f"{where}: {len(ids)} tokens are more than this model's maximum "
                               f"context length of {max_len} tokens", param="input")  # fmt: skip
        specs.append(ChoiceSpec(i, ids, SamplingParams(), pool=pooling))
    return req, model, specs


def response(req: EmbeddingRequest, model: str, accs: dict[int, Accumulator],
             prompt_tokens: int) -> dict:  # fmt: skip
    data = []
    for i, a in sorted(accs.items()):
        v = F.normalize(a.vector, dim=0) if req.normalize else a.vector
        if req.encoding_format == "base64":
            out: Any = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode()
        else:
            out = v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": out})
    return {"id": P.new_id("embd"), "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}  # fmt: skip


def add_route(r: APIRouter, svc, docs: dict) -> None:
    """POST /embeddings on the /v1 router `r` of the server's Service `svc`."""

    @r.post("/embeddings", **docs)
    async def embeddings(request: Request):
        s = svc.ready()
        req, model, specs = await s.prepare(
            request, lambda b: prepare(s.preparer, s.limits.pooling, b)
        )
        job = s.submit(specs)
        accs = await collect(job, request.receive)
        if any(a.vector is None for a in accs.values()):  # cancelled: the client left
            raise RequestError("embeddings: cancelled", status_code=499)
        return await s.reply(response, req, model, accs, sum(len(sp.prompt_ids) for sp in specs))
