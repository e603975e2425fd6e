"""The speculative decode loop: draft by prompt lookup, verify in one call, stream what is kept.

`SpeculativeDecoder.steps` produces a request's tokens after the first (which the engine picks
from the prefill logits), one at a time, so the engine's loop applies stop tokens, stop strings,
`max_tokens` and cancellation between any two of them, inside an accepted run too. Each round:
draft up to k tokens (fewer near `max_tokens` or the end of the context, none while backing
off), then either one verify step or, without a draft, one plain decode step. The eager path
serves CPUs and logprob requests; with the engine's decode graph (GPU) the verify step is a
captured `VerifyGraph` for the configured k and plain steps replay the decode graph.

Figures (verify steps, drafted, kept) go live into the engine's `Stats.extra["speculative"]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .config import SamplingParams
from .graph import DecodeGraph
from .sampler import sample, structure_key
from .speculative import BackOff, NgramDrafter, SpecStats, SpeculativeConfig
from .verify import VerifyGraph, verify_eager

# What each draft adds to a verify step, in decode steps (BackOff): a CPU computes every row
# (0.1-0.15 measured with SmolLM2; the low end, so that break-even verifies are not punished); a
# GPU at batch 1 streams the weights once for all of them.
DRAFT_COST = {"cpu": 0.1}
DRAFT_COST_DEFAULT = 0.02


class SpeculativeDecoder:
    def __init__(self, engine, cfg: SpeculativeConfig):
        """`engine`: the Engine that owns the model and cache (model, cache, max_len, device)."""
        self.engine, self.cfg = engine, cfg
        self.graphs: dict[tuple, VerifyGraph] = {}
        self.stats = SpecStats()
        self._extra: dict | None = None

    def begin(self, extra: dict) -> None:
        """A request starts: its figures are published in `extra` (the engine's Stats.extra)."""
        self.stats = SpecStats()
        self._extra = extra
        extra["speculative"] = self.stats.as_dict()

    def _verify_graph(self, params: SamplingParams, generator) -> VerifyGraph:
        key = structure_key(params)
        if key not in self.graphs:
            eng = self.engine
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
        backoff = BackOff(DRAFT_COST.get(eng.device.type, DRAFT_COST_DEFAULT))
        vgraph = self._verify_graph(params, generator) if graph is not None else None
        last, pos, left = first, len(prompt_ids), budget  # `last` sits at `pos`, not yet cached
        while left > 0:
            room = eng.max_len - 1 - pos  # drafts occupy positions pos + 1 .. pos + k
            k = min(cfg.num_speculative_tokens, left - 1, room)
            drafts = drafter.propose(k) if backoff.ready() else []
            if vgraph is not None and room < vgraph.k:
                drafts = []  # the fixed-k step would write past the context
            if drafts:
                new, rows = self._verify(vgraph, last, drafts, pos, params, generator)
                kept = min(len(new) - 1, len(drafts))
                self.stats.add(len(drafts), kept)
                backoff.verified(len(drafts), kept)
                self._extra["speculative"] = self.stats.as_dict()
            else:
                new, rows = self._plain(graph, last, pos, params, generator)
                backoff.plain(len(new))
            new = new[:left]
            for j, tok in enumerate(new):
                yield tok, (rows[j] if want_lp else None)
            drafter.extend(new)
            last, pos, left = new[-1], pos + len(new), left - len(new)

    def _verify(self, vgraph, last, drafts, pos, params, generator):
        """One verify step -> (new tokens, their logits rows or None)."""
        if vgraph is None:
            return verify_eager(
                self.engine.model, self.engine.cache, last, drafts, params, generator
            )
        vgraph.load_drafts(last, drafts, pos)
        out = vgraph.verify()
        return out[1 : out[0] + 2], None

    def _plain(self, graph, last, pos, params, generator):
        """One decode step without a draft (the decode graph: one replay of its steps)."""
        eng = self.engine
        if graph is not None:
            graph.load(torch.tensor(last, device=eng.device), position=pos)
            return graph.run().tolist(), None
        logits = eng.model(torch.tensor([[last]], device=eng.device), cache=eng.cache)[0]
        return [int(sample(logits[-1], params, generator))], logits
