"""`tool_choice: auto` under its free grammar (serve/tools.py auto_grammar, decoding.py's
checked pick), with the embedded model.

- Free text comes out exactly as without the grammar, greedy and sampled: a pick the grammar
  allows is kept as drawn.
- A call the model opens is held to its schema: scripted logits that write a call to an unknown
  function get a known one from the first refused token on, the text before it untouched.
- The grammar takes free text (markers half written included) and calls, and refuses a call
  that does not match; `answer_grammar` applies it only where nothing rules it out.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from expresslane.assets import default_model_dir
from expresslane.engine import Engine
from expresslane.errors import RequestError
from expresslane.sampling.params import SamplingParams
from expresslane.serve.tools import answer_grammar, auto_grammar, parse_calls, plan_tools
from expresslane.step.split import SplitSteps
from expresslane.structured import decoding
from expresslane.structured.grammar import GrammarCompiler, GrammarSpec
from expresslane.tokenizer import Tokenizer

llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_thread")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def kit():
    path = default_model_dir()
    tok = Tokenizer.from_dir(path)
    engine = Engine.from_pretrained(str(path), progress=False, decode="graph")
    plan = plan_tools({"tools": [WEATHER, TIME]}, template="")
    grammar = GrammarCompiler(tok, engine.cfg.vocab_size).compile(auto_grammar(plan))
    return engine, tok, plan, grammar


def test_free_text_is_the_unconstrained_text(kit):
    engine, tok, _, grammar = kit
    prompt = tok.encode("def parse(text):\n    ")
    for kw in ({}, {"temperature": 0.9, "seed": 3}, {"temperature": 1.2, "seed": 8}):
        params = SamplingParams(max_tokens=48, **kw)
        plain = list(engine.generate(prompt, params))
        held = list(engine.generate(prompt, SamplingParams(grammar=grammar, max_tokens=48, **kw)))
        assert "<tool_call>" not in tok.decode(plain) and held == plain, kw


def _fake_engine(engine, split: bool):
    """What _Constrained reads of an engine; `split`: the split graphs' pick (step/split.py,
    run eagerly here), which a GPU replays captured."""
    fake = SimpleNamespace(device=engine.device, cfg=engine.cfg, speculator_for=lambda p: None)
    if split:
        fake.split_steps = SplitSteps(engine.step, engine.cfg.vocab_size, capture=False)
    return fake


@pytest.mark.parametrize("split", [False, True])
def test_a_call_the_model_opens_is_held_to_its_schema(kit, split):
    """Logits that write `Sure. <tool_call>` then a call to `get_wind`: the text up to the marker
    comes out as scripted, the call names a known function from the first refused token on,
    and every prefix the picks make is one the grammar takes."""
    engine, tok, plan, grammar = kit
    script = tok.encode('Sure. <tool_call>\n{"name": "get_wind", "arguments": {}}', False)
    params = SamplingParams(grammar=grammar, max_tokens=64)
    c = decoding._Constrained(_fake_engine(engine, split), [1], params, None)
    assert (c.picker is not None) == split
    V, rng = engine.cfg.vocab_size, torch.Generator().manual_seed(0)
    out = []
    for step in range(60):
        logits = torch.randn(V, generator=rng)
        if step < len(script):
            logits[script[step]] = 50.0  # the script's token is the argmax
        c.next_mask()
        out.append(c.pick(logits, step))
        if c.matcher.done:
            break
    text = tok.decode(out)
    assert text.startswith("Sure. <tool_call>") and "get_wind" not in text
    check = grammar.matcher()
    assert check.allowed_prefix(out) == len(out)  # a prefix the grammar takes, all the way
    call = text.split("<tool_call>")[1]
    assert call.lstrip().startswith(('{"name": "get_weather"', '{"name": "get_time"')), text


@pytest.mark.parametrize("text", [
    "Plain text.", "a <b> <tool <tools> <tool_call", "  \n", "line\n<tool_cal",
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
])  # fmt: skip
def test_the_grammar_takes_free_text_and_calls(kit, text):
    _, tok, plan, grammar = kit
    ids = tok.encode(text, False)
    assert grammar.matcher().allowed_prefix(ids) == len(ids)
    assert parse_calls(text, plan)[1] or "</tool_call>" not in text


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_wind", "arguments": {}}',  # an unknown function
    '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}',  # an unknown key
    '<tool_call>\n{"name": "get_weather", "arguments": {}}',  # a required key missing
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and text after',
])  # fmt: skip
def test_the_grammar_refuses_a_call_that_does_not_match(kit, bad):
    _, tok, _, grammar = kit
    ids = tok.encode(bad, False)
    assert grammar.matcher().allowed_prefix(ids) < len(ids)


def test_answer_grammar_applies_the_free_grammar_only_where_nothing_rules_it_out():
    req = SimpleNamespace(min_tokens=None, allowed_token_ids=None, bad_words=None)
    tools = {"tools": [WEATHER]}
    auto = answer_grammar(plan_tools(tools, ""), None, req, True)
    assert auto is not None and auto.trigger == "<tool_call>"
    schema = GrammarSpec.json_schema({"type": "object"})
    assert answer_grammar(plan_tools(tools, ""), schema, req, True) is schema
    assert answer_grammar(plan_tools(tools, ""), None, req, False) is None  # no grammars
    for field in ("min_tokens", "bad_words"):
        own = SimpleNamespace(**{**req.__dict__, field: 2 if field == "min_tokens" else ["x"]})
        assert answer_grammar(plan_tools(tools, ""), None, own, True) is None
    for template, trigger in (("tools [TOOL_CALLS]", "[TOOL_CALLS]"),
                              ("tools <|python_tag|>", "^<|python_tag|>")):  # fmt: skip
        assert answer_grammar(plan_tools(tools, template), None, req, True).trigger == trigger
    assert answer_grammar(plan_tools({**tools, "tool_choice": "none"}, ""), None, req,
                          True) is None  # fmt: skip
    forced = plan_tools({**tools, "tool_choice": "required"}, "")
    assert answer_grammar(forced, None, req, True) is forced.grammar
    with pytest.raises(RequestError, match="cannot be combined"):
        answer_grammar(plan_tools({**tools, "tool_choice": "required"}, ""), schema, req, True)


def test_the_json_lexer_starts_at_the_trigger(kit):
    """The closing steering's lexer starts after `<tool_call>` (with the rest of the token that
    completes it, where a tokenizer has `>{"`; these two split there): free text before it is
    not JSON, and after it the lexer is two objects deep, inside the city's string."""
    _, tok, _, grammar = kit
    text = 'Sure {[" <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    ids = tok.encode(text, False)
    m = grammar.matcher()
    for k, t in enumerate(ids):
        m.consume(t)
        assert m.waiting == ("<tool_call>" not in tok.decode(ids[: k + 1]))
    assert not m.waiting and m.depth == 2 and m.in_string
