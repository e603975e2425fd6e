"""Drafts from a smaller model: vLLM's `{"method": "draft_model", "model": PATH}`, llama.cpp's
`--model-draft`.

The draft model runs in an engine of its own (`load_draft`: the target's device and context,
its own KV cache), and proposes its greedy continuation of the sequence so far, one token per
forward. Every proposal goes through that engine's `prefill`, whose prefix reuse does the
bookkeeping: the draft cache already holds the sequence up to the last verify, so a proposal
prefills only what is new (the tokens the target kept or chose since), then one token per draft;
the drafts the target rejected are cut off by the common prefix. Its rings keep no snapshot
(prefix.py): a proposal only ever extends the sequence, and a snapshot per token would cost a
copy of every ring.

The drafts are the draft model's argmax, a deterministic function of the sequence: the
speculative decoder's acceptance rule (drafting.accept, for a one-hot draft distribution) keeps
the target's output distribution exactly, and greedy output is plain greedy's, whatever the
draft model. Only the speed depends on it: how often the target agrees, and what a draft
costs. `measured_cost` times that once, at load, in the target's decode steps: the draft's
forward of one token plus one more row of the target's verify. The back-off (drafting.BackOff)
pauses drafting while verifies keep fewer drafts than that costs. Measured, not estimated from
bytes: on the 2-vCPU VM a verify row cost 0.16 of an fp32 step and 0.48 of a bf16 one (bf16's
products are bound by their dot products, fp32's by memory), so a Q8_0 draft paid for an fp32
target (1.5x) and could not for a bf16 one (BENCHMARKS.md). The timing varies a little between
processes, so a seeded sampled request can take another path of verifies and plain steps in
another process (the same distribution; greedy output never changes).

Decision: the draft and target must have the same vocabulary size (vLLM's check); a draft with
another tokenizer of the same size would give drafts that are rarely kept, never a wrong output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..sampling.params import SamplingParams
from ..sampling.sampler import argmax
from ..step.graph import DecodeGraph
from .drafting import DRAFT_MODEL_MARGIN

log = logging.getLogger("expresslane")


@dataclass
class Draft:
    """A draft model's engine, and what one of its drafts costs in the target's decode steps
    (`measured_cost`), for k drafts a verify."""

    engine: Any
    cost: float
    k: int

    @property
    def pays(self) -> bool:
        """Would a verify that keeps all k drafts yield DRAFT_MODEL_MARGIN times its cost?"""
        return self.k + 1 >= DRAFT_MODEL_MARGIN * (1 + self.cost * self.k)


def load_draft(engine_cls, path: str, target) -> Draft:
    """The draft model's engine (`engine_cls` is the caller's Engine: this layer cannot import
    it) for `target`'s device and context, timed; a ConfigError when the vocabularies differ."""
    on_cpu = target.device.type == "cpu"
    dtype = "auto" if on_cpu else str(target.dtype).removeprefix("torch.")
    engine = engine_cls.from_pretrained(path, device=str(target.device), dtype=dtype,
                                        max_model_len=target.max_len, progress=False,
                                        capture=False)  # fmt: skip
    if engine.cfg.vocab_size != target.cfg.vocab_size:
        raise ConfigError(
            f"--speculative-config: the draft model has {engine.cfg.vocab_size} tokens in its "
            f"vocabulary and the model {target.cfg.vocab_size}: they must share a tokenizer"
        )
    engine.prefix.snapshot = None  # module docstring
    k = target.speculator.cfg.num_speculative_tokens
    draft = Draft(engine, measured_cost(engine, target, k), k)
    if not draft.pays:
        log.warning("the draft model %s costs %.2f decode steps of the model a draft (measured "
                    "at load): a verify that keeps all %d drafts would not pay, so requests "
                    "decode plain; a smaller draft model (or fewer bytes a weight) would",
                    path, draft.cost, k)  # fmt: skip
    return draft


def measured_cost(draft, target, k: int, repeats: int = 3) -> float:
    """One draft's cost in the target's decode steps (module docstring), on the paths a request
    takes: the target's plain step and its verify of k + 1 rows (DecodeGraph, uncaptured), and
    one token through the draft's prefill after one in its cache; each the best of `repeats`
    after a warm-up, on a dummy sequence, both caches emptied after."""
    ids = [1 + i % (target.cfg.vocab_size - 1) for i in range(k + 1)]
    greedy, dev = SamplingParams(), target.device
    plain = DecodeGraph(target.step, greedy, width=1, capture=False)
    verify = DecodeGraph(target.step, greedy, width=k + 1, capture=False)

    def best(run, setup) -> float:
        times = []
        for _ in range(repeats + 1):
            setup()
            t = time.perf_counter()
            run()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times[1:])

    with torch.inference_mode():
        one = best(lambda: (plain.load(torch.tensor(ids[0], device=dev), position=0),
                            plain.run()), target.cache.reset)  # fmt: skip
        rows = best(lambda: (verify.load_drafts(ids[0], ids[1:], 0), verify.run()),
                    target.cache.reset)  # fmt: skip
        drafting = best(lambda: draft.prefill(ids[:2]),
                        lambda: (draft.cache.reset(), draft.prefill(ids[:1])))  # fmt: skip
    target.cache.reset()
    draft.cache.reset()
    return max(0.0, rows - one) / (k * one) + drafting / one


class DraftModelDrafter:
    """The drafter interface (extend, propose, strong, from_prediction, cost) over a draft."""

    from_prediction = False
    strong = False  # a back-off pause holds: the draft model's misses cost its forwards too

    def __init__(self, draft: Draft, prompt_ids: Sequence[int]):
        self.engine, self.cost, self.pays = draft.engine, draft.cost, draft.pays
        self.seq: list[int] = list(prompt_ids)

    def extend(self, tokens: Sequence[int]) -> None:
        self.seq.extend(tokens)

    @torch.inference_mode()
    def propose(self, k: int) -> list[int]:
        """The draft model's greedy next k tokens after the sequence (one host copy each: the
        next forward's input)."""
        out: list[int] = []
        for _ in range(max(0, k)):
            logits = self.engine.prefill(self.seq + out)
            out.append(int(argmax(logits)))
        return out
