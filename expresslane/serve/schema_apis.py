"""The response models of the agents' APIs, for the OpenAPI schema (schema.py): OpenAI's
Responses API (responses.py, responses_out.py) and Anthropic's Messages API (messages.py,
messages_out.py), and the pieces schema.py's models share with them. Like schema.py's, they
document and do not filter: every object allows further keys."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Open):
    cached_tokens: int  # prompt tokens the KV cache already held: reused, not prefilled


class Timings(_Open):
    """Per-request figures (milliseconds, tokens/s); OpenAI clients ignore the key."""

    queue_ms: float | None
    ttft_ms: float | None
    prompt_tokens: int
    cached_tokens: int | None = None
    prefill_tokens_per_s: float | None
    completion_tokens: int
    decode_ms: float
    decode_tokens_per_s: float | None
    e2e_ms: float | None


# --- OpenAI's Responses API -------------------------------------------------------------------
class ResponseUsage(_Open):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    total_tokens: int


class ResponseItem(_Open):
    """A `message` (`content`: an `output_text`) or a `function_call` (`name`, `arguments`)."""

    type: Literal["message", "function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseObject(_Open):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[ResponseItem]
    usage: ResponseUsage | None
    incomplete_details: dict | None
    previous_response_id: str | None
    timings: Timings | None = None


class ResponseEvent(_Open):
    """A streamed event (`event: <type>`, this as `data`): responses_out.py lists them."""

    type: str
    sequence_number: int


class ResponseDeleted(_Open):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# --- Anthropic's Messages API -----------------------------------------------------------------
class MessageUsage(_Open):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int  # prompt tokens the KV cache already held (prefix reuse)


class MessageBlock(_Open):
    """A `text` block (`text`) or a `tool_use` block (`id`, `name`, `input`)."""

    type: Literal["text", "tool_use"]


class MessageObject(_Open):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[MessageBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessageUsage


class MessageEvent(_Open):
    """A streamed event (`event: <type>`, this as `data`): messages_out.py lists them."""

    type: str


class TokenCount(_Open):
    input_tokens: int


# --- OpenAI's embeddings ----------------------------------------------------------------------
class Embedding(_Open):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingUsage(_Open):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Open):
    object: Literal["list"]
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
