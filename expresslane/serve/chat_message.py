"""A chat request's messages on the wire: roles, text parts, an assistant's tool calls.

Each message reaches the chat template as a dict (`ChatMessage.for_template`), with any field
the template may read (`name`, `tool_call_id`, ...) kept. What the template cannot take is a
400 naming the message here, before any template runs: a `user`, `system`, `developer` or
`tool` message without content (templates read it: a null one had reached SmolLM2's as
"'dict object' has no attribute 'content'"), a content part other than text, and a tool call
that is not `{function: {name, arguments}}` (it had reached the generic tool prompt as a 500).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

# OpenAI's roles, vLLM's too ("function" is OpenAI's deprecated tool role)
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = Field(json_schema_extra={"enum": ["text"]})  # others: a 400 naming the type
    text: str | None = None


def parts_text(parts: list[ContentPart]) -> str:
    """Text parts joined; any other kind of part is a ValueError naming it."""
    bad = [p.type for p in parts if p.type != "text"]
    if bad:
        raise ValueError(f"content part of type {bad[0]!r} is not supported (text only)")
    return "".join(p.text or "" for p in parts)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    # OpenAI's: the arguments as JSON text, which need not parse (a model may write bad JSON);
    # some clients send the object itself, or null for a function of no arguments
    arguments: str | dict[str, Any] | None = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")  # id, type
    function: ToolCallFunction


# the content rule below, stated in the JSON schema (the OpenAPI document, the fuzz tests)
_CONTENT_RULE = {
    "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
    "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
}


class ChatMessage(BaseModel):
    # name, tool_call_id, ... reach the template
    model_config = ConfigDict(extra="allow", json_schema_extra=_CONTENT_RULE)
    role: Role
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    tool_calls: list[ToolCall] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role not in (None, "assistant"):  # as OpenAI's: only an assistant's
            raise ValueError(f"required in a {role!r} message")  # turn may be empty
        return v

    def for_template(self) -> dict:
        d = self.model_dump(exclude_none=True)
        d.setdefault("content", "")  # templates read an assistant's content even beside calls
        if isinstance(self.content, list):
            d["content"] = parts_text(self.content)
        return d
