"""Captures: an engine's CUDA graphs, made at load or while it is idle, never inside a request.

One decode graph per sampler structure (values and seed are loaded per request), the verify
graphs of speculation (speculative/decoder.py) and constrained decoding's split graphs
(step/split.py). `capture` takes every live context bucket of a list of sampler structures:
the engine calls it at load with the structures chat UIs send. A request with another structure
runs its buckets uncaptured; `capture_pending` takes them one at a time while the engine is
idle, so a request arriving meanwhile waits for one capture at most. On the H200 a first-use
capture cost 0.1-1.1 s inside requests before this (issue 24). The engine owns one; capture is
applied to the step from outside, as compiling and placement are.
"""

from __future__ import annotations

import time

from ..sampling.params import SamplingParams
from ..sampling.sampler import structure_key
from .graph import DecodeGraph


class Captures:
    def __init__(self, step, steps_per_replay: int, capture: bool, compile: bool,
                 compile_graph: bool, speculator=None, split_steps=None,
                 predictor=None):  # fmt: skip
        """`compile`: compile each graph's step when it is made (the time goes to `compile_s`);
        `compile_graph`: what DecodeGraph compiles (step/choose.py). `speculator`: its verify
        graphs are captured with the decode graph of the same structure. `split_steps`:
        constrained decoding's graphs, or None. `predictor`: the verifier of predicted outputs
        when it is not the speculator; its graphs are captured only while idle."""
        self.step, self.steps_per_replay = step, steps_per_replay
        self.capture_on, self.compile, self.compile_graph = capture, compile, compile_graph
        self.speculator, self.split_steps = speculator, split_steps
        self.verifiers = tuple({id(v): v for v in (speculator, predictor) if v}.values())
        self.graphs: dict[tuple, DecodeGraph] = {}
        self.compile_s = 0.0  # seconds spent compiling decode steps: at load, not in requests
        self.capture_s = 0.0  # seconds spent capturing graphs: at load or between requests

    def graph_for(self, params: SamplingParams) -> DecodeGraph:
        """The graph of this sampler structure, with `params` loaded. Making one captures
        nothing; with `compile` it compiles now, before a request's clock starts."""
        key = structure_key(params)
        if key not in self.graphs:
            t = time.perf_counter()
            self.graphs[key] = DecodeGraph(
                self.step, params, steps=self.steps_per_replay, capture=self.capture_on,
                compile=self.compile_graph,
            )  # fmt: skip
            if self.compile:
                self.graphs[key].warm_up(runs=1)
                self.compile_s += time.perf_counter() - t
        graph = self.graphs[key]
        graph.set_params(params)
        return graph

    def capture(self, structures) -> float:
        """Capture every live bucket of the decode (and verify, and split) graphs of these
        sampler structures. Returns the seconds spent (also added to `capture_s`)."""
        spent = 0.0
        for params in structures:
            graph = self.graph_for(params)
            spent += graph.capture_buckets()
            if self.speculator is not None:
                vg = self.speculator.verify_graph(params, graph.generator, capture=True)
                spent += vg.capture_buckets()
        if self.split_steps is not None:
            spent += self.split_steps.capture_all(structures)
        self.capture_s += spent
        return spent

    def pending(self) -> list[tuple[DecodeGraph, int]]:
        """(graph, bucket) pairs that requests ran uncaptured."""
        spec = [g for v in self.verifiers for g in v.graphs.values()]
        split = self.split_steps.graphs() if self.split_steps is not None else ()
        return [(g, b) for g in (*self.graphs.values(), *spec, *split) for b in g.pending()]

    def capture_pending(self, limit: int | None = 1) -> float:
        """Capture up to `limit` pending buckets (a structure not prepared at load: all its
        buckets follow). Returns the seconds spent (also added to `capture_s`)."""
        spent = sum(g.capture_buckets([b]) for g, b in self.pending()[:limit])
        self.capture_s += spent
        return spent
