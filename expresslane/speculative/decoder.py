"""The speculative decode loop: draft (by prompt lookup, a draft model, or from the request's
predicted output), verify in one call, stream what is kept.

`SpeculativeDecoder(step, cache, capture, cfg)` verifies on the engine's own step
(step/protocol.py): the verify is `DecodeGraph(step, width=k + 1)` (step/graph.py), the same
step the plain tokens come from, so each verified row has the bits of a decode step and greedy
speculation is plain greedy decoding exactly, on every device (captured on a GPU, eager on a CPU).

`steps` produces a request's tokens after the first (which the engine picks from the prefill
logits), one at a time, so the engine's loop applies stop tokens, stop strings, `max_tokens`
and cancellation between any two of them, inside an accepted run too. Each round: draft up to k
tokens (fewer near `max_tokens` or the end of the context, padded to k; none during a back-off
pause, unless the match is full-length), then either one verify step or, without a draft, one
plain decode step. With the engine's decode graph the plain steps replay it, and a back-off
pause runs as one stream of them, one replay ahead as plain decoding runs; without one (the
eager engine, logprob requests) they are single forwards of the step.

The one commit rule (`_verify`): the last token and the kept drafts are committed to the cache;
the rejected drafts' slots were emptied inside the step (`graph.forget`).

Figures (verify steps, drafted, kept) go live into the engine's `Stats.extra["speculative"]`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..cache import KVCache
from ..sampling.params import SamplingParams
from ..sampling.sampler import Penalties, sample, structure_key
from ..step.graph import DecodeGraph, committed_tokens
from ..step.protocol import Step
from ..step.split import STEP_TOKENS, step_rows
from .draft_model import DraftModelDrafter
from .drafting import (
    DRAFT_MODEL_MARGIN,
    BackOff,
    NgramDrafter,
    SpecStats,
    SpeculativeConfig,
    accept,
)
from .prediction import drafter_for

# What each draft adds to a verify step, in decode steps (BackOff's break-even). On a CPU the
# packed verify computes every row on weights it reads once; its cost per extra row relative to
# a plain packed step is the slope of the "verify of S rows" line of `expresslane bench MODEL
# --speculative-config ...` (SmolLM2-135M, 1 thread): fp32 0.15-0.16, bf16/fp16 0.2, int8 (Q8_0)
# 0.31-0.35 (BENCHMARKS.md); on the Xeon with a verify's rows in one block (2026-12-07) F32
# 0.11, BF16 0.23, Q8_0 and int8 0.23-0.24, Q4_K_M 0.29. 0.15 for every format: with
# int8's own 0.31 the back-off counts verify steps that keep 1 of 5 drafts as misses and paused
# drafting more often, which in A/B runs gained nothing on edits and lost on free generation;
# drafts shortened by each format's cost were no measured gain either (BENCHMARKS.md, "Drafts
# sized by what a verify row costs"). The eager CPU verify (the model's forward) measured
# 0.1-0.15. A GPU at batch 1 streams the weights once for all rows.
DRAFT_COST = {"cpu": 0.15}
DRAFT_COST_DEFAULT = 0.02

# The drafts of a request's predicted output where the engine has no --speculative-config: a
# verify of 8 rows, the fused GPU step's most (step/split.py STEP_TOKENS) and the ring headroom
# every engine's cache has (engine.py).
PREDICTION_TOKENS = STEP_TOKENS - 1


class SpeculativeDecoder:
    def __init__(self, step: Step, cache: KVCache, capture: bool, cfg: SpeculativeConfig,
                 lookup: bool = True):  # fmt: skip
        """`capture`: the verify graphs are captured (a GPU), like the decode graphs.
        `lookup`: prompt lookup drafts (the engine's --speculative-config); without it only a
        request's predicted output does (prediction.py), k = `cfg.num_speculative_tokens`."""
        self.step, self.cache, self.cfg = step, cache, cfg
        self.capture, self.lookup = capture, lookup
        self.device = cache.k[0].device
        self.graphs: dict[tuple, DecodeGraph] = {}  # by (structure, captured)
        self.draft = None  # a draft model (draft_model.Draft), set by the Engine
        self.stats = SpecStats()
        self._extra: dict = {}

    @classmethod
    def for_predictions(cls, step: Step, cache: KVCache, capture: bool):
        """A verifier of predicted outputs alone (no prompt lookup), with drafts of
        PREDICTION_TOKENS as the cache's rings allow; None where they leave a forward one row
        (a prediction is then a hint nothing uses). Its verify graphs are made at a prediction's
        first request and, on a GPU, captured while the engine is idle (step/captures.py)."""
        room = cache.forward_room()  # None: any number of rows
        k = PREDICTION_TOKENS if room is None else min(PREDICTION_TOKENS, room - 1)
        if k < 1:
            return None
        cfg = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=1,
                                prompt_lookup_min=1)  # fmt: skip
        return cls(step, cache, capture, cfg, lookup=False)

    def begin(self, extra: dict) -> None:
        """A request starts: its figures are published in `extra` (the engine's Stats.extra)."""
        self.stats = SpecStats()
        self._extra = extra
        extra["speculative"] = self.stats.as_dict()

    def verify_graph(self, params: SamplingParams, generator, capture: bool) -> DecodeGraph:
        """The verify step for this sampler structure (made once; captured by the engine)."""
        key = (structure_key(params), capture)
        if key not in self.graphs:
            # not torch.compile'd (with --compile only the plain steps are): compiling it
            # costs minutes on a CPU, more than the requests that would repay it
            width = self.cfg.num_speculative_tokens + 1
            self.graphs[key] = DecodeGraph(self.step, params, width=width, capture=capture,
                                           generator=generator)  # fmt: skip
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
        pen: Penalties | None = None,
    ) -> Iterator[tuple[int, torch.Tensor | None]]:
        """Up to `budget` (token, logits it was chosen from or None) after `first`.

        `graph`: the engine's decode graph for this request (static path), or None (eager).
        `pen`: the request's logits adjustments (sampler.Penalties, `first` counted already):
        its verify rows come from the step uncaptured, each adjusted as a plain step there
        would be (`_verify_adjusted`), so the tokens are penalized plain decoding's.
        """
        want_lp = params.logprobs is not None
        drafter = self.drafter(prompt_ids, params)
        drafter.extend([first])
        if drafter.cost is None:  # prompt lookup or a prediction: a verify row's cost
            backoff = BackOff(DRAFT_COST.get(self.device.type, DRAFT_COST_DEFAULT))
        else:  # a draft model's, measured at load (draft_model.py)
            backoff = BackOff(drafter.cost, margin=DRAFT_MODEL_MARGIN)
            if not drafter.pays:
                backoff.pause = budget + 1  # the whole request plain (load_draft warned)
        vgraph = None
        if pen is None:
            vgraph = self.verify_graph(params, generator, graph is not None and graph.capture)
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
            drafts = self._draft(drafter, pos, left)
            if paused and not drafter.strong:  # a full-length match is kept ~90% of the time
                drafts = []
            if drafts:
                if pen is not None:
                    new, rows = self._verify_adjusted(last, drafts, pos, params, generator, pen)
                else:
                    new, rows = self._verify(vgraph, last, drafts, pos)
                kept = min(len(new) - 1, len(drafts))
                self.stats.add(len(drafts), kept, drafter.from_prediction)
                backoff.verified(len(drafts), kept)
                self._extra["speculative"] = self.stats.as_dict()
            else:  # one plain step (on the graph path one whole replay)
                n = 1 if graph is None else min(left, graph.steps)
                pairs = list(self._plain(graph, last, pos, params, generator, n, pen))
                new, rows = [t for t, _ in pairs], [r for _, r in pairs]
            new = new[:left]
            for j, tok in enumerate(new):
                yield tok, (rows[j] if want_lp else None)
            drafter.extend(new)
            last, pos, left = new[-1], pos + len(new), left - len(new)
            if not drafts:
                backoff.plain(len(new))

    def drafter(self, prompt_ids: Sequence[int], params: SamplingParams):
        """The request's drafter (prediction.py): its predicted output first, if any, then
        prompt lookup over the prompt, or the draft model, where this decoder drafts itself;
        the caller extends the first token."""
        own = None
        if self.lookup and self.draft is not None:
            own = DraftModelDrafter(self.draft, prompt_ids)
        drafter = drafter_for(self.cfg if self.lookup else None, prompt_ids, params.prediction,
                              own)  # fmt: skip
        if drafter is None:
            raise ValueError("a speculative decoder without prompt lookup needs a prediction")
        return drafter

    def _draft(self, drafter: NgramDrafter, pos: int, left: int) -> list[int]:
        """Drafts for positions pos + 1 .. pos + k: fewer near max_tokens; none where the k + 1
        rows would be written past the context."""
        k = self.cfg.num_speculative_tokens
        if self.cache.max_len - 1 - pos < k:
            return []
        return drafter.propose(min(k, left - 1))

    def _verify(self, vgraph: DecodeGraph, last: int, drafts: list[int], pos: int):
        """One verify step -> (new tokens, their logits rows, or None when captured)."""
        vgraph.load_drafts(last, drafts, pos)
        out = vgraph.run().tolist()  # the one host copy: [n kept, tokens]
        new = out[1 : out[0] + 2]
        self.cache.commit([last, *new[:-1]])  # the rejected: emptied inside the step
        return new, vgraph.rows

    def _verify_adjusted(self, last: int, drafts: list[int], pos: int, params, generator,
                         pen: Penalties):  # fmt: skip
        """A verify step whose rows are adjusted (penalties, logit_bias, min_tokens) before the
        acceptance rule: the step's rows uncaptured, as constrained decoding verifies."""
        rows = step_rows(self.step, [last, *drafts], pos)  # (k + 1, V)
        adjusted = pen.apply_rows(rows, drafts)
        kept, tokens = accept(adjusted, torch.tensor(drafts, device=self.device), params,
                              generator)  # fmt: skip
        out = torch.cat((kept.view(1), tokens)).tolist()  # the one host copy
        n, new = out[0], out[1 : out[0] + 2]
        self.cache.commit([last, *new[:-1]])
        if n < len(drafts):
            self.cache.truncate(pos + n + 1)  # the rejected drafts' slots emptied
        for t in new:
            pen.advance(t)
        return new, rows

    def _plain(self, graph, last, pos, params, generator, n: int, pen: Penalties | None = None):
        """`n` decode steps without drafts -> (token, logits or None) each."""
        if graph is not None:
            graph.load(torch.tensor(last, device=self.device), position=pos)
            yield from ((t, None) for t in committed_tokens(graph, self.cache, last, n))
            return
        for _ in range(n):  # the step's forward, its scan bounded to the live slots
            logits = step_rows(self.step, [last], pos)[-1]
            self.cache.commit([last])
            picked = sample(logits if pen is None else pen.apply(logits), params, generator)
            if pen is not None:
                pen.advance(picked)
            last, pos = int(picked), pos + 1
            yield last, logits
