"""Constrained decoding in the engine (grammar.py, structured.py) with the embedded model.

The mask in the pick against llguidance's own and a naive loop; the 65-schema suite decoded
greedy and sampled, every token accepted by a fresh matcher and every finished output valid
under `jsonschema`; jump-forward saving forwards; speculative decoding and prefix reuse with a
grammar giving the plain path's tokens; compile errors and dead ends as GrammarErrors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from expresslane.assets import default_model_dir
from expresslane.bench.schemas import SCHEMAS
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.sampling.sampler import apply_token_mask
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.structured import decoding as structured
from expresslane.structured.closed import closed_objects
from expresslane.structured.grammar import GrammarCompiler, GrammarError, GrammarSpec
from expresslane.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "def parse(text):\n    "


@pytest.fixture(scope="module")
def kit():
    path = default_model_dir()
    tok = Tokenizer.from_dir(path)
    engine = Engine.from_pretrained(str(path), progress=False, decode="graph")
    return engine, tok, GrammarCompiler(tok, engine.cfg.vocab_size)


def test_token_mask_matches_a_loop_and_llguidance(kit):
    g = torch.Generator().manual_seed(0)
    V, W = 77, -(-77 // 32)  # V not a multiple of 32: the last word is partly used
    logits = torch.randn(3, V, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (3, W), generator=g, dtype=torch.int64).int()
    ours = apply_token_mask(logits, words)
    for r in range(3):
        for t in range(V):
            bit = (int(words[r, t // 32]) >> (t % 32)) & 1
            assert (ours[r, t] == float("-inf")) == (bit == 0)
            assert bit == 0 or ours[r, t] == logits[r, t]
    # a real mask against llguidance's own byte-per-token form of it
    engine, _, comp = kit
    m = comp.compile(GrammarSpec.json_schema(SCHEMAS["weather"])).matcher()
    words = m.fill().clone()
    bias = torch.frombuffer(bytearray(m.m.compute_logit_bias()), dtype=torch.uint8)
    V = engine.cfg.vocab_size
    masked = apply_token_mask(torch.zeros(1, V), words)[0]
    assert torch.equal(masked == 0, bias[:V] > 0)


def _decode(engine, tok, grammar, prompt=PROMPT, **kw):
    params = SamplingParams(grammar=grammar, **{"max_tokens": 64, **kw})
    steps = list(engine.generate_steps(tok.encode(prompt), params))
    ids = [s.token for s in steps]
    return ids, steps[-1].finish_reason


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_schema_suite_outputs_validate(kit, temperature):
    """Every schema of the suite, greedy and sampled, from the embedded model (which was never
    taught JSON) within 128 tokens: every output finishes and validates. The last tokens of the
    budget steer the JSON to close (structured/grammar.py Closing)."""
    engine, tok, comp = kit
    unfinished = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        grammar = comp.compile(GrammarSpec.json_schema(schema))
        ids, finish = _decode(engine, tok, grammar, temperature=temperature, seed=i,
                              max_tokens=128)  # fmt: skip
        m = grammar.matcher()
        for t in ids[:-1] if finish == "stop" else ids:
            m.consume(t)  # every token was allowed (raises otherwise)
        if finish != "stop":
            unfinished.append(name)
            continue
        text = tok.decode(ids, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), closed_objects(schema))  # no unlisted keys
        assert m.done or m.m.is_accepting(), name
    assert not unfinished, f"ran out of tokens: {unfinished}"


def test_json_closes_inside_a_short_budget(kit):
    """A recursion (each level opens another object) and an endless number, with budgets far
    shorter than the model would take: the JSON still closes, valid, by the last token."""
    engine, tok, comp = kit
    for name, budget in (("linked_list", 40), ("number", 6), ("point", 16)):
        grammar = comp.compile(GrammarSpec.json_schema(SCHEMAS[name]))
        ids, finish = _decode(engine, tok, grammar, max_tokens=budget)
        assert finish == "stop" and len(ids) <= budget, (name, finish, len(ids))
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), SCHEMAS[name])


def test_the_closing_lexer_follows_json_text(kit):
    """Closing.advance: strings (escaped quotes inside), depth, the number being written, the
    run of one kind inside a string; the closing classes hold what they say."""
    _, tok, comp = kit
    closing = comp.closing()
    state = (False, False, 0, 0, "", 0)
    for t in tok.encode('{"a":"x\\"y}","b":[1,{"c":12', add_special_tokens=False):
        state = closing.advance(state, t)
    assert state[:4] == (False, False, 3, 2)
    for t in tok.encode(',"d":"00000000', add_special_tokens=False):
        state = closing.advance(state, t)
    assert state[0] and state[4] == "0" and state[5] == 8

    def members(words):
        return [i for i in range(len(closing.texts)) if (int(words[0, i // 32]) >> i % 32) & 1]

    assert all(set(closing.texts[i].strip()) <= set("}]") for i in members(closing.end)
               if i not in tok.eos_ids)  # fmt: skip
    assert all(closing.texts[i].strip()[0] == '"' for i in members(closing.string))
    assert "}" in [closing.texts[i] for i in members(closing.end)]


def test_jump_forward_appends_forced_tokens_without_sampling(kit, monkeypatch):
    engine, tok, comp = kit
    calls = []
    real = structured._forward
    monkeypatch.setattr(structured, "_forward", lambda e, split, ids, pos: (calls.append(ids),
                        real(e, split, ids, pos))[1])  # fmt: skip
    grammar = comp.compile(GrammarSpec("regex", "The answer is (yes|no), because [a-z]{3}\\."))
    ids, finish = _decode(engine, tok, grammar)
    text = tok.decode(ids, skip_special_tokens=True)
    assert finish == "stop" and text.startswith("The answer is ") and text.endswith(".")
    assert any(len(c) > 1 for c in calls)  # a forced run went in as one chunk
    assert len(calls) < len(ids) - 1  # fewer forwards than tokens


def test_speculative_and_prefix_reuse_keep_the_tokens(kit):
    engine, tok, comp = kit
    prompt = "def f(x):\n    return x + 1\n\n" * 3
    grammar = comp.compile(GrammarSpec("regex", "[a-z_ ():+1\\n]{1,60}"))
    plain, _ = _decode(engine, tok, grammar, prompt=prompt)
    again, _ = _decode(engine, tok, grammar, prompt=prompt)
    assert again == plain and engine.stats.cached_tokens > 0  # the prompt came from the cache
    spec = Engine(
        engine.model, speculative=SpeculativeConfig(4, prompt_lookup_max=4, prompt_lookup_min=2)
    )
    drafted, _ = _decode(spec, tok, grammar, prompt=prompt)
    assert drafted == plain
    figures = spec.stats.extra["speculative"]
    assert figures["draft_tokens"] > 0 and figures["accepted_tokens"] > 0, figures
    # a predicted output (prediction.py): its drafts cut to the grammar's prefix, then verified
    edited = [*plain[:5], *plain[7:]]
    for engine_ in (engine, spec):
        predicted, _ = _decode(engine_, tok, grammar, prompt=prompt, prediction=tuple(edited))
        assert predicted == plain
        figures = engine_.stats.extra["speculative"]
        assert figures["accepted_prediction_tokens"] > 0, figures


def test_penalties_under_a_grammar_are_a_reference_loops(kit):
    """Penalties and logit_bias before the grammar's mask: greedy tokens equal a loop over the
    model's forward with the documented formulas (test_penalties.reference) and a fresh
    matcher's masks; so do a speculating engine's and a predicted output's (rows adjusted and
    masked one by one); forced tokens count as output."""
    from test_penalties import reference

    engine, tok, comp = kit
    text = "def f(x):\n    return x + 1\n\n" * 3
    prompt = tok.encode(text)
    grammar = comp.compile(GrammarSpec("regex", "[a-z_ ():+1\\n]{1,40}"))
    kw = dict(max_tokens=40, presence_penalty=1.2, frequency_penalty=0.4,
              repetition_penalty=1.3, logit_bias=((tok.encode("x", False)[0], -3.0),))  # fmt: skip
    params = SamplingParams(**kw)
    m, seq, want = grammar.matcher(), list(prompt), []
    eos = set(engine.cfg.eos_token_ids)
    with torch.no_grad():
        for _ in range(40):
            if m.done:
                want.append(next(iter(eos)))
                break
            logits = engine.model(torch.tensor([seq]))[0, -1]
            adj = torch.tensor(reference(logits.tolist(), prompt, want, params, eos))
            t = int(apply_token_mask(adj[None], m.fill())[0].argmax())
            m.consume(t)
            seq.append(t)
            want.append(t)
            if t in eos:
                break
    plain, _ = _decode(engine, tok, grammar, prompt=text, max_tokens=40)
    assert want != plain  # the adjustments change this text
    got, _ = _decode(engine, tok, grammar, prompt=text, **kw)
    assert got == want
    spec = Engine(engine.model, speculative=SpeculativeConfig(4, prompt_lookup_max=4,
                                                              prompt_lookup_min=2))  # fmt: skip
    assert _decode(spec, tok, grammar, prompt=text, **kw)[0] == want
    predicted, _ = _decode(engine, tok, grammar, prompt=text, prediction=tuple(plain), **kw)
    assert predicted == want and engine.stats.extra["speculative"]["verify_steps"] > 0


def test_logprobs_under_a_grammar(kit):
    engine, tok, comp = kit
    grammar = comp.compile(GrammarSpec("choice", json.dumps(["alpha", "beta"])))
    params = SamplingParams(max_tokens=8, logprobs=2, grammar=grammar)
    steps = list(engine.generate_steps(tok.encode(PROMPT), params))
    assert tok.decode([s.token for s in steps], skip_special_tokens=True) in ("alpha", "beta")
    assert all(s.logprob is not None and s.logprob <= 0 for s in steps)


def test_compile_cache_and_errors(kit):
    _, _, comp = kit
    spec = GrammarSpec.json_schema({"type": "integer"})
    assert comp.compile(spec) is comp.compile(GrammarSpec.json_schema({"type": "integer"}))
    with pytest.raises(GrammarError, match="not"):
        comp.compile(GrammarSpec.json_schema({"type": "object", "not": {}}))
    with pytest.raises(GrammarError, match="regex"):
        comp.compile(GrammarSpec("regex", "a(", "structured_outputs.regex"))
    m = comp.compile(GrammarSpec("regex", "ab")).matcher()
    with pytest.raises(GrammarError, match="not allowed"):
        m.consume(comp.tokenizer.encode("zz", add_special_tokens=False)[0])


def test_a_complete_grammar_cannot_be_extended(kit):
    """ignore_eos past a complete grammar: no token is allowed, the request ends in an error."""
    engine, tok, comp = kit
    grammar = comp.compile(GrammarSpec("regex", "ok"))
    with pytest.raises(GrammarError, match="complete"):
        _decode(engine, tok, grammar, ignore_eos=True)


def test_cli_json_schema(tmp_path, capsys):
    from expresslane.__main__ import main

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 9}, "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(schema))
    code = main(["run", "--json-schema", str(tmp_path / "s.json"), "--max-tokens", "40", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    jsonschema.validate(json.loads(out["text"]), schema)
    (tmp_path / "bad.json").write_text('{"type": "object", "not": {}}')
    assert main(["run", "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "Unimplemented keys" in capsys.readouterr().err


SIDE_COMPILE = """
import os, threading, torch
from expresslane.assets import default_model_dir
from expresslane.structured.grammar import GrammarCompiler, GrammarSpec
from expresslane.tokenizer import Tokenizer

def foreign():  # OS threads that are no Python thread: OpenMP's workers among them
    known = {t.native_id for t in threading.enumerate()}
    return sum(int(tid) not in known for tid in os.listdir("/proc/self/task"))

comp, out = GrammarCompiler(Tokenizer.from_dir(default_model_dir()), 1 << 17), {}

def side():
    torch.set_num_threads(2)  # the count the engine's thread leaves process-wide
    before = foreign()
    comp.compile(GrammarSpec.json_schema({"type": "object"})).matcher().fill(closing=True)
    out["grown"] = foreign() - before

t = threading.Thread(target=side)
t.start()
t.join()
print(out["grown"])
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_a_compile_beside_the_engine_starts_no_openmp_team():
    """A server compiles grammars on its preparation threads. A parallel torch op there (the
    closing classes were vocabulary-sized tensors) gives that thread an OpenMP team for its
    life, and the engine's decode then ran 3x slower (step/threads.py). A vocabulary past
    torch's grain size, compiled on a side thread of a fresh process (no other work to start
    threads meanwhile): no new thread."""
    out = subprocess.run([sys.executable, "-c", SIDE_COMPILE], capture_output=True, text=True,
                         timeout=120, check=True)  # fmt: skip
    assert int(out.stdout.strip().splitlines()[-1]) == 0
