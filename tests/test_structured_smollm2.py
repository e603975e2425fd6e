"""Structured output with the real SmolLM2-135M-Instruct (GGUF Q4_1): a subset of the schema
suite decoded greedy and sampled from a chat prompt, every output finished and valid under
`jsonschema`; and a forced tool call through the generic tool prompt (SmolLM2's template has
no tool support), its arguments valid under the function's schema. The whole suite runs in
`python -m expresslane.bench.structured`.
"""

from __future__ import annotations

import json

import pytest

from expresslane.bench.schemas import SCHEMAS
from expresslane.bench.structured import _prompt
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.serve.tools import parse_calls, plan_tools, prompt_messages
from expresslane.structured.closed import closed_objects
from expresslane.structured.grammar import GrammarCompiler, GrammarSpec
from expresslane.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_thread")
SUBSET = ["person", "classification", "int_range", "date"]


@pytest.fixture(scope="module")
def kit(smollm2_gguf):
    engine = Engine.from_pretrained(str(smollm2_gguf), progress=False)
    tok = Tokenizer.from_dir(smollm2_gguf)
    return engine, tok, GrammarCompiler(tok, engine.cfg.vocab_size)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_schema_subset_outputs_validate(kit, temperature):
    engine, tok, comp = kit
    for i, name in enumerate(SUBSET):
        schema = SCHEMAS[name]
        grammar = comp.compile(GrammarSpec.json_schema(schema))
        params = SamplingParams(max_tokens=64, temperature=temperature, seed=i, grammar=grammar)
        steps = list(engine.generate_steps(_prompt(tok, name, schema), params))
        text = tok.decode([s.token for s in steps], skip_special_tokens=True)
        assert steps[-1].finish_reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), closed_objects(schema))  # no unlisted keys


def test_forced_tool_call_through_the_generic_prompt(kit):
    engine, tok, comp = kit
    city = {"type": "string", "maxLength": 20}
    params_schema = {"type": "object", "properties": {"city": city}, "required": ["city"],
                     "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params_schema}}]
    template = tok.chat_templates["default"]
    plan = plan_tools({"tools": tools, "tool_choice": "required"}, template)
    assert not plan.native and plan.style == "hermes"  # SmolLM2's template takes no tools
    messages, kwargs = prompt_messages([{"role": "user", "content": "Weather in Paris?"}], plan)
    prompt = tok.encode_chat(messages, **kwargs)
    params = SamplingParams(max_tokens=64, grammar=comp.compile(plan.grammar))
    ids = list(engine.generate(prompt, params))
    content, calls = parse_calls(tok.decode(ids, skip_special_tokens=True), plan)
    assert len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), params_schema)
