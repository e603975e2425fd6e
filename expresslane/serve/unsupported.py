"""Request fields of the OpenAI / vLLM API that this server does not implement.

Ignoring them would return an answer the client did not ask for (free text instead of the JSON
its `response_format` demands, no tool call although `tools` were given), so each is refused
with a 400 naming it, unless it carries its neutral value (what the client would get without
sending it: `best_of: 1`, `suffix: ""`, `tools: []`, ...). Fields that are unknown
altogether are still ignored, as vLLM does: lm-eval forwards leftover generation kwargs.

Implementing one of them means deleting its line here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..errors import RequestError

log = logging.getLogger("expresslane.serve")


def _absent(v: Any) -> bool:
    return v is None or v == {} or v == [] or v == ""


def _zero(v: Any) -> bool:
    return v is None or v == 0


def _one(v: Any) -> bool:
    return v is None or v == 1


def _false(v: Any) -> bool:
    return v is None or v is False


Neutral = Callable[[Any], bool]

SAMPLING: dict[str, Neutral] = {"best_of": _one}
COMPLETIONS: dict[str, Neutral] = {**SAMPLING, "suffix": _absent}
CHAT: dict[str, Neutral] = {
    **SAMPLING,
    "functions": _absent,
    "function_call": lambda v: v in (None, "none", "auto"),
    "audio": _absent,
    "modalities": lambda v: _absent(v) or v == ["text"],
    "web_search_options": _absent,
    # vLLM's per-request template, which vLLM itself now refuses without a server flag
    # (--trust-request-chat-template): a template is code the server runs. `serve
    # --chat-template` sets one for every request.
    "chat_template": _absent,
}

_seen_unknown: set[str] = set()


def refuse_unsupported(extra: dict[str, Any] | None, table: dict[str, Neutral]) -> None:
    """400 for the first field of `table` present with a non-neutral value; log unknown ones."""
    for name, value in (extra or {}).items():
        neutral = table.get(name)
        if neutral is None:
            if name not in _seen_unknown:  # once per name, as vLLM warns
                _seen_unknown.add(name)
                log.info("request field %r is not part of this API: ignored", name)
            continue
        if not neutral(value):
            raise RequestError(
                f"{name}: not supported by this server (leave it out, or send its neutral value)",
                param=name,
            )


# What the OpenAPI schema says of each field above: only its neutral values, so that a client
# (or a fuzzer) built from the schema never sends a value the server refuses.
_NULL = {"type": "null"}
_ABSENT = {"anyOf": [_NULL, {"const": ""}, {"type": "array", "maxItems": 0},
                     {"type": "object", "maxProperties": 0}]}  # fmt: skip


def _only(*values: Any) -> dict:
    return {"anyOf": [_NULL, *({"const": v} for v in values)]}


SCHEMAS: dict[str, dict] = {
    "best_of": _only(1),
    "suffix": _ABSENT, "functions": _ABSENT,
    "function_call": _only("none", "auto"), "audio": _ABSENT,
    "modalities": {"anyOf": [*_ABSENT["anyOf"], {"const": ["text"]}]},
    "web_search_options": _ABSENT, "chat_template": _ABSENT,
}  # fmt: skip


def document(properties: dict, table: dict[str, Neutral]) -> None:
    """Add each unsupported field of `table` that a request model does not declare to its
    schema's properties, with its neutral values only."""
    for name in table:
        if name not in properties:
            properties[name] = {**SCHEMAS[name], "description": "not supported: neutral only"}
