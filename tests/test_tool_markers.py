"""Tool calls in the Mistral and Llama 3 conventions, and markers that are special tokens
(serve/tools.py), with the embedded model and tokenizers whose markers are special
(marker_kit.py).

- A marker the tokenizer keeps special is found, is that token in the forced and free grammars,
  and stays in the answer's text where other special tokens are skipped, so the answer parses.
- `tool_choice: auto` runs under the free grammar in all three conventions: free text is the
  text without a grammar, a call the model opens is held to its schema, and a marker spelled
  out in plain tokens is refused (the answer is parsed as written).
- A Llama 3 answer is a call when it begins with `{` or the python tag: the JSON steering starts
  there, and an answer that begins otherwise stays free text to its end.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from marker_kit import marker_tokenizer

from expresslane.assets import default_model_dir
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.serve.tools import auto_grammar, parse_calls, plan_tools, special_markers
from expresslane.structured import decoding
from expresslane.structured.grammar import GrammarCompiler
from expresslane.tokenizer import IncrementalDetokenizer, Tokenizer

llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_thread")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
        "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}  # fmt: skip
TOOLS = {"tools": [WEATHER, TIME]}
UTC = '{"name": "get_time", "arguments": {"zone": "utc"}}'
# (convention, markers special): the kits below
KINDS = [("mistral", True), ("mistral", False), ("llama3", True), ("llama3", False),
         ("hermes", True)]  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(default_model_dir()), progress=False, decode="graph")


@pytest.fixture(scope="module")
def kits(engine, tmp_path_factory):
    """(style, special) -> (tokenizer, plan, compiled free grammar, markers' ids)."""
    plain = Tokenizer.from_dir(default_model_dir())
    out = {}
    for style, special in KINDS:
        if special:
            folder, ids = marker_tokenizer(tmp_path_factory.mktemp(style), style)
            tok = Tokenizer.from_dir(folder)
        else:
            tok, ids = plain, {}
        plan = plan_tools(TOOLS, tok._template([WEATHER]) if special else "tools", style_of(style),
                          tok)  # fmt: skip
        grammar = GrammarCompiler(tok, engine.cfg.vocab_size).compile(auto_grammar(plan))
        out[style, special] = SimpleNamespace(tok=tok, plan=plan, grammar=grammar, ids=ids)
    return out


def style_of(style: str) -> str:
    """vLLM's --tool-call-parser name of a convention."""
    return {"llama3": "llama3_json"}.get(style, style)


def text_of(tok, ids, plan) -> str:
    """The answer's text as the server decodes it: special tokens skipped, the markers kept."""
    detok = IncrementalDetokenizer(tok, True, (), plan.kept)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def test_markers_that_are_special_tokens_are_found(kits):
    for (style, _), kit in kits.items():
        assert special_markers(style, kit.tok) == kit.ids
        assert kit.plan.specials == kit.ids and set(kit.plan.kept) == set(kit.ids.values())
        assert kit.plan.style == style
    none = plan_tools({**TOOLS, "tool_choice": "none"}, "tools [TOOL_CALLS]", None,
                      kits["mistral", True].tok)  # fmt: skip
    assert none is not None and none.kept == ()  # nothing parsed: nothing kept


def test_the_kept_marker_shows_where_other_special_tokens_are_skipped(kits):
    kit = kits["mistral", True]
    tok, marker = kit.tok, kit.ids["[TOOL_CALLS]"]
    ids = tok.encode("Sure", False) + [2, marker] + tok.encode(' [{"a": 1}]', False)
    text = text_of(tok, ids, kit.plan)
    assert text == tok.decode([t for t in ids if t != 2]) and "[TOOL_CALLS]" in text
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)  # what it was


def _run(engine, kit, script: list[int], steps: int = 200, forced=None) -> tuple[list[int], bool]:
    """Picks under the kit's grammar (or `forced`) from random logits that make the script's
    tokens the argmax while it lasts, then the end of text; and whether the answer ended (the
    grammar complete, or an end of text where it may end)."""
    grammar = forced or kit.grammar
    fake = SimpleNamespace(device=engine.device, cfg=engine.cfg, speculator_for=lambda p: None)
    c = decoding._Constrained(fake, [1], SamplingParams(grammar=grammar, max_tokens=steps), None)
    V, rng, out = engine.cfg.vocab_size, torch.Generator().manual_seed(0), []
    for step in range(steps - 4):
        logits = torch.randn(V, generator=rng)
        if step < len(script):
            logits[script[step]] = 50.0
        else:  # then the end of text wherever the grammar allows it
            logits[engine.cfg.eos_token_ids[0]] = 20.0
        c.next_mask()
        out.append(c.pick(logits, step))
        if c.matcher.done or out[-1] in engine.cfg.eos_token_ids:
            break
    ended = c.matcher.done or out[-1] in engine.cfg.eos_token_ids
    out = [t for t in out if t not in engine.cfg.eos_token_ids]
    assert grammar.matcher().allowed_prefix(out) == len(out)  # the grammar takes it all
    return out, ended


@pytest.mark.parametrize("kind", [("mistral", True), ("hermes", True)])
def test_a_forced_call_writes_the_special_marker_and_parses(engine, kits, kind):
    kit = kits[kind]
    plan = plan_tools({**TOOLS, "tool_choice": "required"}, "tools " + kind[0], style_of(kind[0]),
                      kit.tok)  # fmt: skip
    grammar = GrammarCompiler(kit.tok, engine.cfg.vocab_size).compile(plan.grammar)
    out, ended = _run(engine, kit, [], forced=grammar)
    assert out[0] == next(iter(kit.ids.values())) and ended  # the marker's own token, as trained
    content, calls = parse_calls(text_of(kit.tok, out, plan), plan)
    assert calls and {c["function"]["name"] for c in calls} <= {"get_weather", "get_time"}


@pytest.mark.parametrize("kind", KINDS)
def test_free_text_is_the_unconstrained_text(engine, kits, kind):
    kit = kits[kind]
    prompt = kit.tok.encode("def parse(text):\n    ")
    for kw in ({}, {"temperature": 0.9, "seed": 3}):
        plain = list(engine.generate(prompt, SamplingParams(max_tokens=40, **kw)))
        held = list(engine.generate(prompt, SamplingParams(grammar=kit.grammar, max_tokens=40,
                                                           **kw)))  # fmt: skip
        assert held == plain, kw


def _script(kit, style: str, special: bool) -> tuple[list[int], int]:
    """Token ids that open a call to the unknown `get_wind`, and how many of them (the text and
    the marker) come out as scripted."""
    enc = lambda s: kit.tok.encode(s, False)  # noqa: E731
    call_args = '{"name": "get_wind", "%s": {}}' % ("parameters" if style == "llama3" else
                                                     "arguments")  # fmt: skip
    if style == "llama3":
        lead = [kit.ids["<|python_tag|>"]] if special else []
        return lead + enc(call_args), len(lead)
    marker = [kit.ids[m] for m in kit.ids][:1] if special else enc(" [TOOL_CALLS]")
    head = enc("Sure.") + marker
    tail = enc(" [" + call_args + "]") if style == "mistral" else enc("\n" + call_args)
    return head + tail, len(head)


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_the_model_opens_is_held_to_its_schema(engine, kits, kind):
    kit, (style, special) = kits[kind], kind
    script, kept = _script(kit, style, special)
    out, ended = _run(engine, kit, script)
    assert out[:kept] == script[:kept]
    text = text_of(kit.tok, out, kit.plan)
    assert "get_wind" not in text and ('"name": "get_weather"' in text or
                                       '"name": "get_time"' in text), text  # fmt: skip
    assert ended and parse_calls(text, kit.plan)[1], text  # the calls closed, and parse


@pytest.mark.parametrize("kind,text,ok", [
    (("mistral", True), "Plain [text] and [TOOL", True),
    (("mistral", True), "x [TOOL_CALLS] [", False),  # spelled out: the special token it is
    (("mistral", False), f'Sure [TOOL_CALLS] [{UTC}, {UTC}]', True),
    (("mistral", False), f"x [TOOL_CALLS] [{UTC}] more", False),
    (("mistral", False), 'x [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', False),
    (("llama3", False), "Use {braces} here.", True),
    (("llama3", False), f' {UTC.replace("arguments", "parameters")}; '
                        f'{UTC.replace("arguments", "parameters")}', True),
    (("llama3", False), '{"result": 1}', False),  # an answer that begins with `{` is a call
    (("llama3", True), "<|python_tag|>", False),  # spelled out
    (("hermes", True), "a <tool_call> b", False),
])  # fmt: skip
def test_what_the_grammars_take(kits, kind, text, ok):
    kit = kits[kind]
    # spelled in plain pieces by the tokenizer without special markers (the same pieces)
    ids = kits["mistral", False].tok.encode(text, False)
    assert all(t not in kit.ids.values() for t in ids)
    assert (kit.grammar.matcher().allowed_prefix(ids) == len(ids)) == ok


@pytest.mark.parametrize(
    "text,json_at", [('  {"name": "get_time", "para', 2), ('Hello {"name": ', None), ("\n", None)]
)
def test_a_llama3_call_begins_the_answer(kits, text, json_at):
    """The closing steering's lexer starts at a leading `{` (one object deep, in a key), and
    not at all when the answer began as text."""
    kit = kits["llama3", False]
    m = kit.grammar.matcher()
    for t in kit.tok.encode(text, False):
        m.consume(t)
    assert m.waiting == (json_at is None)
    if json_at is not None:
        assert m.depth == 1 and m.in_string
