"""No capture inside a request: every graph a request can need is captured at load, and what a
request finds uncaptured runs uncaptured and is captured while the engine is idle.

Capture itself needs CUDA, so here `DecodeGraph._capture` is replaced by a fake that counts its
calls and "records" the step: its replay runs the same `_body` at the bucket's bound, as a real
graph replays what was captured. Everything around it (the engine's captures at load, the
buckets, `run` never capturing, the verify graphs, the idle captures, the reports) is the code
that runs on a GPU. The tokens must equal an engine with no capture at all.
"""

from __future__ import annotations

import pytest
import tiny

from expresslane.engine import PREPARED, Engine
from expresslane.sampling.params import SamplingParams
from expresslane.sampling.sampler import structure_key
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.step.graph import DecodeGraph, all_buckets
from expresslane.step.split import ForwardGraph, PickGraph

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work

MAX_LEN = 600  # buckets 256, 512, 600
LONG = [3 + (i * 7) % 50 for i in range(240)]  # its generation crosses the 256 bucket


class FakeGraph:
    def __init__(self, graph, live: int | None):
        self.graph, self.live = graph, live

    def replay(self) -> None:
        if self.live is None:  # a pick graph: no buckets
            self.graph._body()
        else:
            self.graph._body(self.live)


class Captures(list):
    """(width, bucket) of every decode and verify graph's capture, in order; `split`: those
    of a grammar's graphs (step/split.py: ("forward", width, bucket), ("pick", structure))."""

    split: list[tuple]


@pytest.fixture
def captures(monkeypatch) -> Captures:
    calls = Captures()
    calls.split = []

    def fake_capture(self: DecodeGraph, live: int) -> None:
        if isinstance(self, ForwardGraph):
            calls.split.append(("forward", self.width, live))
        else:
            calls.append((self.width, live))
        self.graphs[live] = FakeGraph(self, live)

    def fake_pick_capture(self: PickGraph, buckets=None) -> float:
        if self.graph is None:
            calls.split.append(("pick", structure_key(self.params)))
            self.graph = FakeGraph(self, None)
        return 0.0

    monkeypatch.setattr(DecodeGraph, "_capture", fake_capture)
    monkeypatch.setattr(PickGraph, "capture_buckets", fake_pick_capture)
    return calls


@pytest.fixture(scope="module")
def model():
    return tiny.laneformer(seed=4, max_position_embeddings=1024)


def spec() -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


REQUESTS = [
    (LONG, SamplingParams(max_tokens=40, ignore_eos=True)),  # greedy, across a bucket
    ([5, 9, 5, 9, 5, 9, 5], SamplingParams(max_tokens=30, ignore_eos=True)),
    ([1, 2, 3], SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)),
    ([1, 2, 3], SamplingParams(max_tokens=20, temperature=0.7, top_p=0.8, seed=5, ignore_eos=True)),
]


def test_every_graph_is_captured_at_load_and_no_request_captures(model, captures):
    for speculative in (None, spec()):
        plain = Engine(model, max_model_len=MAX_LEN, decode="graph", capture=False,
                       speculative=speculative)  # fmt: skip
        captures.clear()
        eng = Engine(model, max_model_len=MAX_LEN, decode="graph", capture=True,
                     speculative=speculative)  # fmt: skip
        buckets = all_buckets(MAX_LEN)
        assert buckets == [256, 512, 600]
        widths = [1] if speculative is None else [1, 4]
        want = sorted((w, b) for _ in PREPARED for w in widths for b in buckets)
        assert sorted(captures) == want  # every structure, bucket and verify graph at load
        forwards = {(c[1], c[2]) for c in captures.split if c[0] == "forward"}
        assert forwards == {(w, b) for w in (1, 8) for b in buckets}  # a grammar's graphs too
        picks = {c[1] for c in captures.split if c[0] == "pick"}
        assert picks == {structure_key(p) for p in PREPARED}
        assert eng.capture_s > 0
        at_load = len(captures)
        verified = 0
        for prompt, params in REQUESTS:
            got = list(eng.generate(prompt, params))
            verified += eng.stats.extra.get("speculative", {}).get("verify_steps", 0)
            assert got == list(plain.generate(prompt, params)), (prompt, params)
            assert len(captures) == at_load, "a request captured a graph"
        graphs = list(eng.captures.graphs.values())
        if speculative is not None:
            assert verified > 0  # the verify graphs were replayed
            graphs += list(eng.speculator.graphs.values())
        assert not any(g.missing for g in graphs)  # every replay found its graph
        assert eng.idle_interval is None  # nothing left to capture


def test_an_unprepared_sampler_runs_uncaptured_then_is_captured_while_idle(model, captures):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=5, seed=2, ignore_eos=True)
    ref = Engine(model, max_model_len=MAX_LEN, decode="graph", capture=False, speculative=spec())
    want = list(ref.generate(LONG, params))
    eng = Engine(model, max_model_len=MAX_LEN, decode="graph", capture=True,
                 speculative=spec())  # fmt: skip
    at_load = len(captures)
    assert list(eng.generate(LONG, params)) == want
    assert len(captures) == at_load  # served uncaptured, not captured in the request
    assert eng.idle_interval is not None  # the server's engine thread will call idle()
    while eng.idle_interval is not None:
        before = len(captures)
        eng.idle()
        assert len(captures) == before + 1  # one capture per idle call: a request waits less
    assert len(captures) == at_load + 2 * len(all_buckets(MAX_LEN))  # decode and verify
    assert list(eng.generate(LONG, params)) == want  # now replayed, the same tokens
    assert len(captures) == at_load + 2 * len(all_buckets(MAX_LEN))  # decode and verify


def test_run_json_reports_capture_time_apart(model, captures):
    from expresslane.cli.run import load_report

    eng = Engine(model, max_model_len=MAX_LEN, decode="graph", capture=True)
    report = load_report(eng)
    assert report == {"capture_s": round(eng.capture_s, 2)} and eng.capture_s > 0
    assert load_report(Engine(model, max_model_len=MAX_LEN, capture=False)) is None


def test_an_engine_without_grammar_graphs_captures_none(model, captures):
    """Benches that send no grammar keep the split graphs out of their load time."""
    eng = Engine(model, max_model_len=MAX_LEN, decode="graph", capture=True,
                 grammar_graphs=False)  # fmt: skip
    assert eng.split_steps is None and captures.split == [] and captures
