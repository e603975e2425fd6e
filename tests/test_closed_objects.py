"""Closed objects (structured/closed.py): a schema's listed-property objects admit no other keys.

The rewrite itself on every kind of subschema, what it leaves open and why, then the compiled
grammars (a response_format schema, a forced tool call) against `jsonschema` on the closed
schema as the reference: each document is accepted by the grammar exactly when it validates.
"""

from __future__ import annotations

import copy
import json

import pytest

from expresslane.assets import default_model_dir
from expresslane.presets import load_model_config
from expresslane.serve.tools import plan_tools
from expresslane.structured.closed import closed_objects
from expresslane.structured.grammar import GrammarCompiler, GrammarSpec
from expresslane.tokenizer import Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _obj(**props):
    return {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}


def test_listed_objects_are_closed_at_every_depth():
    schema = {
        **_obj(a="string"),
        "properties": {
            "inner": _obj(b="integer"),
            "list": {"type": "array", "items": _obj(c="boolean")},
            "pair": {"type": "array", "prefixItems": [_obj(d="null")]},
            "either": {"anyOf": [_obj(e="string"), {"$ref": "#/$defs/thing"}]},
            "keyed": {"type": "object", "additionalProperties": _obj(f="number")},
        },
        "$defs": {"thing": _obj(g="string")},
    }
    before = copy.deepcopy(schema)
    out = closed_objects(schema)
    assert schema == before  # a copy: the request's schema is not touched
    p = out["properties"]
    closed = [
        out,
        p["inner"],
        p["list"]["items"],
        p["pair"]["prefixItems"][0],
        p["either"]["anyOf"][0],
        p["keyed"]["additionalProperties"],
        out["$defs"]["thing"],
    ]
    assert all(node["additionalProperties"] is False for node in closed)
    # no object schema with properties was missed, and nothing else gained the key
    text = json.dumps(out)
    assert text.count('"additionalProperties": false') == len(closed)


def test_objects_that_decide_or_extend_stay_open():
    open_ones = {
        "says true": {**_obj(a="string"), "additionalProperties": True},
        "unevaluated": {**_obj(a="string"), "unevaluatedProperties": {"type": "integer"}},
        "requires an unlisted key": {**_obj(a="string"), "required": ["a", "b"]},
        "more keys than listed": {**_obj(a="string"), "minProperties": 2},
        "extends by $ref": {**_obj(a="string"), "$ref": "#/$defs/base"},
        "no properties": {"type": "object"},
    }
    for why, schema in open_ones.items():
        assert (
            "additionalProperties" not in closed_objects(schema)
            or schema.get("additionalProperties") is True
        ), why
    assert closed_objects(open_ones["says true"])["additionalProperties"] is True
    # allOf: each branch sees the whole object, so neither branch nor its $defs may close
    both = {"allOf": [_obj(a="string"), {"$ref": "#/$defs/b"}], "$defs": {"b": _obj(b="string"),
            "lone": _obj(c="string")}}  # fmt: skip
    out = closed_objects(both)
    assert "additionalProperties" not in out["allOf"][0]
    assert "additionalProperties" not in out["$defs"]["b"]
    assert out["$defs"]["lone"]["additionalProperties"] is False
    # a property named like a keyword is a name, not a schema
    named = _obj(properties="string", required="string")
    assert closed_objects(named)["properties"] == named["properties"]


@pytest.fixture(scope="module")
def compiler():
    pytest.importorskip("llguidance")
    path = default_model_dir()
    return GrammarCompiler(Tokenizer.from_dir(path), load_model_config(path).vocab_size)


def _accepts(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    m = compiler.compile(spec).matcher().m
    tokens = compiler.lltokenizer().tokenize_str(text)  # no prefix space, unlike encode's
    return (
        m.validate_tokens(tokens) == len(tokens) and m.consume_tokens(tokens) and (m.is_accepting())
    )


def _compact(doc) -> str:  # JSON as the grammars write it (grammar.COMPACT)
    return json.dumps(doc, separators=(",", ":"))


DOCS = [{"city": "Paris"}, {"city": "Paris", "country": "France"}, {"city": "Paris", "": False},
        {}, {"city": 3}]  # fmt: skip


@pytest.mark.parametrize("extra", [None, True, {"type": "string"}])
def test_a_schema_grammar_accepts_what_the_closed_schema_validates(compiler, extra):
    jsonschema = pytest.importorskip("jsonschema")
    schema = CITY if extra is None else {**CITY, "additionalProperties": extra}
    spec = GrammarSpec.json_schema(schema)
    reference = closed_objects(schema)
    verdicts = [_accepts(compiler, spec, _compact(d)) for d in DOCS]
    assert verdicts == [jsonschema.Draft202012Validator(reference).is_valid(d) for d in DOCS]
    assert verdicts[1] == (extra is not None)  # an unlisted key: refused unless the schema opens


def test_forced_tool_call_arguments_take_only_declared_keys(compiler):
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
    plan = plan_tools({"tools": tools, "tool_choice": "required"}, template="")
    reference = closed_objects(CITY)
    for args in DOCS:
        call = _compact({"name": "get_weather", "arguments": args})
        text = f"<tool_call>\n{call}\n</tool_call>"
        valid = jsonschema.Draft202012Validator(reference).is_valid(args)
        assert _accepts(compiler, plan.grammar, text) == valid, args
