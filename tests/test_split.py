"""The decode step split at the pick (step/split.py): what constrained decoding replays on a GPU.

On the CPU the graphs run eagerly, the very bodies a capture records: a forward of n real tokens
padded to the graph's width gives the step's rows and leaves the cache as the n tokens alone
would; chunks past the width and padding near the cache's end go one token a replay; neither
body touches the host; and requests under a grammar decode the same tokens through the split
graphs as through the step's forward uncaptured (greedy, sampled, speculative, jump-forward).
On a GPU (the `tests` stage) the same requests run captured, with nothing left uncaptured.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import tiny
import torch
from host_traffic import NoHostTraffic

from expresslane.cache import KVCache
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.step import graph as graph_mod
from expresslane.step import split as split_mod
from expresslane.step.fused import FusedDecoder
from expresslane.step.split import STEP_TOKENS, ForwardGraph, PickGraph, SplitSteps, chunk_width

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = [5, 17, 3, 40, 22, 9, 31, 12, 7, 50, 18, 2, 33]


@pytest.fixture(scope="module")
def lane():
    return tiny.laneformer(seed=3)


def tiny_spec(k):
    return SpeculativeConfig(k, prompt_lookup_max=3, prompt_lookup_min=1)


def _engines(lane, max_len=64, **kw):
    """Two engines on the fused step's wiring (its reference kernels here), the prompt in."""
    out = []
    for _ in range(2):
        eng = Engine(lane, max_model_len=max_len, decode="graph", kernels="on", **kw)
        eng.prefill(PROMPT)
        out.append(eng)
    return out


def _one_by_one(eng, ids, position) -> torch.Tensor:
    """The logits (S, V) of `ids` fed one token a forward (width 1)."""
    one = ForwardGraph(eng.step, 1, torch.zeros(eng.cfg.vocab_size), capture=False)
    rows = []
    for j, t in enumerate(ids):
        one.feed([t], position + j)
        rows.append(one.logits.clone())
    return torch.stack(rows)


def _same_cache(a, b) -> None:
    for pa, pb, ka, kb, va, vb in zip(a.pos, b.pos, a.k, b.k, a.v, b.v, strict=True):
        assert torch.equal(pa, pb)
        live = pa >= 0  # padded rows wrote K/V into slots they then emptied: not compared
        assert torch.equal(ka[live], kb[live]) and torch.equal(va[live], vb[live])


@pytest.mark.parametrize("n", [1, 3, 6])
def test_padded_forward_is_its_real_rows(lane, n):
    """Rows 0..n-1 of a width-W forward are the single steps' logits bit for bit, its shared
    logits are the last real row's, and the cache holds only the real rows' positions."""
    a, b = _engines(lane)
    width = chunk_width(a.cache)
    assert width == STEP_TOKENS  # the engine gives rings the headroom of a whole chunk
    ids = [11, 4, 60, 23, 8, 41][:n]
    logits = torch.zeros(a.cfg.vocab_size)
    wide = ForwardGraph(a.step, width, logits, capture=False)
    wide.feed(ids, len(PROMPT))
    want = _one_by_one(b, ids, len(PROMPT))
    assert torch.equal(wide.rows[:n], want)
    assert torch.equal(logits, want[-1])
    _same_cache(a.cache, b.cache)


def test_forward_in_chunks_and_near_the_end(lane):
    """More tokens than the width go in several replays; where the padding would pass the
    cache's end, one token a replay. Same logits and cache as single steps."""
    max_len = 40
    a, b = _engines(lane, max_len=max_len)
    split = SplitSteps(a.step, a.cfg.vocab_size, capture=False)
    assert split.width == 8
    ids = [(7 * j + 3) % 64 for j in range(max_len - len(PROMPT))]  # up to the very last slot
    calls = []
    for w, g in split.forwards.items():
        real = g.feed
        g.feed = lambda i, p, real=real, w=w: (calls.append((w, len(i))), real(i, p))[1]
    got = split.forward(ids, len(PROMPT)).clone()
    want = _one_by_one(b, ids, len(PROMPT))
    assert torch.equal(got, want[-1])
    _same_cache(a.cache, b.cache)
    assert (8, 8) in calls and calls[-1] == (1, 1)  # whole chunks, then single tokens at the end
    assert split.rows(ids[:3], max_len - 2) is None  # padding would pass the end: no rows


def test_pick_graph_is_the_masked_sample():
    """The pick reads the shared logits under the mask: only allowed tokens, the eager
    sampler's draw for the same seed."""
    from expresslane.sampling.sampler import SamplerKnobs, sample

    V = 77
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1))
    allowed = [3, 40, 41, 70]
    mask = torch.zeros(3, dtype=torch.int32)
    for t in allowed:
        mask[t // 32] |= 1 << (t % 32)
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_p=0.9, seed=5)):
        pick = PickGraph(logits, params, 3, capture=False)
        knobs = SamplerKnobs("cpu").with_token_mask(3)
        knobs.load(params)
        knobs.token_mask.copy_(mask)
        gen = None if params.greedy else torch.Generator().manual_seed(5)
        for _ in range(20):
            tok = pick.run(mask)
            assert tok in allowed and tok == int(sample(logits, params, gen, knobs))


@pytest.mark.parametrize("width", [1, 4])
def test_split_bodies_hold_no_host_traffic(monkeypatch, width):
    """The bodies a capture records, on `meta` (tests/host_traffic.py): no sync, no host data."""
    monkeypatch.setattr(graph_mod, "make_generator", lambda params, dev: None)
    monkeypatch.setattr(split_mod, "make_generator", lambda params, dev: None)
    model = tiny.laneformer().to("meta")
    cache = KVCache(model.cfg, 64, device="meta", headroom=width - 1)
    cache.static = True
    step = FusedDecoder(model, cache, kernels=False)
    logits = torch.zeros(model.cfg.vocab_size, device="meta")
    fwd = ForwardGraph(step, width, logits, capture=False)
    fwd.host_pos = 20
    feed = torch.zeros(1, dtype=torch.long, device="meta")  # the chained mode's hand-over
    pick = PickGraph(logits, SamplingParams(temperature=0.7, top_p=0.8), 2, capture=False,
                     feed_to=feed)  # fmt: skip
    with NoHostTraffic():
        fwd._body()
        pick._body()
    rows = None if width == 1 else (width, model.cfg.vocab_size)  # width 1: `logits` alone
    assert (fwd.rows if fwd.rows is None else fwd.rows.shape) == rows
    assert pick.out.device.type == "meta"


# --- requests under a grammar: the embedded model and llguidance ------------------------------
@pytest.fixture(scope="module")
def kit():
    pytest.importorskip("llguidance")
    from expresslane.assets import default_model_dir
    from expresslane.structured.grammar import GrammarCompiler
    from expresslane.tokenizer import Tokenizer

    path = default_model_dir()
    tok = Tokenizer.from_dir(path)
    engine = Engine.from_pretrained(str(path), progress=False, decode="graph")
    return engine, tok, GrammarCompiler(tok, engine.cfg.vocab_size)


GRAMMARS = [
    ("json_schema", {"type": "object", "properties": {"city": {"type": "string"},
     "days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["city", "days"]}),
    ("regex", "The answer is (yes|no), because [a-z ]{3,12}\\."),
    ("json_object", None),
    ("auto", None),  # tool_choice auto's free grammar: checked draws, masked when refused
]  # fmt: skip
SAMPLERS = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=4)]


def _spec_of(kind, body):
    import json

    from expresslane.structured.grammar import GrammarSpec

    if kind == "json_schema":
        return GrammarSpec.json_schema(body)
    if kind == "json_object":
        return GrammarSpec.json_schema({"type": "object"})
    if kind == "auto":
        from expresslane.serve.tools import auto_grammar, plan_tools

        fn = {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        }
        return auto_grammar(plan_tools({"tools": [{"type": "function", "function": fn}]}, ""))
    return GrammarSpec(kind, body if isinstance(body, str) else json.dumps(body))


def _decode(engine, tok, grammar, base: SamplingParams, prompt: str) -> list[int]:
    params = dataclasses.replace(base, grammar=grammar, max_tokens=48)
    return [s.token for s in engine.generate_steps(tok.encode(prompt), params)]


@pytest.mark.parametrize("mode", ["plain", "speculative", "chained"])
def test_requests_through_the_split_graphs_keep_their_tokens(kit, mode):
    """The split graphs (run eagerly here) against the step's forward uncaptured: the same
    tokens, greedy and seeded-sampled, jump-forward chunks and verified drafts included; the
    chained mode (the picked token's forward launched from the pick, forced tokens apart) too."""
    engine, tok, comp = kit
    if mode == "speculative":
        engine = Engine(engine.model, decode="graph", speculative=tiny_spec(4))
    prompt = 'Answer in JSON. {"city": "Paris", "days": 3} The answer is yes, because ' * 2
    split = SplitSteps(engine.step, engine.cfg.vocab_size, capture=False)
    split.chain = mode == "chained"
    picked = []
    real_picked = split.forwards[1].feed_picked
    split.forwards[1].feed_picked = lambda p: (picked.append(p), real_picked(p))[1]
    fed = []
    for g in split.forwards.values():
        real = g.feed
        g.feed = lambda i, p, real=real: (fed.append(len(i)), real(i, p))[1]
    for kind, body in GRAMMARS:
        grammar = comp.compile(_spec_of(kind, body))
        for base in SAMPLERS:
            engine.split_steps = None
            want = _decode(engine, tok, grammar, base, prompt)
            engine.split_steps = split
            try:
                got = _decode(engine, tok, grammar, base, prompt)
            finally:
                engine.split_steps = None
            assert got == want, (kind, base)
    assert max(fed) > 1  # forced tokens (or drafts) went in as one padded forward
    assert bool(picked) == (mode == "chained")


def test_grammar_requests_with_logprobs_use_the_split_forward(kit):
    """Logprobs under a grammar: the split forward (its logits buffer), an eager pick; the same
    tokens and logprobs as the step uncaptured."""
    engine, tok, comp = kit
    split = SplitSteps(engine.step, engine.cfg.vocab_size, capture=False)
    fed = []
    real = split.forwards[1].feed
    split.forwards[1].feed = lambda i, p: (fed.append(len(i)), real(i, p))[1]
    grammar = comp.compile(_spec_of(*GRAMMARS[0]))
    params = SamplingParams(grammar=grammar, max_tokens=24, logprobs=2)
    ids = tok.encode("Answer in JSON: ")
    engine.split_steps, engine.prefix.enabled = None, False  # each prompt prefilled whole
    try:
        want = [(s.token, s.logprob, s.top_logprobs) for s in engine.generate_steps(ids, params)]
        engine.split_steps = split
        got = [(s.token, s.logprob, s.top_logprobs) for s in engine.generate_steps(ids, params)]
    finally:
        engine.split_steps, engine.prefix.enabled = None, True
    assert got == want and fed  # through the split forward, the same figures


# --- on a GPU: captured ---------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_cuda_grammar_requests_replay_captured_graphs(kit):
    """On a GPU the grammar's forward and pick replay graphs captured at load: the tokens of
    the uncaptured split graphs, and no graph left to capture after the requests."""
    from expresslane.assets import default_model_dir

    _, tok, comp = kit
    gpu = Engine.from_pretrained(str(default_model_dir()), device="cuda", progress=False,
                                 max_model_len=512, decode="graph")  # fmt: skip
    assert gpu.split_steps is not None and all(g.graphs for g in gpu.split_steps.forwards.values())
    prompt = 'Answer in JSON. {"city": "Paris", "days": 3} The answer is yes, because '
    for kind, body in GRAMMARS:
        grammar = comp.compile(_spec_of(kind, body))
        for base in SAMPLERS:
            captured = _decode(gpu, tok, grammar, base, prompt)
            split, gpu.split_steps = gpu.split_steps, None
            try:
                plain = _decode(gpu, tok, grammar, base, prompt)
            finally:
                gpu.split_steps = split
            assert captured == plain, (kind, base)
    assert not gpu.captures.pending(), gpu.captures.pending()


# --- the engine's captures, with a fake capture (as tests/test_capture.py) -----------------------
class FakeGraph:
    """Replays what was "captured": the body, eagerly (capture itself needs CUDA)."""

    def __init__(self, run, *args):
        self.run, self.args = run, args

    def replay(self) -> None:
        self.run(*self.args)


def test_engine_captures_the_split_graphs_at_load_and_when_idle(kit, monkeypatch):
    """At load: the forwards at width 1 and 8 for every bucket, a pick for each prepared
    sampler structure; a request then replays only those, with the uncaptured engine's tokens;
    a structure not prepared picks uncaptured once and is captured when the engine is idle."""
    from expresslane.engine import PREPARED
    from expresslane.step.graph import DecodeGraph, all_buckets

    captured = []

    def fake_capture(self, live):
        captured.append((type(self).__name__, self.width, live))
        self.graphs[live] = FakeGraph(self._body, live)

    def fake_pick_capture(self, buckets=None):
        if self.graph is None:
            captured.append(("PickGraph", 0, 0))
            self.graph = FakeGraph(self._body)
        return 0.0

    monkeypatch.setattr(DecodeGraph, "_capture", fake_capture)
    monkeypatch.setattr(PickGraph, "capture_buckets", fake_pick_capture)
    base, tok, comp = kit
    eng = Engine(base.model, max_model_len=600, decode="graph", capture=True)
    plain = Engine(base.model, max_model_len=600, decode="graph")
    buckets = all_buckets(600)
    forwards = {(w, b) for name, w, b in captured if name == "ForwardGraph"}
    assert forwards == {(w, b) for w in (1, STEP_TOKENS) for b in buckets}
    assert len(eng.split_steps.picks) == len(PREPARED)
    prompt = 'Answer in JSON. {"city": "Paris", "days": 3} The answer is yes, because '
    loaded = len(captured)
    for kind, body in GRAMMARS:
        grammar = comp.compile(_spec_of(kind, body))
        for base_params in SAMPLERS:
            got = _decode(eng, tok, grammar, base_params, prompt)
            assert got == _decode(plain, tok, grammar, base_params, prompt), (kind, base_params)
    assert len(captured) == loaded and not eng.captures.pending()  # nothing captured in a request
    top_k = SamplingParams(temperature=0.7, top_k=5, seed=2)
    grammar = comp.compile(_spec_of(*GRAMMARS[0]))
    assert _decode(eng, tok, grammar, top_k, prompt) == _decode(plain, tok, grammar, top_k, prompt)
    assert [type(g).__name__ for g, _ in eng.captures.pending()] == ["PickGraph"]
    eng.idle()
    assert not eng.captures.pending() and captured[-1] == ("PickGraph", 0, 0)


@pytest.mark.parametrize("top_n", [0, 3])
def test_logprob_requests_pick_in_the_split_graphs(lane, top_n):
    """A request with logprobs (no grammar) on the split graphs: the forward's graph, then a
    pick that computes the logprobs in the same replay; the tokens and figures of the eager
    pick, greedy and seeded-sampled."""
    eng = Engine(lane, max_model_len=64, decode="graph", kernels="on")
    split = SplitSteps(eng.step, eng.cfg.vocab_size, capture=False)
    for base in SAMPLERS:
        params = dataclasses.replace(base, max_tokens=12, ignore_eos=True, logprobs=top_n)
        eng.split_steps, eng.prefix.enabled = None, False
        want = [(s.token, s.logprob, s.top_logprobs) for s in eng.generate_steps(PROMPT, params)]
        eng.split_steps = split
        got = [(s.token, s.logprob, s.top_logprobs) for s in eng.generate_steps(PROMPT, params)]
        assert got == want  # the same logprobs_of on the same logits, bit for bit
        assert all((t is None) == (top_n == 0) for _, _, t in got)
    picks = [k for k in split.picks if not k[1]]
    assert picks and all(k[2] == top_n for k in picks)  # unmasked picks, with their top n


@pytest.mark.gpu
@cuda
def test_cuda_logprob_requests_replay_their_pick_once_captured(lane):
    """On a GPU: a logprobs request's pick runs uncaptured until the engine is idle, then
    replays; the tokens and logprobs of the eager pick every time."""
    m = copy.deepcopy(lane).to("cuda")
    eng = Engine(m, max_model_len=128, decode="graph")
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2, temperature=0.8, seed=3)

    def run(split):
        eng.split_steps, eng.prefix.enabled = split, False
        return [(s.token, s.logprob, s.top_logprobs) for s in eng.generate_steps(PROMPT, params)]

    split = eng.split_steps
    want = run(None)
    assert run(split) == want  # the pick uncaptured: a request never waits for a capture
    while eng.idle_interval is not None:
        eng.idle()
    assert not eng.captures.pending()
    assert run(split) == want  # now replayed from its graph
