"""The decode step split at the pick, on static buffers: what constrained decoding replays.

A request under a grammar (structured/decoding.py) cannot replay the decode graph (graph.py),
which picks and feeds the pick back on the device: the host must advance the grammar's matcher
with every token and write the next token mask before the next pick. But only the pick needs the
mask; the forward does not. So the step is split in two graphs:

- `ForwardGraph(step, width)`: the step's forward of up to `width` tokens (the picked one and the
  tokens the grammar forces after it: jump-forward), the logits of every row into `rows`
  (width, V) and those of the last real row into the shared `logits` (V,). Rows past the real
  ones are padding: their cache slots are emptied on the device (`graph.forget`), so the cache
  holds what the real rows alone would write, and a verify of drafts reads its rows from `rows`.
  Each bucket of the live bound is a graph of its own, as for the decode graph.
- `PickGraph(logits, params, words)`: the pick from `logits` under the mask in its static buffer
  (`SamplerKnobs.token_mask`), one replay for the several kernels of a masked sample.

Per token the host replays the forward, computes the next mask while the device runs it, copies
the mask and replays the pick, then reads the one token (the request's only host sync). The
device then waits while the host reads the token, advances the matcher and launches the next
forward. The chained mode (`SplitSteps.chain`) closes that gap: the pick writes its token into
the width-1 forward's input and the host launches that forward right behind the pick, before
reading the token; tokens the grammar then forces go through a forward of their own (one more
pass over the weights per forced run, where the plain mode sends them with the picked token).
Which costs less depends on the gap and on how often a grammar forces tokens: measured, not
guessed (`CHAIN`).

`SplitSteps` owns one engine's graphs: the forward at width 1 and at `chunk_width(cache)`, and a
pick per sampler structure, all captured at load (no request waits for a capture); a structure
not prepared at load runs its pick uncaptured until the engine is idle (`pending`).

The forward's rows are the step's own bits (each row independent of S), so a request decodes the
same tokens through these graphs as through the step's forward uncaptured (tests/test_split.py).
"""

from __future__ import annotations

import time

import torch

from ..cache import KVCache
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, logprobs_of, make_generator, sample, structure_key
from .graph import DecodeGraph, forget
from .protocol import Step

STEP_TOKENS = 8  # tokens per forward at most: the fused GPU step's most (fused.py MAX_TOKENS)
# The chained mode, off until a GPU measures it (bench/structured.py --split plain chain).
CHAIN = False


def chunk_width(cache: KVCache) -> int:
    """Tokens one forward may write: what the rings' headroom allows, at most STEP_TOKENS."""
    return min(STEP_TOKENS, cache.forward_room() or STEP_TOKENS)


def step_rows(step: Step, ids: list[int], pos: int, shared: bool = False) -> torch.Tensor:
    """Logits (S, V) of `ids` written from `pos` by the step, uncaptured; the cache runs static
    as inside a decode graph. `shared`: the step's own buffer where it offers one (protocol.py
    `forward_shared`), valid until its next call."""
    cache = step.cache
    dev = cache.k[0].device
    x, position = torch.tensor(ids, device=dev), torch.tensor([pos], device=dev)
    forward = getattr(step, "forward_shared", step.forward) if shared else step.forward
    cache.static, cache.live = True, pos + len(ids)
    try:
        return forward(x, position)
    finally:
        cache.static, cache.live = False, None


def forward_logits(step: Step, split: SplitSteps | None, ids: list[int], pos: int):
    """Logits (V,) after `ids` written from `pos`: replayed from the split graphs where given
    (asynchronous on a GPU; the shared buffer, overwritten by the next forward), else the step
    uncaptured, `chunk_width` tokens a call, in the step's buffer where it has one (overwritten
    by its next call alike). The caller commits the ids to the cache."""
    if split is not None:
        return split.forward(ids, pos)
    width = chunk_width(step.cache)
    for at in range(0, len(ids), width):
        logits = step_rows(step, ids[at : at + width], pos + at, shared=True)[-1]
    return logits


class ForwardGraph(DecodeGraph):
    """The step's forward alone, of 1 .. width real tokens padded to `width` (module docstring).
    `logits` (V,) fp32 is the buffer the picks read, shared by an engine's forward graphs."""

    def __init__(self, step: Step, width: int, logits: torch.Tensor, capture: bool | None = None):
        super().__init__(step, SamplingParams(), width=width, capture=capture)
        dev = self.token.device
        self.logits = logits
        # every row, for a verify of drafts (width 1: the one row is `logits`)
        V = logits.shape[0]
        self.rows = torch.zeros((width, V), device=dev) if width > 1 else None
        self.n = torch.ones((1,), dtype=torch.long, device=dev)  # real rows, on the device

    def _step_loop(self) -> None:
        logits = self.step.forward(self.token, self.pos)  # (width, V)
        self.logits.copy_(logits.index_select(0, self.n - 1).view(-1))  # no host read
        if self.width > 1:
            self.rows.copy_(logits)
            forget(self.cache, self.pos + self.offsets, self.offsets < self.n)

    def feed(self, ids: list[int], position: int) -> None:
        """Run the forward of `ids` (1 .. width tokens) written from `position`; asynchronous
        on a GPU. Pads with the last id; the padded rows leave the cache as they found it."""
        n = len(ids)
        if not 1 <= n <= self.width:
            raise ValueError(f"feed of {n} tokens: the graph takes 1..{self.width}")
        cuda = self.token.device.type == "cuda"
        padded = torch.tensor(ids + ids[-1:] * (self.width - n), pin_memory=cuda)
        self.token.copy_(padded, non_blocking=True)  # a fresh pinned block: safe to go async
        self._replay(n, position)

    def feed_picked(self, position: int) -> None:
        """Run the forward of the token a pick graph wrote into this graph's input (width 1)."""
        self._replay(1, position)

    def _replay(self, n: int, position: int) -> None:
        self.n.fill_(n)
        self.pos.fill_(position)
        self.host_pos = position
        self.run()


class PickGraph:
    """token = sample(logits, params, generator, knobs) with the grammar's mask in the knobs'
    static buffer; captured once per sampler structure (no cache, so no buckets). Without a
    mask (`words` 0) and with `top_n`, the pick of a request that asks for logprobs: the
    chosen token's logprob and the top n, computed in the same replay."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, words: int,
                 capture: bool | None = None, feed_to: torch.Tensor | None = None,
                 top_n: int | None = None):  # fmt: skip
        """`feed_to`: a (1,) token buffer the pick also writes (the width-1 forward's input,
        for the chained mode: SplitSteps)."""
        dev = logits.device
        self.logits, self.params, self.feed_to, self.top_n = logits, params, feed_to, top_n
        cuda = dev.type == "cuda"
        self.host = torch.zeros((), dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.knobs = SamplerKnobs(dev)
        if words:
            self.knobs.with_token_mask(words)
        # [logprob, top ids (as floats: exact below 2^24), top logprobs]: one copy to the host
        n = 1 + 2 * (top_n or 0)
        self.lps = torch.zeros(n, device=dev) if top_n is not None else None
        self.host_lps = torch.zeros(n, pin_memory=cuda) if top_n is not None else None
        self.knobs.load(params)
        self.generator = make_generator(params, dev)
        self.out = torch.zeros((), dtype=torch.long, device=dev)
        self.capture = (dev.type == "cuda") if capture is None else capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.missing: set[int] = set()
        self.capture_s = 0.0

    def _body(self) -> None:
        self.out.copy_(sample(self.logits, self.params, self.generator, self.knobs))
        if self.feed_to is not None:
            self.feed_to.copy_(self.out.view(1))
        if self.top_n is not None:
            n = self.top_n
            lp, ids, vals = logprobs_of(self.logits, self.out, n)
            self.lps[0].copy_(lp)
            if n:
                self.lps[1 : 1 + n].copy_(ids)
                self.lps[1 + n :].copy_(vals)

    def set_params(self, params: SamplingParams) -> None:
        """A request's sampler values and seed (same structure_key as the captured params)."""
        self.knobs.load(params)
        if self.generator is not None:
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def launch(self, mask: torch.Tensor | None = None) -> None:
        """Start the pick under `mask` (W,) int32 (pinned host memory on a GPU) and the copy of
        its token (and logprobs) to the host; asynchronous on a GPU (`token` waits for it)."""
        if mask is not None:
            self.knobs.token_mask.copy_(mask, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            if self.capture:
                self.missing.add(0)
            self._body()
        self.host.copy_(self.out, non_blocking=True)
        if self.lps is not None:
            self.host_lps.copy_(self.lps, non_blocking=True)
        if self.event is not None:
            self.event.record()

    def logprobs(self) -> tuple[float, list[tuple[int, float]] | None]:
        """(the picked token's logprob, the top n as (id, logprob) or None for n = 0), after
        `token`."""
        vals, n = self.host_lps.tolist(), self.top_n
        top = [(int(i), v) for i, v in zip(vals[1 : 1 + n], vals[1 + n :], strict=True)]
        return vals[0], top if n else None

    def token(self) -> int:
        """The launched pick's token: waits for the pick alone, not for work queued after it."""
        if self.event is not None:
            self.event.synchronize()
        return int(self.host)

    def run(self, mask: torch.Tensor) -> int:
        """The token picked under `mask`: the one host sync of a constrained token."""
        self.launch(mask)
        return self.token()

    def _rng(self):
        return None if self.generator is None else self.generator.get_state()

    def _set_rng(self, state) -> None:
        if state is not None:
            self.generator.set_state(state)

    def pending(self) -> list[int]:
        return [0] if self.capture and self.missing and self.graph is None else []

    def capture_buckets(self, buckets: list[int] | None = None) -> float:
        """Capture the pick (its one "bucket"); warm-up and capture leave the RNG as it was."""
        if not self.capture or self.graph is not None:
            return 0.0
        t = time.perf_counter()
        state, out = self._rng(), self.out.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy inits outside the graph
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self._set_rng(state)
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None:
            graph.register_generator_state(self.generator)
        with torch.cuda.graph(graph):
            self._body()
        self._set_rng(state)
        self.out.copy_(out)
        self.graph = graph
        spent = time.perf_counter() - t
        self.capture_s += spent
        return spent


class SplitSteps:
    """One engine's forward graphs (width 1 and `chunk_width`) and pick graphs (by sampler
    structure), over the shared logits buffer."""

    def __init__(self, step: Step, vocab_size: int, capture: bool | None = None):
        cache = step.cache
        self.cache, self.vocab_size = cache, vocab_size
        dev = cache.k[0].device
        self.capture = capture
        self.logits = torch.zeros((vocab_size,), dtype=torch.float32, device=dev)
        self.width = chunk_width(cache)
        widths = sorted({1, self.width})
        self.forwards = {w: ForwardGraph(step, w, self.logits, capture) for w in widths}
        self.picks: dict[tuple, PickGraph] = {}
        self.chain = CHAIN  # the picked token's forward launched from the pick (docstring)

    @property
    def words(self) -> int:
        return -(-self.vocab_size // 32)

    def pick_graph(self, params: SamplingParams, masked: bool = True) -> PickGraph:
        """The pick of this sampler structure, loaded with the request's values and seed: a
        grammar's (masked), or a request's with logprobs (unmasked, its top n computed)."""
        top_n = None if masked else params.logprobs
        key = (structure_key(params), masked, top_n)
        if key not in self.picks:
            self.picks[key] = PickGraph(self.logits, params, self.words if masked else 0,
                                        self.capture, feed_to=self.forwards[1].token,
                                        top_n=top_n)  # fmt: skip
        pick = self.picks[key]
        pick.set_params(params)
        return pick

    def forward(self, ids: list[int], position: int) -> torch.Tensor:
        """The forward of `ids` from `position`, in chunks of up to `width` (one token a replay
        where the padding would pass the cache's end); returns the shared logits buffer."""
        at = 0
        while at < len(ids):
            w = self.width if position + at + self.width <= self.cache.max_len else 1
            take = min(w, len(ids) - at)
            self.forwards[w if take > 1 else 1].feed(ids[at : at + take], position + at)
            at += take
        return self.logits

    def rows(self, ids: list[int], position: int) -> torch.Tensor | None:
        """The logits (S, V) of every row of `ids` in one forward, or None where they do not fit
        one (more than `width` tokens, or padding past the cache's end)."""
        S = len(ids)
        if S > self.width or S == 1 or position + self.width > self.cache.max_len:
            return None
        graph = self.forwards[self.width]
        graph.feed(ids, position)
        return graph.rows[:S]

    def graphs(self) -> list:
        return [*self.forwards.values(), *self.picks.values()]

    def capture_all(self, structures) -> float:
        """Capture every bucket of the forwards and the picks of `structures` (at load)."""
        spent = sum(g.capture_buckets() for g in self.forwards.values())
        return spent + sum(self.pick_graph(p).capture_buckets() for p in structures)
