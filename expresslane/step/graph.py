"""The decode step on static buffers: captured in a CUDA graph on a GPU, run eagerly elsewhere.

One replay runs `steps` whole decode steps: embedding, every layer, final norm, LM head,
sampling, and the hand-over of the new token into the input buffer, with the position advanced
on the device. Nothing in it touches the host; the host copies the `out` buffer to pinned memory
after each replay and reads it one replay behind (`DecodeStream`), only to stream tokens and to
notice a stop token, so the device runs ahead.

The sampler's temperature / top-p / min-p are device buffers (`SamplerKnobs`), so one capture
serves every value of a sampler structure. Capture first warms the step up and undoes that
warm-up exactly (cache slots, inputs, RNG), so capturing mid-request changes nothing.

The same `_body` runs eagerly on a CPU (or when capture is off); that is the path CI checks
against the model's forward. The KV cache runs in its static mode (positions only on the
device; slots masked by `pos`). Attention reads only the live slots: the host counts positions
(`load` sets, `run` advances; no device read) and bounds the cache to the slots the replay can
see. Eagerly that is the exact count; compiled, the count is one dynamic dimension (one
compilation serves every length); captured, it is rounded up to a power-of-two bucket (from
`MIN_BUCKET`) and each bucket gets its own graph, so a short context never scans max_len slots.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..cache import KVCache
from ..config import SamplingParams
from ..model import Laneformer
from ..sampler import SamplerKnobs, make_generator, sample
from .fused import FusedDecoder

MIN_BUCKET = 256  # smallest live-slot bound of a captured graph


def live_bucket(need: int, max_len: int) -> int:
    """The captured bound for `need` live slots: a power of two >= MIN_BUCKET, <= max_len."""
    return min(max_len, max(MIN_BUCKET, 1 << (max(need, 1) - 1).bit_length()))


class DecodeGraph:
    def __init__(
        self,
        model: Laneformer,
        cache: KVCache,
        params: SamplingParams,
        steps: int = 1,
        capture: bool | None = None,
        decoder: FusedDecoder | None = None,
        compile: bool = False,
    ):
        dev = cache.k[0].device
        self.model, self.cache, self.params, self.steps = model, cache, params, steps
        self.decoder = decoder  # the fused-kernel step, or None for the model's own forward
        self.token = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((1,), dtype=torch.long, device=dev)
        self.out = torch.zeros((steps,), dtype=torch.long, device=dev)
        self.generator = make_generator(params, dev)
        self.knobs = SamplerKnobs(dev)  # temperature / top-p / min-p, read at replay time
        self.knobs.load(params)
        self.capture = (dev.type == "cuda") if capture is None else capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # one per live bucket
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
        need = max(2, self.host_pos + self.steps)
        if self.capture:
            return live_bucket(need, self.cache.max_len)
        return min(need, self.cache.max_len)

    @torch.inference_mode()
    def _body(self) -> None:
        span = self._span[: self.live()]
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
        for j in range(self.steps):
            if self.decoder is not None:
                tok = self.decoder.next_token(
                    self.token, self.pos, self.params, self.generator, self.knobs
                )
            else:
                logits = self.model(self.token, positions=self.pos, cache=self.cache)[0, -1]
                tok = sample(logits, self.params, self.generator, self.knobs)
            self.out[j] = tok
            self.token.copy_(tok.view(1, 1))
            self.pos.add_(1)

    def set_params(self, params: SamplingParams) -> None:
        """A request's sampler values and seed (same structure_key as the captured params)."""
        self.knobs.load(params)
        if self.generator is not None:
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def load(self, token: torch.Tensor, position: int) -> None:
        """Set the step's input: the last sampled token (a device tensor) at `position`."""
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(position)
        self.host_pos = position

    def _snapshot(self) -> dict:
        """Everything a replay changes: inputs, outputs, RNG, and the cache slots it writes."""
        first = int(self.pos.item())
        positions = torch.arange(first, first + self.steps, device=self.pos.device)
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

    def warm_up(self, runs: int = 2) -> None:
        """Run the step `runs` times for its lazy work (kernel builds, compilation, cuBLAS
        handles), then undo it: the next step sees the cache, inputs and RNG as they were. A
        ring slot written ahead would otherwise destroy a key still inside the window."""
        snap = self._snapshot()
        was_static, self.cache.static = self.cache.static, True
        try:
            for _ in range(runs):
                self._body()
                self._restore(snap)
        finally:
            self.cache.static = was_static

    def _capture(self) -> None:
        """Capture the step for the current live bucket."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy inits happen outside the graph
            self.warm_up()
        torch.cuda.current_stream().wait_stream(side)
        snap = self._snapshot()
        graph = self.graphs[self.live()] = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            self._body()
        self._restore(snap)  # capture records the work; nothing may look advanced

    def run(self) -> torch.Tensor:
        """Advance `steps` tokens; returns the device buffer of their ids."""
        was_static, self.cache.static = self.cache.static, True
        try:
            if not self.capture:
                self._body()
            else:
                if self.graph is None:
                    self._capture()
                self.graph.replay()
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
