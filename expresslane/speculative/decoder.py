"""The speculative decode loop: draft by prompt lookup, verify in one call, stream what is kept.

`SpeculativeDecoder.steps` produces a request's tokens after the first (which the engine picks
from the prefill logits), one at a time, so the engine's loop applies stop tokens, stop strings,
`max_tokens` and cancellation between any two of them, inside an accepted run too. Each round:
draft up to k tokens (fewer near `max_tokens` or the end of the context; none during a back-off
pause, unless the match is full-length), then either one verify step or, without a draft, one
plain decode step. The eager path serves the eager engine and logprob requests. With the
engine's decode graph the plain steps replay it, and a back-off pause runs as one stream of
them, one replay ahead as plain decoding runs; the verify step is then, where that graph's step
is the packed one (a CPU), the packed step over the k + 1 rows (`verify_packed`, any k up to
the configured one), else (GPU) a captured `VerifyGraph` for the configured k.

Figures (verify steps, drafted, kept) go live into the engine's `Stats.extra["speculative"]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..config import SamplingParams
from ..sampler import sample, structure_key
from ..step.graph import DecodeGraph, committed_tokens
from ..step.packed import PackedDecoder
from ..step.packed_verify import PackedVerifier
from .drafting import BackOff, NgramDrafter, SpecStats, SpeculativeConfig
from .verify import VerifyGraph, verify_eager, verify_packed

# What each draft adds to a verify step, in decode steps (BackOff's break-even). On a CPU the
# packed verify computes every row on weights it reads once; its cost per extra row relative to
# a plain packed step is the slope of the "verify of S rows" line of `expresslane bench MODEL
# --speculative-config ...` (SmolLM2-135M, 1 thread): fp32 0.15-0.16, bf16/fp16 0.2, int8 (Q8_0)
# 0.31-0.35 (BENCHMARKS.md). 0.15 for every format: with int8's own 0.31 the back-off counts
# verify steps that keep 1 of 5 drafts as misses and paused drafting more often, which in A/B
# runs gained nothing on edits and lost on free generation. The eager CPU verify (the model's
# forward) measured 0.1-0.15. A GPU at batch 1 streams the weights once for all rows.
DRAFT_COST = {"cpu": 0.15}
DRAFT_COST_DEFAULT = 0.02


class SpeculativeDecoder:
    def __init__(self, engine, cfg: SpeculativeConfig):
        """`engine`: the Engine that owns the model and cache (model, cache, max_len, device)."""
        self.engine, self.cfg = engine, cfg
        self.graphs: dict[tuple, VerifyGraph] = {}
        self.packed: PackedVerifier | None = None
        self.stats = SpecStats()
        self._extra: dict = {}

    def begin(self, extra: dict) -> None:
        """A request starts: its figures are published in `extra` (the engine's Stats.extra)."""
        self.stats = SpecStats()
        self._extra = extra
        extra["speculative"] = self.stats.as_dict()

    def _verify_graph(self, params: SamplingParams, generator) -> VerifyGraph:
        key = structure_key(params)
        if key not in self.graphs:
            eng = self.engine
            # not torch.compile'd (with --compile only the plain steps are): compiling it
            # costs minutes on a CPU, more than the requests that would repay it
            self.graphs[key] = VerifyGraph(
                eng.model, eng.cache, params, self.cfg.num_speculative_tokens, generator
            )
        vg = self.graphs[key]
        vg.generator = generator  # the decode graph's: the same object for a captured graph
        vg.set_params(params)
        return vg

    @torch.inference_mode()
    def steps(
        self,
        prompt_ids: Sequence[int],
        first: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        budget: int,
        graph: DecodeGraph | None = None,
    ) -> Iterator[tuple[int, torch.Tensor | None]]:
        """Up to `budget` (token, logits it was chosen from or None) after `first`.

        `graph`: the engine's decode graph for this request (static path), or None (eager).
        """
        eng, cfg = self.engine, self.cfg
        want_lp = params.logprobs is not None
        drafter = NgramDrafter(cfg, [*prompt_ids, first])
        packed = self._packed(graph)
        backoff = BackOff(DRAFT_COST.get(eng.device.type, DRAFT_COST_DEFAULT))
        vgraph = None
        if graph is not None and packed is None:
            vgraph = self._verify_graph(params, generator)
        last, pos, left = first, len(prompt_ids), budget  # `last` sits at `pos`, not yet cached
        while left > 0:
            paused = not backoff.ready()
            if paused and graph is not None:  # the whole pause as one stream, one replay ahead
                n = min(left, -(-backoff.pause // graph.steps) * graph.steps)  # whole replays
                for tok, _ in self._plain(graph, last, pos, params, generator, n):
                    yield tok, None
                    drafter.extend([tok])
                    last, pos, left = tok, pos + 1, left - 1
                backoff.plain(n)
                continue
            drafts = self._draft(drafter, vgraph, pos, left)
            if paused and not drafter.strong:  # a full-length match is kept ~90% of the time
                drafts = []
            if drafts:
                new, rows = self._verify(vgraph, packed, last, drafts, pos, params, generator)
                kept = min(len(new) - 1, len(drafts))
                self.stats.add(len(drafts), kept)
                backoff.verified(len(drafts), kept)
                self._extra["speculative"] = self.stats.as_dict()
            else:  # one plain step (on the graph path one whole replay)
                n = 1 if graph is None else min(left, graph.steps)
                pairs = list(self._plain(graph, last, pos, params, generator, n))
                new, rows = [t for t, _ in pairs], [r for _, r in pairs]
            new = new[:left]
            for j, tok in enumerate(new):
                yield tok, (rows[j] if want_lp else None)
            drafter.extend(new)
            last, pos, left = new[-1], pos + len(new), left - len(new)
            if not drafts:
                backoff.plain(len(new))

    def _draft(self, drafter: NgramDrafter, vgraph: VerifyGraph | None, pos: int, left: int):
        """Drafts for positions pos + 1 .. pos + k: fewer near max_tokens and the context end."""
        room = self.engine.max_len - 1 - pos
        if vgraph is not None and room < vgraph.k:
            return []  # the fixed-k step would write past the context
        return drafter.propose(min(self.cfg.num_speculative_tokens, left - 1, room))

    def _packed(self, graph: DecodeGraph | None) -> PackedVerifier | None:
        """The packed verify step where the decode graph's step is the packed one (CPU)."""
        dec = None if graph is None else graph.decoder
        if not isinstance(dec, PackedDecoder):
            return None
        if self.packed is None or self.packed.decoder is not dec:
            self.packed = PackedVerifier(dec)
        return self.packed

    def _verify(self, vgraph, packed, last, drafts, pos, params, generator):
        """One verify step -> (new tokens, their logits rows or None)."""
        eng = self.engine
        if packed is not None and packed.fits(len(drafts) + 1):
            return verify_packed(packed, eng.cache, last, drafts, params, generator)
        if vgraph is None:
            return verify_eager(eng.model, eng.cache, last, drafts, params, generator)
        vgraph.load_drafts(last, drafts, pos)
        out = vgraph.verify()
        new = out[1 : out[0] + 2]
        self.engine.cache.commit([last, *new[:-1]])  # the rejected: emptied inside the step
        return new, None

    def _plain(self, graph, last, pos, params, generator, n: int):
        """`n` decode steps without drafts -> (token, logits or None) each."""
        eng = self.engine
        if graph is not None:
            graph.load(torch.tensor(last, device=eng.device), position=pos)
            yield from ((t, None) for t in committed_tokens(graph, eng.cache, last, n))
            return
        for _ in range(n):
            ids = torch.tensor([[last]], device=eng.device)
            logits = eng.model(ids, cache=eng.cache)[0, -1]
            eng.cache.commit([last])
            last = int(sample(logits, params, generator))
            yield last, logits
