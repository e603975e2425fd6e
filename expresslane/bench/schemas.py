"""The project's JSON-schema suite for structured output: 64 schemas an agent might send.

Nested objects, arrays with min/max items, enums and consts, `anyOf`/`oneOf`, `$ref` into
`$defs` (recursion included), string patterns and formats, length bounds, numbers with bounds,
optional fields and `additionalProperties: false`. The tests decode every schema with the
embedded model and a subset with SmolLM2 and validate every output with `jsonschema`
(tests/test_structured_schemas.py); `bench/grammar.py` times compiling them and masking.
Strings carry a maxLength where a small model could otherwise ramble past max_tokens.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 24}
I = {"type": "integer"}  # noqa: E741
N = {"type": "number"}
B = {"type": "boolean"}


def obj(props: dict, required: list[str] | None = None, closed: bool = True) -> dict:
    """An object schema: every property required unless `required` says otherwise."""
    out = {"type": "object", "properties": props, "required": list(props) if required is None
           else required}  # fmt: skip
    if closed:
        out["additionalProperties"] = False
    return out


def arr(items: dict, lo: int | None = None, hi: int | None = None) -> dict:
    out = {"type": "array", "items": items}
    if lo is not None:
        out["minItems"] = lo
    if hi is not None:
        out["maxItems"] = hi
    return out


_PERSON = obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}})
_TREE = {
    "$defs": {"node": obj({"label": S, "children": arr({"$ref": "#/$defs/node"}, 0, 2)})},
    "$ref": "#/$defs/node",
}

SCHEMAS: dict[str, dict] = {
    # --- scalars and bounds
    "string": S,
    "integer": I,
    "number": N,
    "boolean": B,
    "null": {"type": "null"},
    "int_range": {"type": "integer", "minimum": -5, "maximum": 5},
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    "number_range": {"type": "number", "minimum": 0.5, "maximum": 99.5},
    "short_string": {"type": "string", "minLength": 2, "maxLength": 5},
    "const": {"const": "fixed"},
    "enum_str": {"enum": ["red", "green", "blue"]},
    "enum_mixed": {"enum": ["a", 1, True, None]},
    # --- patterns and formats
    "pattern_code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
    "pattern_hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
    "pattern_words": {"type": "string", "pattern": "^[a-z]+( [a-z]+){0,3}$"},
    "date": {"type": "string", "format": "date"},
    "time": {"type": "string", "format": "time"},
    "date_time": {"type": "string", "format": "date-time"},
    "email": {"type": "string", "format": "email", "maxLength": 40},
    "uuid": {"type": "string", "format": "uuid"},
    "ipv4": {"type": "string", "format": "ipv4"},
    # --- flat objects
    "person": _PERSON,
    "point": obj({"x": N, "y": N}),
    "flags": obj({"debug": B, "verbose": B, "level": {"enum": ["low", "mid", "high"]}}),
    "optional_fields": obj({"id": I, "nick": S, "score": N}, required=["id"]),
    "all_optional": obj({"a": I, "b": S}, required=[]),
    "open_object": obj({"id": I}, closed=False),
    "nullable": obj({"value": {"type": ["integer", "null"]}}),
    "weather": obj(
        {
            "city": S,
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "temperature": {"type": "number", "minimum": -90, "maximum": 60},
        }
    ),
    "tool_args": obj({"query": S, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}),
    "version": obj(
        {
            "major": {"type": "integer", "minimum": 0},
            "minor": {"type": "integer", "minimum": 0},
            "tag": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        },
        required=["major", "minor"],
    ),  # fmt: skip
    # --- arrays
    "int_list": arr(I, 1, 4),
    "string_list": arr(S, 0, 3),
    "exact_pair": arr(N, 2, 2),
    "bool_list": arr(B, 1, 5),
    "enum_list": arr({"enum": ["x", "y", "z"]}, 1, 3),
    "people": arr(_PERSON, 1, 3),
    "matrix": arr(arr(I, 2, 2), 2, 2),
    "tuple": {"type": "array", "prefixItems": [S, I, B], "items": False},
    "tags": obj({"tags": arr({"type": "string", "pattern": "^[a-z]{2,10}$"}, 1, 4)}),
    # --- nesting
    "address": obj(
        {
            "name": S,
            "address": obj(
                {"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
            ),
        }
    ),  # fmt: skip
    "order": obj(
        {
            "id": {"type": "integer", "minimum": 1},
            "items": arr(
                obj(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z0-9]{4,8}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    }
                ),
                1,
                3,
            ),
            "paid": B,
        }
    ),  # fmt: skip
    "config": obj(
        {
            "server": obj({"host": S, "port": {"type": "integer", "minimum": 1, "maximum": 65535}}),
            "workers": {"type": "integer", "minimum": 1, "maximum": 16},
            "tls": B,
        }
    ),  # fmt: skip
    "deep": obj({"a": obj({"b": obj({"c": obj({"d": I})})})}),
    "event": obj(
        {
            "title": S,
            "when": {"type": "string", "format": "date"},
            "attendees": arr({"type": "string", "format": "email", "maxLength": 32}, 0, 2),
        }
    ),
    "invoice": obj(
        {
            "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "lines": arr(obj({"what": S, "amount": {"type": "number", "minimum": 0}}), 1, 2),
            "total": {"type": "number", "minimum": 0},
        }
    ),
    "map_of_ints": {"type": "object", "additionalProperties": I, "maxProperties": 3},
    # --- anyOf / oneOf / $ref
    "any_scalar": {"anyOf": [I, S, B]},
    "any_object": {
        "anyOf": [
            obj({"kind": {"const": "cat"}, "lives": I}),
            obj({"kind": {"const": "dog"}, "good": B}),
        ]
    },
    "one_of_shapes": {"oneOf": [obj({"circle": N}), obj({"square": N})]},
    "nullable_ref": {"$defs": {"p": _PERSON}, "anyOf": [{"$ref": "#/$defs/p"}, {"type": "null"}]},
    "ref_simple": {
        "$defs": {"id": {"type": "integer", "minimum": 1}},
        **obj({"id": {"$ref": "#/$defs/id"}, "parent": {"$ref": "#/$defs/id"}}),
    },
    "ref_list": {
        "$defs": {"item": obj({"n": I})},
        **obj({"items": arr({"$ref": "#/$defs/item"}, 1, 3)}),
    },  # fmt: skip
    "tree": _TREE,
    "linked_list": {
        "$defs": {
            "cell": obj({"v": I, "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}})
        },
        "$ref": "#/$defs/cell",
    },  # fmt: skip
    "union_list": arr({"anyOf": [I, {"type": "string", "maxLength": 8}]}, 1, 4),
    "action": {
        "anyOf": [
            obj({"action": {"const": "search"}, "query": S}),
            obj({"action": {"const": "answer"}, "text": {"type": "string", "maxLength": 40}}),
        ]
    },
    # --- agent shapes
    "classification": obj(
        {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),
    "extraction": obj(
        {"entities": arr(obj({"text": S, "type": {"enum": ["PER", "ORG", "LOC"]}}), 0, 3)}
    ),  # fmt: skip
    "plan": obj({"goal": S, "steps": arr({"type": "string", "maxLength": 30}, 1, 3), "done": B}),
    "rating": obj(
        {
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "comment": {"type": "string", "maxLength": 40},
        },
        required=["stars"],
    ),
    "calendar": obj(
        {
            "date": {"type": "string", "format": "date"},
            "slots": arr(
                obj(
                    {
                        "start": {"type": "string", "format": "time"},
                        "minutes": {"enum": [15, 30, 60]},
                    }
                ),
                1,
                2,
            ),
        }
    ),
    "code_edit": obj(
        {
            "file": {"type": "string", "pattern": "^[a-z_]{1,12}\\.py$"},
            "line": {"type": "integer", "minimum": 1, "maximum": 999},
            "replace": {"type": "string", "maxLength": 40},
        }
    ),
    "http_call": obj(
        {
            "method": {"enum": ["GET", "POST"]},
            "path": {"type": "string", "pattern": "^/[a-z/]{0,20}$"},
            "headers": {"type": "object", "additionalProperties": S, "maxProperties": 2},
        }
    ),  # fmt: skip
    "sql_query": obj(
        {
            "table": {"enum": ["users", "orders"]},
            "columns": arr({"type": "string", "pattern": "^[a-z_]{1,10}$"}, 1, 3),
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        required=["table", "columns"],
    ),  # fmt: skip
}
