"""Structured output after a thought (`serve --reasoning-parser`): grammar.py's wrapper.

With a reasoning parser, a chat answer's grammar lets the model think first, as
structured/reasoning.py splits a thought, and holds only the answer after it to the schema.
Checked on llguidance's matcher with the tiny model's byte-level tokenizer: the texts a parser
splits into (thought, valid answer) are accepted to the end, a wrong answer after a thought is
refused at its first wrong token, and the answer that `reasoning.split` returns validates.
qwen3's thought is required here (grammar.py says why); a request that turns thinking off gets
the plain grammar (tests/server/test_server_reasoning.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from expresslane.structured.grammar import GrammarCompiler, GrammarError, GrammarSpec
from expresslane.structured.reasoning import split
from expresslane.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
          "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def kit(random_laneformer_dir):
    tok = Tokenizer.from_dir(random_laneformer_dir)
    return tok, GrammarCompiler(tok, tok.vocab_size)


def run(kit, think: str, text: str) -> tuple[bool, bool]:
    """(every token accepted, the grammar complete after them) for `text` under the schema."""
    tok, compiler = kit
    m = compiler.compile(replace(GrammarSpec.json_schema(SCHEMA), think=think)).matcher()
    for t in tok.encode(text, False):
        try:
            m.consume(t)
        except GrammarError:
            return False, False
    return True, m.m.is_accepting()


THOUGHT = '<think>\nThe user wants {"a": "z"}? No.\n</think>\n\n{"a":"y"}'
CASES = [  # (text, deepseek_r1: accepted and complete, qwen3: the same)
    (THOUGHT, (True, True), (True, True)),
    ('weighing it</think>{"a":"x"}', (True, True), (False, False)),  # the tag in the prompt
    ('{"a":"x"}', (True, False), (False, False)),  # no thought yet: both still want one
    ('<think>no</think>{"a":"z"}', (False, False), (False, False)),
    ('<think>no</think>{"a":"x"}, more', (False, False), (False, False)),
]


@pytest.mark.parametrize("text,deepseek,qwen3", CASES)
def test_the_answer_after_a_thought_is_held_to_the_schema(kit, text, deepseek, qwen3):
    for parser, want in (("deepseek_r1", deepseek), ("qwen3", qwen3)):
        assert run(kit, parser, text) == want, parser
        if want == (True, True):
            jsonschema.validate(json.loads(split(text, parser)[1]), SCHEMA)


def test_the_thought_wrapper_is_its_own_cache_entry(kit):
    _, compiler = kit
    plain = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    thinking = compiler.compile(replace(GrammarSpec.json_schema(SCHEMA), think="qwen3"))
    assert plain is not thinking and plain.closing is not None and thinking.thought_end
    assert compiler.compile(replace(GrammarSpec.json_schema(SCHEMA), think="qwen3")) is thinking


def test_the_json_lexer_starts_after_the_thought(kit):
    """The closing steering's JSON lexer reads the answer only: brackets and quotes inside the
    thought are not JSON; a thought's end is seen whatever tokens spell it."""
    tok, compiler = kit
    m = compiler.compile(replace(GrammarSpec.json_schema(SCHEMA), think="deepseek_r1")).matcher()
    for t in tok.encode('He said {"b": [1, "', False):
        m.consume(t)
    assert m.thinking and m.depth == 0 and not m.in_string
    for t in tok.encode('</think>{"a":', False):
        m.consume(t)
    assert not m.thinking and m.depth == 1 and not m.in_string
