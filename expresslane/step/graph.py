"""A step on static buffers: `DecodeGraph(step, width)`, captured in a CUDA graph on a GPU, run
eagerly elsewhere. Width 1 is decoding; width k + 1 is the verify step of speculative decoding.

Width 1: one replay runs `steps` whole decode steps (the step's forward and pick, then the
hand-over of the new token into the input buffer, with the position advanced on the device).
Nothing in it touches the host; the host copies the `out` buffer to pinned memory after each
replay and reads it one replay behind (`DecodeStream`), only to stream tokens and to notice a
stop token, so the device runs ahead.

Width k + 1: the inputs are [last token, k drafts] at position p; one replay runs the step's
forward over the k + 1 rows, the acceptance rule (`speculative.drafting.accept`) and empties the
slots of the rejected drafts (`forget`); `out` = [n kept, tokens (k + 1,)], one host copy. The
step is the same object as the decode graph's, so every row has the bits a decode step gives.

The sampler's temperature / top-p / min-p are device buffers (`SamplerKnobs`), so one capture
serves every value of a sampler structure. Capture warms the step up and undoes that warm-up
exactly (cache slots, inputs, RNG).

Captures happen only in `capture_buckets`, which the engine calls at load (every live bucket of the
structures it prepares) or between requests; `run` never captures: a bucket without a graph is
run uncaptured (the same `_body`, eagerly) and noted in `missing`. That keeps a 41-556 ms capture
(measured on the H200, 2026-11-27) out of every request's time.

The KV cache runs in its static mode (positions only on the device; slots masked by `pos`).
Attention reads only the live slots: the host counts positions (`load` sets, `run` advances; no
device read) and bounds the cache to the slots the replay can see. Eagerly that is the exact
count; compiled, the count is one dynamic dimension (one compilation serves every length);
captured, it is rounded up to a power-of-two bucket (from `MIN_BUCKET`) and each bucket gets its
own graph, so a short context never scans max_len slots.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from ..cache import KVCache
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, make_generator
from ..speculative.drafting import accept
from .protocol import Step

MIN_BUCKET = 256  # smallest live-slot bound of a captured graph


def live_bucket(need: int, max_len: int) -> int:
    """The captured bound for `need` live slots: a power of two >= MIN_BUCKET, <= max_len."""
    return min(max_len, max(MIN_BUCKET, 1 << (max(need, 1) - 1).bit_length()))


def all_buckets(max_len: int) -> list[int]:
    """Every bound `live_bucket` can return for a cache of max_len slots."""
    out, b = [], MIN_BUCKET
    while b < max_len:
        out.append(b)
        b *= 2
    return [*out, max_len]


def forget(cache: KVCache, positions: torch.Tensor, keep: torch.Tensor) -> None:
    """Mark the slots written for `positions` (S,) empty where `keep` (S,) is False.

    Device-side and shape-static (no host sync), so a captured verify step runs it too."""
    for pc in cache.pos:
        slots = positions % pc.shape[0]  # rings wrap; full layers: slot == position
        pc.index_copy_(0, slots, torch.where(keep, positions, -1))


class DecodeGraph:
    def __init__(
        self,
        step: Step,
        params: SamplingParams,
        width: int = 1,
        steps: int = 1,
        capture: bool | None = None,
        compile: bool = False,
        generator: torch.Generator | None = None,
    ):
        """`generator`: a verify graph shares the decode graph's (one seed drives a request);
        None makes one for `params`."""
        cache = step.cache
        dev = cache.k[0].device
        if width > 1 and steps != 1:
            raise ValueError(f"a verify graph (width {width}) runs one step per replay")
        self.step, self.cache, self.params = step, cache, params
        self.width, self.steps = width, steps
        self.token = torch.zeros((width,), dtype=torch.long, device=dev)
        self.pos = torch.zeros((1,), dtype=torch.long, device=dev)
        self.out = torch.zeros((steps if width == 1 else width + 1,), dtype=torch.long, device=dev)
        self.offsets = torch.arange(width, device=dev)
        self.shared = width > 1
        self.generator = generator if self.shared else make_generator(params, dev)
        self.knobs = SamplerKnobs(dev)  # temperature / top-p / min-p, read at replay time
        self.knobs.load(params)
        self.capture = (dev.type == "cuda") if capture is None else capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # one per live bucket
        self.missing: set[int] = set()  # buckets a replay ran uncaptured (for the engine)
        self.capture_s = 0.0  # seconds spent capturing
        self.rows: torch.Tensor | None = None  # a verify's logits (k + 1, V), run uncaptured
        self.host_pos = 0  # the position the next replay starts at, counted on the host
        # (live,) arange whose length carries the live bound into the step: a dynamic dimension
        # when compiled, so the length never recompiles
        self._span = torch.arange(cache.max_len, device=dev)
        # torch.compile of the static step: on a CPU it fuses the step's many small ops into a
        # few C++ kernels (the per-op overhead is what bounds small models there).
        self.compiled = compile
        self._fn = torch.compile(self._steps, dynamic=False) if compile else self._steps
        self._marked = False

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured graph of the current bucket (None before its capture)."""
        return self.graphs.get(self.live())

    def live(self) -> int:
        """The slot bound of the next replay: every position it writes (at least 2, as a
        dimension of size 0 or 1 would be specialised), bucketed when captured."""
        need = max(2, self.host_pos + self.steps * self.width)
        if self.capture:
            return live_bucket(need, self.cache.max_len)
        return min(need, self.cache.max_len)

    @torch.inference_mode()
    def _body(self, live: int | None = None) -> None:
        span = self._span[: self.live() if live is None else live]
        if self.compiled and not self._marked:  # the first call compiles: length dynamic
            torch._dynamo.mark_dynamic(span, 0)
            self._marked = True
        self._fn(span)

    def _steps(self, span: torch.Tensor) -> None:
        self.cache.live = span.shape[0]
        try:
            self._step_loop()
        finally:
            self.cache.live = None

    def _step_loop(self) -> None:
        if self.width > 1:
            self._verify()
            return
        for j in range(self.steps):
            tok = self.step.next_token(
                self.token, self.pos, self.params, self.generator, self.knobs
            )
            self.out[j] = tok
            self.token.copy_(tok.view(1))
            self.pos.add_(1)

    def _verify(self) -> None:
        positions = self.pos + self.offsets  # (k + 1,)
        logits = self.step.forward(self.token, self.pos)  # (k + 1, V)
        kept, tokens = accept(logits, self.token[1:], self.params, self.generator, self.knobs)
        self.out[0] = kept
        self.out[1:] = tokens
        forget(self.cache, positions, self.offsets <= kept)
        self.rows = logits

    def set_params(self, params: SamplingParams) -> None:
        """A request's sampler values and seed (same structure_key as the captured params); a
        verify graph's seed belongs to the decode graph whose generator it shares."""
        self.knobs.load(params)
        if self.generator is not None and not self.shared:
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def load(self, token: torch.Tensor, position: int) -> None:
        """Set the step's input: the last sampled token (a device tensor) at `position`."""
        self.token.copy_(token.view(self.width))
        self.pos.fill_(position)
        self.host_pos = position

    def load_drafts(self, token: int, drafts: list[int], position: int) -> None:
        """A verify's inputs: drafts shorter than k are padded (a pad token that the model
        happens to agree with is a correct token like any other)."""
        pad = [drafts[-1]] * (self.width - 1 - len(drafts))
        ids = torch.tensor([token, *drafts, *pad])
        self.load(ids.to(self.token.device, non_blocking=True), position)

    def _snapshot(self) -> dict:
        """Everything a replay changes: inputs, outputs, RNG, and the cache slots it writes."""
        first = int(self.pos.item())
        positions = torch.arange(first, first + self.steps * self.width, device=self.pos.device)
        kv = []
        for i, k in enumerate(self.cache.k):
            slots = positions % k.shape[0]  # ring layers wrap
            kv.append((slots, k[slots], self.cache.v[i][slots], self.cache.pos[i][slots]))
        return {
            "token": self.token.clone(),
            "pos": self.pos.clone(),
            "out": self.out.clone(),
            "rng": None if self.generator is None else self.generator.get_state(),
            "kv": kv,  # per layer: (slots, keys, values, positions); indexing copies
        }

    def _restore(self, snap: dict) -> None:
        self.token.copy_(snap["token"])
        self.pos.copy_(snap["pos"])
        self.out.copy_(snap["out"])
        if snap["rng"] is not None:
            self.generator.set_state(snap["rng"])
        for i, (slots, k, v, p) in enumerate(snap["kv"]):
            self.cache.k[i].index_copy_(0, slots, k)
            self.cache.v[i].index_copy_(0, slots, v)
            self.cache.pos[i].index_copy_(0, slots, p)

    def warm_up(self, runs: int = 2, live: int | None = None) -> None:
        """Run the step `runs` times for its lazy work (kernel builds, compilation, cuBLAS
        handles), then undo it: the next step sees the cache, inputs and RNG as they were. A
        ring slot written ahead would otherwise destroy a key still inside the window."""
        snap = self._snapshot()
        was_static, self.cache.static = self.cache.static, True
        try:
            for _ in range(runs):
                self._body(live)
                self._restore(snap)
        finally:
            self.cache.static = was_static

    def _capture(self, live: int) -> None:
        """Capture the step for the live bound `live` (a bucket)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy inits happen outside the graph
            self.warm_up(live=live)
        torch.cuda.current_stream().wait_stream(side)
        snap = self._snapshot()
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        was_static, self.cache.static = self.cache.static, True
        try:
            with torch.cuda.graph(graph):
                self._body(live)
        finally:
            self.cache.static = was_static
        self._restore(snap)  # capture records the work; nothing may look advanced
        self.graphs[live] = graph

    def pending(self) -> list[int]:
        """The buckets still to capture once a replay ran uncaptured (`missing`): all of them,
        as the request that ran one will likely reach the next."""
        if not (self.capture and self.missing):
            return []
        return [b for b in all_buckets(self.cache.max_len) if b not in self.graphs]

    def capture_buckets(self, buckets: list[int] | None = None) -> float:
        """Capture the graphs of `buckets` (default: every bucket of the cache) that are not
        captured yet; off the request path (at load, between requests). Returns the seconds."""
        if not self.capture:
            return 0.0
        t = time.perf_counter()
        for live in all_buckets(self.cache.max_len) if buckets is None else buckets:
            if live not in self.graphs:
                self._capture(live)
        spent = time.perf_counter() - t
        self.capture_s += spent
        return spent

    def run(self) -> torch.Tensor:
        """Advance one replay; returns the device buffer of its output. Never captures: a
        bucket without its graph runs uncaptured (noted in `missing`)."""
        was_static, self.cache.static = self.cache.static, True
        try:
            graph = self.graph if self.capture else None
            if graph is None:
                if self.capture:
                    self.missing.add(self.live())
                self._body()
            else:
                graph.replay()
        finally:
            self.cache.static = was_static
        self.host_pos += self.steps
        return self.out


class DecodeStream:
    """Replays a DecodeGraph and yields its tokens one replay behind, through pinned memory."""

    def __init__(self, graph: DecodeGraph):
        self.graph = graph
        cuda = graph.out.device.type == "cuda"
        self.host = [torch.empty(graph.steps, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def tokens(self, max_tokens: int) -> Iterator[int]:
        """Up to max_tokens ids; the caller stops iterating at a stop token."""
        replays = -(-max_tokens // self.graph.steps)
        produced = 0
        for i in range(replays + 1):
            if i < replays:
                out = self.graph.run()
                slot = i % 2
                self.host[slot].copy_(out, non_blocking=True)
                if self.events[slot] is not None:
                    self.events[slot].record()
            if i == 0:
                continue
            prev = (i - 1) % 2
            if self.events[prev] is not None:
                self.events[prev].synchronize()
            for t in self.host[prev].tolist():
                if produced == max_tokens:
                    return
                produced += 1
                yield t


def committed_tokens(graph: DecodeGraph, cache: KVCache, token: int, n: int) -> Iterator[int]:
    """`n` tokens of a DecodeStream after `token` (loaded into the graph by the caller); each
    input is committed to the cache's `tokens` once the step it fed has produced the next."""
    for t in DecodeStream(graph).tokens(n):
        cache.commit([token])
        yield t
        token = t
