"""The OpenAPI schema at /openapi.json (and the /docs and /redoc pages built from it).

The handlers read their bodies by hand (size limit, content type, parsing off the event loop),
so FastAPI cannot see what they take: each route declares it here instead, from the pydantic
request models of protocol.py, and what it answers, from the response models below. Clients
and tools can be generated from the schema, and the tests validate real requests and responses
against it.

The response models document; they do not filter. Every object allows further keys (as OpenAI
clients do), so a new field in an answer stays valid; add it to its model here to document it.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

from . import protocol as P
from . import unsupported
from .embeddings import EmbeddingRequest
from .guards import ServeLimits
from .messages import MessagesRequest
from .responses import ResponsesRequest
from .schema_apis import (
    EmbeddingList,
    MessageEvent,
    MessageObject,
    PromptTokensDetails,
    ResponseDeleted,
    ResponseEvent,
    ResponseObject,
    Timings,
    TokenCount,
    _Open,
)


# --- errors -----------------------------------------------------------------------------------
class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Open):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorDetail


# --- shared pieces ----------------------------------------------------------------------------
class CompletionTokensDetails(_Open):
    """With a `prediction` (OpenAI's Predicted Outputs): its drafts the model kept, and not.
    With `serve --reasoning-parser`: how many generated tokens the thought took, its tags
    included."""

    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    reasoning_tokens: int | None = None


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


FinishReason = Literal["stop", "length", "abort"] | None


# --- /v1/completions --------------------------------------------------------------------------
class CompletionLogprobs(_Open):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Open):
    """vLLM's: one token's logprob, its rank in the vocabulary (1: the most likely), its text."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's prompt_logprobs: null for the first token, then {token id: PromptLogprob} per token
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings


class CompletionChunk(_Open):
    """One `data:` event of a streamed completion; the usage chunk has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    completion_tokens: int
    timings: Timings | None = None


# --- /v1/chat/completions ---------------------------------------------------------------------
class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Open):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # with `serve --reasoning-parser`; `reasoning` alike


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    prompt_logprobs: PromptLogprobs | None = None


class ChatDelta(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with `serve --reasoning-parser`; `reasoning` alike


class ChatChunkChoice(_Open):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Open):
    """One `data:` event of a streamed chat completion; the usage chunk has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    completion_tokens: int
    timings: Timings | None = None


# --- the other routes -------------------------------------------------------------------------
class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Open):
    prompt: str


class TokenizerInfo(_Open):
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int


class Health(_Open):
    status: Literal["ok"]


class Version(_Open):
    version: str


# --- routes -----------------------------------------------------------------------------------
ERRORS = {
    400: "Invalid request: the message names the parameter",
    401: "Missing or wrong API key (with --api-key)",
    404: "Unknown model, or no stored response of that id",
    413: "Body larger than --max-request-bytes",
    415: "Body not declared as application/json",
    503: "Model still loading, or more than --max-queue requests waiting (Retry-After)",
}
SSE = "Server-sent events when `stream` is true: `data: <{}>` each, then `data: [DONE]` (chat)."
# route -> (summary, request model, response model, stream chunk model, error codes)
ROUTES: dict[str, tuple] = {
    "completions": ("Complete a prompt (OpenAI legacy completions)", P.CompletionRequest,
                    CompletionResponse, CompletionChunk, (400, 401, 404, 413, 415, 503)),
    "chat": ("Answer a conversation (OpenAI chat completions)", P.ChatCompletionRequest,
             ChatCompletionResponse, ChatCompletionChunk, (400, 401, 404, 413, 415, 503)),
    "responses": ("Answer input items (OpenAI's Responses API)", ResponsesRequest,
                  ResponseObject, ResponseEvent, (400, 401, 404, 413, 415, 503)),
    "response": ("A stored response", None, ResponseObject, None, (401, 404)),
    "response_deleted": ("Forget a stored response", None, ResponseDeleted, None, (401, 404)),
    "messages": ("Answer a conversation (Anthropic's Messages API)", MessagesRequest,
                 MessageObject, MessageEvent, (400, 401, 404, 413, 415, 503)),
    "count_tokens": ("Count a Messages request's input tokens", MessagesRequest, TokenCount,
                     None, (400, 401, 404, 413, 415, 503)),
    "embeddings": ("A vector for each input (OpenAI's embeddings)", EmbeddingRequest,
                   EmbeddingList, None, (400, 401, 404, 413, 415, 503)),
    "tokenize": ("Text or messages to token ids (vLLM's /tokenize)", P.TokenizeRequest,
                 TokenizeResponse, None, (400, 401, 413, 415, 503)),
    "detokenize": ("Token ids to text", P.DetokenizeRequest, DetokenizeResponse, None,
                   (400, 401, 413, 415, 503)),
    "models": ("The served model", None, ModelList, None, (401, 503)),
    "tokenizer_info": ("Special tokens, chat template, context", None, TokenizerInfo, None,
                       (503,)),
    "health": ("200 once the model is loaded, 503 before", None, Health, None, (503,)),
    "ping": ("/health under vLLM's other name (load balancers' probes)", None, Health, None,
             (503,)),
    "version": ("The server's version (vLLM's /version)", None, Version, None, ()),
    "metrics": ("Prometheus metrics", None, None, None, ()),
}  # fmt: skip
REQUEST_MODELS = [spec[1] for spec in ROUTES.values() if spec[1] is not None]
CHUNK_MODELS = [spec[3] for spec in ROUTES.values() if spec[3] is not None]


def route_docs(name: str) -> dict:
    """The route decorator's documentation arguments for route `name` of ROUTES."""
    summary, request, response, chunk, errors = ROUTES[name]
    responses: dict = {code: {"model": ErrorResponse, "description": ERRORS[code]}
                       for code in errors}  # fmt: skip
    if response is not None:
        responses[200] = {"model": response, "description": "Success"}
    else:  # /metrics: the Prometheus text format
        responses[200] = {"description": "Success", "content": {"text/plain": {}}}
    if chunk is not None:  # each event, as OpenAPI 3.2 describes server-sent events
        data = {
            "anyOf": [
                {"const": "[DONE]"},
                {
                    "contentMediaType": "application/json",
                    "contentSchema": {"$ref": f"#/components/schemas/{chunk.__name__}"},
                },
            ]
        }
        event = {"type": "object", "required": ["data"], "properties": {"data": data},
                 "description": SSE.format(chunk.__name__)}  # fmt: skip
        responses[200]["content"] = {"text/event-stream": {"schema": event}}
    docs: dict = {"summary": summary, "responses": responses}
    if request is not None:
        ref = {"$ref": f"#/components/schemas/{request.__name__}"}
        body = {"required": True, "content": {"application/json": {"schema": ref}}}
        docs["openapi_extra"] = {"requestBody": body}
    return docs


# pydantic leaves a constraint of an optional Annotated field as its own name (`"ge": 0` on
# max_tokens), which JSON Schema ignores: fuzzers then send -124 and count the 400 a surprise
_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _state_rules(node) -> None:
    """Make a request model's schema say what the server enforces: pydantic's leftover `ge`/
    `le` as JSON Schema keywords, and every number within float32 (protocol.Float)."""
    if isinstance(node, list):
        for item in node:
            _state_rules(item)
        return
    if not isinstance(node, dict):
        return
    for short, keyword in _KEYWORDS.items():
        if short in node and isinstance(node[short], int | float):
            node[keyword] = node.pop(short)
    if node.get("type") == "number":
        if "exclusiveMaximum" not in node:
            node["maximum"] = min(node.get("maximum", P.FP32_MAX), P.FP32_MAX)
        if "exclusiveMinimum" not in node:
            node["minimum"] = max(node.get("minimum", -P.FP32_MAX), -P.FP32_MAX)
    for key, value in node.items():
        if key != "default":
            _state_rules(value)


def install_openapi(app: FastAPI, limits: ServeLimits, names: list[str] | None = None) -> None:
    """Serve the schema with the request models and this server's own caps (`n` <= --max-n,
    `model` one of the served names)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, summary=app.summary, routes=app.routes
            )
            models = [(m, "validation") for m in REQUEST_MODELS]
            models += [(m, "serialization") for m in CHUNK_MODELS]
            _, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
            found = schema.setdefault("components", {}).setdefault("schemas", {})
            for key, value in defs.get("$defs", {}).items():
                found.setdefault(key, value)
            for name in (
                "CompletionRequest",
                "ChatCompletionRequest",
                "ResponsesRequest",
                "MessagesRequest",
            ):
                if "n" in found[name]["properties"]:
                    found[name]["properties"]["n"]["maximum"] = limits.max_n
                if names:
                    model = found[name]["properties"]["model"]
                    model["anyOf"] = [{"enum": list(names)}, {"type": "null"}]
            for model in REQUEST_MODELS:
                _state_rules(found[model.__name__])
                if hasattr(model, "UNSUPPORTED"):
                    unsupported.document(found[model.__name__]["properties"], model.UNSUPPORTED)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
