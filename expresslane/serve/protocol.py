"""The OpenAI-compatible wire format: pydantic request models, error bodies, SSE, usage.

Requests are parsed with `parse()`: every pydantic failure becomes a `RequestError` naming the
parameter, a 400 in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, not
FastAPI's 422. Unknown fields are ignored (lm-eval sends leftover kwargs), unimplemented ones
refused (unsupported.py). The same models give the OpenAPI schema.

Defaults follow OpenAI and vLLM: temperature 1, top_p 1, top_k off, `max_tokens` 16 on
completions and the rest of the context on chat, where the model sets no sampling defaults of
its own (serve --generation-config: sampling/defaults.py). `stop` takes any number of strings.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import Ge
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)

from ..errors import ExpressLaneError, RequestError
from ..sampling.params import FP32_MAX, logit_bias_pairs
from . import unsupported
from .chat_message import ChatMessage, ContentPart, ToolCall, ToolCallFunction, parts_text


def _no_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a number, not a boolean")
    return v


def _fp32(v: float) -> float:
    # 1e39 is finite JSON but no fp32: it reached the sampler's fp32 buffers as a 500
    if not (math.isfinite(v) and abs(v) <= FP32_MAX):
        raise ValueError(f"must be a finite number within float32 range (|x| <= {FP32_MAX:.7g})")
    return v


Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool), AfterValidator(_fp32)]
Bool = Annotated[bool, Strict()]  # true or false only: "yes", 1 and "true" are refused
TokenId = Annotated[int, Ge(0), BeforeValidator(_no_bool)]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20
MAX_N = 128  # the API's cap; the server's own (--max-n) is usually lower
# fields whose null is their default (_SamplingRequest._nulls); typed "or null" in the schema
NULL_IS_DEFAULT = {"temperature", "top_p", "top_k", "min_p", "n", "stream", "logprobs", "echo"}


def _token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def _integral(v: Any) -> Any:
    """JSON Schema counts 259.0 as an integer: token ids written so are taken as ints."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # _SamplingRequest's are kept, to refuse by name


class StreamOptions(_Request):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False  # vLLM's: usage in every chunk, with include_usage


def _needs(field: str, kind: dict, then: str, value: Any) -> dict:
    """JSON Schema for "when `field` is given as `kind`, `then` must be `value`"."""
    return {
        "if": {"properties": {field: kind}, "required": [field]},
        "then": {"properties": {then: {"const": value}}, "required": [then]},
    }


def _state_rules(schema: dict, cls: type) -> None:
    """The cross-field rules check() enforces, stated in the model's JSON Schema."""
    schema["allOf"] = list(cls.RULES)


class Prediction(_Request):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat (a file to edit)."""

    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        try:
            return parts_text(self.content)
        except ValueError as e:
            raise RequestError(f"prediction.content: {e}", param="prediction") from None


class _SamplingRequest(_Request):
    model_config = ConfigDict(extra="allow", json_schema_extra=_state_rules)
    UNSUPPORTED: ClassVar[dict] = unsupported.SAMPLING
    RULES: ClassVar[list] = [
        _needs("stream_options", {"type": "object"}, "stream", True),
        {"if": {"properties": {"prompt_logprobs": {"type": "integer"}},
                "required": ["prompt_logprobs"]},
         "then": {"properties": {"stream": {"const": False}}}},
    ]  # fmt: skip

    model: str | None = None
    temperature: Float | None = Field(1.0, ge=0.0)
    top_p: Float | None = Field(1.0, gt=0.0, le=1.0)
    top_k: Int | None = Field(0, ge=-1)
    min_p: Float | None = Field(0.0, ge=0.0, le=1.0)
    seed: Int | None = Field(None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: Bool = False
    include_stop_str_in_output: Bool = False  # vLLM's: the stop string stays in the text
    return_tokens_as_token_ids: Bool = False  # vLLM's: logprobs' tokens as "token_id:N"
    priority: Int = 0  # vLLM's: lower first under --scheduling-policy priority
    # vLLM's: keep the prompt's last k tokens (-1: as many as leave room for max_tokens)
    truncate_prompt_tokens: Int | None = Field(None, ge=-1, json_schema_extra={"anyOf": [
        {"type": "integer", "minimum": 1}, {"const": -1}, {"type": "null"}]})  # fmt: skip
    # vLLM's logits adjustments (sampler.Penalties); null means the neutral value, as OpenAI's
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Float | None = Field(None, gt=0.0)
    min_tokens: Int | None = Field(None, ge=0)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)  # vLLM's: only these
    bad_words: list[str] | None = None  # vLLM's: words never completed (their last token held)
    logit_bias: dict[str, Float] | None = Field(None, json_schema_extra={"anyOf": [
        {"type": "object", "additionalProperties": False, "patternProperties": {
            "^[0-9]+$": {"type": "number", "minimum": -100, "maximum": 100}}},
        {"type": "null"}]})  # {"token id": bias in [-100, 100]}  # fmt: skip
    # vLLM's: each prompt token's logprob, rank and the top n (not with stream, as in vLLM)
    prompt_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI's Predicted Outputs (chat); here on completions too: drafts verified as
    # speculation (speculative/prediction.py), so only the speed changes
    prediction: Prediction | None = None
    n: Int | None = Field(1, ge=1, le=MAX_N)
    stream: Bool | None = False
    skip_special_tokens: Bool = True  # vLLM's: special tokens are left out of the text
    spaces_between_special_tokens: Bool = True
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """OpenAI's null for a field means the field left out (temperature, top_p, n, stream,
        logprobs, echo...: the OpenAI spec types them "or null", and clients send it), so it
        gets its default, the model's own where it has one (sampling/defaults.py)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return logit_bias_pairs(self.logit_bias or {})

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check(self) -> None:
        unsupported.refuse_unsupported(self.model_extra, self.UNSUPPORTED)
        if self.truncate_prompt_tokens == 0:
            msg = "truncate_prompt_tokens: must be -1 or an integer >= 1"
            raise RequestError(msg, param="truncate_prompt_tokens")
        if self.prompt_logprobs is not None and self.stream:
            msg = "prompt_logprobs: not available when stream is true (as in vLLM)"
            raise RequestError(msg, param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            msg = "stream_options: only allowed when stream is true"
            raise RequestError(msg, param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            "minItems": 1,
        },
    ],
    "description": "A string, a list of token ids, or a batch of either (token ids get no BOS).",
}


class CompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict] = unsupported.COMPLETIONS

    prompt: Any = Field(json_schema_extra=PROMPT_SCHEMA)
    max_tokens: Int | None = Field(16, ge=0)
    echo: Bool | None = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: Bool = True  # string prompts only: token-id prompts never get a BOS

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        v = _integral(v)
        many = isinstance(v, list) and v and all(isinstance(p, str) or _token_ids(p) for p in v)
        if not (isinstance(v, str) or _token_ids(v) or many):
            raise ValueError("must be a string, a list of token ids, or a non-empty list of either")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        return [p] if isinstance(p, str) or _token_ids(p) else list(p)


TEMPLATE_ARGUMENTS = {"messages", "add_generation_prompt", "continue_final_message"}


class ChatCompletionRequest(_SamplingRequest):
    UNSUPPORTED: ClassVar[dict] = unsupported.CHAT

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: Bool = True
    continue_final_message: Bool | None = None  # None: continue a trailing assistant message
    echo: Bool | None = False  # vLLM's: the answer begins with a trailing assistant message's text
    include_reasoning: Bool = True  # vLLM's: with `serve --reasoning-parser`, reasoning shown
    documents: list[dict[str, str]] | None = None  # vLLM's: the template's `documents` (RAG)
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, json_schema_extra={"propertyNames": {"not": {"enum": sorted(TEMPLATE_ARGUMENTS)}}}
    )
    RULES: ClassVar[list] = [
        *_SamplingRequest.RULES,
        _needs("top_logprobs", {"type": "integer"}, "logprobs", True),
    ]

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: needs logprobs set to true", param="top_logprobs")
        taken = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if taken:
            msg = f"chat_template_kwargs: {taken[0]!r} is set by the request itself, not here"
            raise RequestError(msg, param="chat_template_kwargs")


# /tokenize needs one of these (a string, or the messages); the preparer says so as a 400
TOKENIZE_SOURCES = {"anyOf": [
    {"required": [name], "properties": {name: {"type": kind}}}
    for name, kind in (("prompt", "string"), ("content", "string"), ("messages", "array"))
]}  # fmt: skip


class TokenizeRequest(_Request):
    model_config = ConfigDict(extra="ignore", json_schema_extra=TOKENIZE_SOURCES)

    prompt: str | None = None
    content: str | None = None  # llama.cpp's name
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None
    add_special: Bool | None = None  # llama.cpp's name
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(_Request):
    tokens: list[TokenId]


def parse(cls: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; any failure becomes a RequestError naming the parameter."""
    try:
        req = cls.model_validate_json(body or b"")
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        known = _FIELDS | cls.model_fields.keys()  # a model's own (responses.py's) as well
        loc = [x for x in err["loc"] if isinstance(x, int) or x in known]
        if err["type"] == "json_invalid":
            raise RequestError(
                f"invalid JSON body: {err['msg'].removeprefix('Invalid JSON: ')}", param=None
            ) from None
        if not loc:
            raise RequestError(f"request body: {err['msg']}", param=None) from None
        path = str(loc[0]) + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc[1:])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "literal_error":  # name what was sent: "... or 'function', got 'bot'"
            msg += f", got {err['input']!r}"
        raise RequestError(f"{path}: {msg}", param=str(loc[0])) from None
    if hasattr(req, "check"):
        req.check()
    return req


_FIELDS = {name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart,
                          ToolCall, ToolCallFunction, Prediction, StreamOptions, TokenizeRequest,
                          DetokenizeRequest)
           for name in m.model_fields}  # fmt: skip


# --- errors -----------------------------------------------------------------------------------
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 503: "unavailable_error"}  # fmt: skip
INTERNAL_ERROR = "internal server error (the server's log has the details)"  # no internals


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape (vLLM's too): the client shows `message` and exposes `param`."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_of(e: Exception) -> dict:
    """The error body for an exception: a user error keeps its status, anything else is a 500."""
    if isinstance(e, ExpressLaneError):
        return error_body(str(e), e.status_code, getattr(e, "param", None))
    return error_body(INTERNAL_ERROR, 500)


SLICE = 16384  # list items json encodes at one go: a few ms with the GIL held


class RawJSON(bytes):  # a value already serialised as JSON (ids a helper wrote: offload.py)
    pass


def json_bytes(obj: Any) -> bytes:
    """`obj` as compact JSON (Starlette's JSONResponse's form), a long list a slice at a time.

    json's C encoder holds the GIL for a whole call: 700k token ids (a 4 MB /tokenize) held it,
    and so the event loop, for over half a second, even off the loop. Between slices the GIL
    changes hands and /health answers."""
    if isinstance(obj, RawJSON):
        return bytes(obj)
    if isinstance(obj, dict):
        items = (json_bytes(str(k))[:-1] + b'":' + json_bytes(v) for k, v in obj.items())
        return b"{" + b",".join(items) + b"}"
    if isinstance(obj, list) and len(obj) > SLICE:
        parts = (json_bytes(obj[i : i + SLICE])[1:-1] for i in range(0, len(obj), SLICE))
        return b"[" + b",".join(parts) + b"]"
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8")


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


# --- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
