"""The decode step on static buffers: captured in a CUDA graph on a GPU, run eagerly elsewhere.

One replay runs `steps` whole decode steps: embedding, every layer, final norm, LM head,
sampling, and the hand-over of the new token into the input buffer, with the position advanced
on the device. Nothing in it touches the host; the host copies the `out` buffer to pinned memory
after each replay and reads it one replay behind (`DecodeStream`), only to stream tokens and to
notice a stop token, so the device runs ahead.

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
from .sampler import make_generator, sample


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
                tok = self.decoder.next_token(self.token, self.pos, self.params, self.generator)
            else:
                logits = self.model(self.token, positions=self.pos, cache=self.cache)[0, -1]
                tok = sample(logits, self.params, self.generator)
            self.out[j] = tok
            self.token.copy_(tok.view(1, 1))
            self.pos.add_(1)

    def load(self, token: torch.Tensor, position: int) -> None:
        """Set the step's input: the last sampled token (a device tensor) at `position`."""
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(position)

    def _capture(self) -> None:
        saved_token, saved_pos = self.token.clone(), self.pos.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits happen outside the graph
            for _ in range(2):
                self._body()
                self.token.copy_(saved_token)
                self.pos.copy_(saved_pos)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            self.graph.register_generator_state(self.generator)
        with torch.cuda.graph(self.graph):
            self._body()
        self.token.copy_(saved_token)  # capture recorded the work but did not advance anything
        self.pos.copy_(saved_pos)

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
