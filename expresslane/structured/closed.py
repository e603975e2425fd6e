"""Closed objects: an object schema that lists its properties admits no others, unless it says so.

JSON Schema leaves `additionalProperties` true by default, so `{"type": "object", "properties":
{"city": ...}, "required": ["city"]}` also admits `{"city": "Paris", "country": "", "": false}`.
A small model under such a schema writes those extra keys often (SmolLM2's forced tool calls
did in most of a dozen tries), and an agent's function then gets arguments it never declared.
vLLM's default grammar engine (xgrammar, `strict_mode`) and OpenAI's strict schemas admit only
the listed properties, and so does this engine: `closed_objects` adds `"additionalProperties":
false` to every object schema that lists `properties` and does not decide for itself. A schema
that wants other keys says `"additionalProperties": true` (or a schema for them).

Not closed, because closing would change what the schema means rather than tighten a default:
- an object whose `required` names a key it does not list, or whose `minProperties` exceeds
  what it lists (closing would make it unsatisfiable);
- an object that sets `unevaluatedProperties`, or extends another through `$ref` or `allOf`
  beside its own properties, and the branches of an `allOf` and the `$defs` an `allOf` refers
  to: in JSON Schema each branch sees the whole object, so closed branches would refuse each
  other's keys.
"""

from __future__ import annotations

import copy
from typing import Any

# keywords whose value is a map of names to subschemas / a list of subschemas / one subschema
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` with its listed-property objects closed (the module's rule)."""
    out = copy.deepcopy(schema)
    _walk(out, _open_defs(out), closable=True)
    return out


def _walk(node: Any, open_defs: set[str], closable: bool) -> None:
    if not isinstance(node, dict):
        return
    if closable and _should_close(node):
        node["additionalProperties"] = False
    for key in _MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                ok = key not in ("$defs", "definitions") or f"#/{key}/{name}" not in open_defs
                _walk(s, open_defs, ok)
    for key in _LISTS:
        sub = node.get(key)
        if isinstance(sub, list):
            for s in sub:
                _walk(s, open_defs, key != "allOf")
    for key in _ONE:
        sub = node.get(key)
        if isinstance(sub, list):  # draft-04 tuple `items`
            for s in sub:
                _walk(s, open_defs, True)
        else:
            _walk(sub, open_defs, True)


def _should_close(node: dict) -> bool:
    props = node.get("properties")
    if not isinstance(props, dict) or not props:
        return False
    if any(k in node for k in ("additionalProperties", "unevaluatedProperties", "$ref", "allOf")):
        return False
    required = node.get("required", [])
    if not isinstance(required, list) or any(r not in props for r in required):
        return False
    least = node.get("minProperties", 0)
    return not isinstance(least, int) or least <= len(props)


def _open_defs(schema: Any) -> set[str]:
    """The `$ref`s that an `allOf` branch names: definitions that must stay open."""
    found: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for branch in node.get("allOf") or []:
                if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                    found.add(branch["$ref"])
            for v in node.values():
                visit(v)
        elif isinstance(node, list):
            for v in node:
                visit(v)

    visit(schema)
    return found
