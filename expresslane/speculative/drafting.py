"""Speculative decoding by prompt lookup: the config, the n-gram drafter, the acceptance rule.

Drafting: the longest n-gram (n from `prompt_lookup_max` down to `prompt_lookup_min`) that ends
the sequence so far (prompt and generated tokens) and occurred earlier in it proposes the tokens
that followed its latest earlier occurrence, up to `num_speculative_tokens` (continuing the
repeat periodically where it reaches the end of the sequence). A draft model's drafts:
draft_model.py.

Acceptance (`accept`): the model scores the last accepted token and the k drafts in one call;
row j of its logits is the distribution of the token after input j. Greedy keeps the drafts
while they equal the argmax, then the argmax. Sampling is the standard speculative rule for a
deterministic draft (q = one-hot): draft j is kept with probability p_j(draft) under the
filtered (temperature / top-k / top-p / min-p) distribution; at the first rejection the token
is drawn from p_j with the draft removed and renormalised; when all are kept, one more from p_k.
So the output has exactly the model's distribution. Everything stays on the device with fixed
shapes (no host sync), so a captured verify step runs it as is.

`BackOff` pauses drafting after verify steps that gain nothing, so that on text that does not
repeat speculation costs (almost) nothing against plain decoding. It counts tokens, not time:
the same seed gives the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, argmax, draw, filter_logits

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
# A draft model's verify must yield this much more than its cost measured at load: that timing
# (position 0, each model alone) missed ~15% of the real cost on the VM (a bf16 target whose
# drafts measured 0.95 of a step ran at 0.89x plain while keeping every draft).
DRAFT_MODEL_MARGIN = 1.15


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` fields: prompt lookup (method "ngram", the default), or a
    smaller model's greedy drafts (method "draft_model", implied by `model`: its path)."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    model: str | None = None  # the draft model (draft_model.py)

    @classmethod
    def from_json(cls, text: str, where: str = "--speculative-config") -> SpeculativeConfig:
        """Parse the JSON object of the flag; a bad value is a ConfigError naming the field."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg} at character {e.pos})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, where)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "--speculative-config") -> SpeculativeConfig:
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "model"}  # fmt: skip
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown field {unknown[0]!r} (expected {', '.join(sorted(known))})"
            )
        method = raw.get("method", "draft_model" if "model" in raw else "ngram")
        if method not in METHODS:
            raise ConfigError(f"{where}: method={method!r}: expected 'ngram' (prompt lookup) or "
                              "'draft_model' (with `model`)")  # fmt: skip

        def count(name: str, value, hi: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ConfigError(f"{where}: {name}={value!r}: expected an integer in [1, {hi}]")
            return value

        if "num_speculative_tokens" not in raw:
            raise ConfigError(f"{where}: num_speculative_tokens is required")
        k = count("num_speculative_tokens", raw["num_speculative_tokens"], MAX_SPECULATIVE_TOKENS)
        if method == "draft_model":
            return cls._draft_model(raw, k, where)
        hi, lo = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        if hi is None and lo is None:  # vLLM's defaults: one n-gram size, 5
            hi = lo = 5
        lo = None if lo is None else count("prompt_lookup_min", lo, 64)
        hi = lo if hi is None else count("prompt_lookup_max", hi, 64)
        lo = hi if lo is None else lo  # vLLM: one given, the other equals it
        if lo > hi:
            raise ConfigError(
                f"{where}: prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}"
            )
        if "model" in raw:
            raise ConfigError(f"{where}: model: a draft model needs method 'draft_model'")
        return cls(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo)

    @classmethod
    def _draft_model(cls, raw: dict, k: int, where: str) -> SpeculativeConfig:
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ConfigError(f"{where}: method 'draft_model' needs `model`: the draft model's "
                              "path or name")  # fmt: skip
        looked = sorted(set(raw) & {"prompt_lookup_max", "prompt_lookup_min"})
        if looked:
            raise ConfigError(f"{where}: {looked[0]} is prompt lookup's (method 'ngram'), not "
                              "a draft model's")  # fmt: skip
        return cls(num_speculative_tokens=k, prompt_lookup_max=0, prompt_lookup_min=0,
                   method="draft_model", model=model)  # fmt: skip


class NgramDrafter:
    """Prompt lookup over one request's tokens, with an index of every n-gram's latest end.

    `extend` appends tokens; `propose(k)` returns up to k tokens. The index is filled lazily
    up to (not including) the sequence's last position, so the suffix never matches itself.
    Among matches of the longest n, the place the previous draft was copied from (moved on by
    the tokens produced since) comes first, then the latest occurrence: an edit that reprints a
    file keeps copying from its source instead of jumping to another line that repeats the
    last few tokens.
    """

    from_prediction = False  # its drafts come from the sequence (prediction.py's do not)
    cost = None  # a draft's own cost (a draft model's); None: only its verify row's

    def __init__(self, cfg: SpeculativeConfig, tokens: list[int] | None = None):
        self.lo, self.hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.seq: list[int] = []
        self.latest: list[dict[tuple, int]] = [{} for _ in range(self.hi + 1)]  # by n
        self.indexed = 0  # n-grams ending before this position are in the index
        self.source: int | None = None  # where the previous draft was copied from
        self.source_at = 0  # the sequence's length then
        self.match_n = 0  # the n-gram length behind the last proposal (0: none)
        if tokens:
            self.extend(tokens)

    def extend(self, tokens) -> None:
        self.seq.extend(tokens)

    def _index(self) -> None:
        seq, last = self.seq, len(self.seq) - 1
        for end in range(self.indexed, last):
            for n in range(self.lo, min(self.hi, end + 1) + 1):
                self.latest[n][tuple(seq[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, last)

    def _copy_match(self) -> tuple[int, int]:
        """(start, n): the previous draft's source moved on, and how many tokens before it
        equal the sequence's last ones (0 when there is no previous draft)."""
        seq, L = self.seq, len(self.seq)
        if self.source is None:
            return 0, 0
        start = self.source + L - self.source_at
        n = 0
        while n < min(self.hi, start) and seq[start - 1 - n] == seq[L - 1 - n]:
            n += 1
        return start, n

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        self._index()
        seq, L = self.seq, len(self.seq)
        copy_start, copy_n = self._copy_match()
        for n in range(min(self.hi, L), self.lo - 1, -1):
            self.match_n = n
            if copy_n >= n:
                return self._take(copy_start, k)
            end = self.latest[n].get(tuple(seq[L - n :]))
            if end is not None:
                return self._take(end + 1, k)
        self.source, self.match_n = None, 0
        return []

    @property
    def strong(self) -> bool:
        """The last proposal came from a full-length match (`prompt_lookup_max` > min)."""
        return self.match_n == self.hi > self.lo

    def _take(self, start: int, k: int) -> list[int]:
        """What follows `start`; where that runs into the end of the sequence the repeat goes on
        with the drafts themselves (text that loops gets whole drafts, not a token or two)."""
        seq, L = self.seq, len(self.seq)
        out = seq[start : start + k]
        while len(out) < k:
            out.append(out[start + len(out) - L])
        self.source, self.source_at = start, L
        return out


def accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    knobs: SamplerKnobs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify k drafts against logits (k + 1, V) -> (n accepted (), tokens (k + 1,)).

    The step's output is tokens[: n + 1]: the n kept drafts, then the model's own token. With
    k = 0 this draws as `sampler.sample` does (same filters, same `draw`), except a CPU's top-k
    request, which `sample` draws over the k best alone (`top_k_draw`): the same distribution,
    another token for a seed. No host synchronisation.
    """
    k = drafts.shape[0]
    if params.greedy:
        target = argmax(logits)  # (k + 1,)
        kept = (target[:k] == drafts).long().cumprod(0).sum()
        return kept, target
    probs = filter_logits(logits, params, knobs).softmax(-1)  # (k + 1, V)
    p_draft = probs[:k].gather(1, drafts[:, None])[:, 0]  # (k,)
    u = torch.rand(k, device=logits.device, generator=generator)
    kept = (u < p_draft).long().cumprod(0).sum()
    # rows < k: the residual after rejecting the draft (`draw` takes it unnormalised);
    # row k: the bonus token's full distribution. One draw per row.
    residual = probs.clone()
    residual[:k].scatter_(1, drafts[:, None], 0.0)
    own = draw(residual, generator)  # (k + 1,)
    rows = torch.arange(k + 1, device=logits.device)
    tokens = torch.where(rows < kept, torch.cat((drafts, own[k:])), own)
    return kept, tokens


class BackOff:
    """Pauses drafting after verify steps that did not pay for themselves.

    A verify over 1 + d positions costs about 1 + `draft_cost` * d decode steps (a CPU computes
    every row: ~0.15 for the packed fp32 step; a GPU at batch 1 streams the same weights once:
    ~0.02), so one that keeps fewer than `draft_cost` * d drafts (none at all, always) yielded
    less than it cost: a miss.
    Consecutive misses pause drafting for 2, 4, 8, ... up to `max_pause` tokens of plain
    decoding; a verify that pays resets the count. `margin` > 1 asks a verify to yield that
    many times what it cost (a draft model's cost is measured at load, and underestimated).
    """

    def __init__(self, draft_cost: float = 0.0, max_pause: int = 64, margin: float = 1.0):
        self.draft_cost, self.max_pause, self.margin = draft_cost, max_pause, margin
        self.misses = 0
        self.pause = 0  # plain tokens still to go before the next draft

    def ready(self) -> bool:
        return self.pause <= 0

    def plain(self, tokens: int) -> None:
        """`tokens` were produced without a draft."""
        self.pause -= tokens

    def verified(self, drafted: int, kept: int) -> None:
        if kept > 0 and kept + 1 >= self.margin * (1 + self.draft_cost * drafted):
            self.misses = 0
            return
        self.misses += 1
        self.pause = min(2**self.misses, self.max_pause)


@dataclass
class SpecStats:
    """One request's figures: verify steps, drafted tokens, kept drafts; of those, the drafts
    copied from a predicted output (prediction.py) kept and not kept."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def add(self, drafted: int, kept: int, predicted: bool = False) -> None:
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += kept
        if predicted:
            self.accepted_prediction_tokens += kept
            self.rejected_prediction_tokens += drafted - kept

    def as_dict(self) -> dict:
        steps, drafted = self.verify_steps, self.draft_tokens
        return {
            "verify_steps": steps,
            "draft_tokens": drafted,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.accepted_tokens / drafted, 4) if drafted else None,
            "mean_accepted_per_verify": round(self.accepted_tokens / steps, 4) if steps else None,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
        }


COUNTS = ("verify_steps", "draft_tokens", "accepted_tokens", "accepted_prediction_tokens",
          "rejected_prediction_tokens")  # fmt: skip


def combine(*figures: dict | None) -> dict:
    """Several requests' (or choices') `SpecStats.as_dict()` figures as one."""
    total = SpecStats()
    for f in figures:
        if f:
            for name in COUNTS:
                setattr(total, name, getattr(total, name) + f.get(name, 0))
    return total.as_dict()
