"""Structured output fields of a request -> one grammar (grammar.py), or a 400 naming the field.

Understood, from the request body (each maps to a `GrammarSpec`):
- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
  {"name", "schema", "strict"}}; strict or not, the schema is enforced;
- vLLM: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"}, and its
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- llama.cpp's server: `json_schema` (a schema) and `grammar` (GBNF).
A grammar is GBNF when it has `::=` rules, else Lark (llguidance's own). More than one of these
in a request is a 400: they would have to agree.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import RequestError
from ..structured.grammar import GrammarSpec

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "json_schema", "grammar")  # fmt: skip


def _grammar(text: Any, param: str) -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise RequestError(f"{param}: must be a non-empty grammar text", param=param)
    return GrammarSpec("gbnf" if "::=" in text else "lark", text, param)


def _schema(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError(f"{param}: not valid JSON", param=param) from None
    if not isinstance(value, dict):
        raise RequestError(f"{param}: a JSON schema must be an object", param=param)
    return GrammarSpec.json_schema(value, param)


def _choice(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise RequestError(f"{param}: must be a non-empty list of strings", param=param)
    return GrammarSpec("choice", json.dumps(value), param)


def _regex(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param}: must be a non-empty regular expression", param=param)
    return GrammarSpec("regex", value, param)


def _response_format(rf: Any) -> GrammarSpec | None:
    p = "response_format"
    if not isinstance(rf, dict):
        raise RequestError(f"{p}: must be an object with a 'type'", param=p)
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "", p)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise RequestError(f"{p}.json_schema: required, an object with a 'schema'", param=p)
        schema = js.get("schema", js.get("json_schema"))
        return _schema({"type": "object"} if schema is None else schema, f"{p}.json_schema")
    raise RequestError(f"{p}.type: expected text, json_object or json_schema, not {kind!r}", p)


def _structured_outputs(so: Any) -> list[GrammarSpec]:
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise RequestError(f"{p}: must be an object", param=p)
    makers = {"json": _schema, "regex": _regex, "choice": _choice, "grammar": _grammar}
    out = [makers[k](v, f"{p}.{k}") for k, v in so.items() if k in makers and v is not None]
    if so.get("json_object"):
        out.append(GrammarSpec("json_object", "", p))
    return out


def request_grammar(extra: dict[str, Any] | None) -> GrammarSpec | None:
    """The one grammar a request's structured-output fields ask for, or None."""
    extra = extra or {}
    found: list[GrammarSpec] = []
    if extra.get("response_format") not in (None, {}):
        spec = _response_format(extra["response_format"])
        found += [spec] if spec else []
    if extra.get("structured_outputs"):
        found += _structured_outputs(extra["structured_outputs"])
    for name, make in (("guided_json", _schema), ("guided_regex", _regex),
                       ("guided_choice", _choice), ("guided_grammar", _grammar),
                       ("json_schema", _schema), ("grammar", _grammar)):  # fmt: skip
        if extra.get(name) not in (None, "", {}, []):
            found.append(make(extra[name], name))
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise RequestError(f"{found[1].param}: one structured output per request ({names})",
                           param=found[1].param)  # fmt: skip
    return found[0] if found else None
