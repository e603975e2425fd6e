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
device; every slot masked by `pos`), so no shape depends on the step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .cache import KVCache
from .config import SamplingParams
from .fused import FusedDecoder
from .model import Laneformer
from .sampler import SamplerKnobs, make_generator, sample


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
        self.graph: torch.cuda.CUDAGraph | None = None
        # torch.compile of the static step: on a CPU it fuses the step's many small ops into a
        # few C++ kernels (the per-op overhead is what bounds small models there).
        self._fn = torch.compile(self._steps, dynamic=False) if compile else self._steps

    @torch.inference_mode()
    def _body(self) -> None:
        self._fn()

    def _steps(self) -> None:
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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy inits happen outside the graph
            self.warm_up()
        torch.cuda.current_stream().wait_stream(side)
        snap = self._snapshot()
        self.graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            self.graph.register_generator_state(self.generator)
        with torch.cuda.graph(self.graph):
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
