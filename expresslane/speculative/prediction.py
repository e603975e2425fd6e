"""Predicted Outputs (OpenAI's `prediction`): drafts copied from text the client expects the
answer to repeat (a file it asks to edit), verified exactly as prompt-lookup drafts are.

`PredictionDrafter` keeps an alignment: the index in the prediction of the token the output is
expected to produce next. From the first token on, while the output follows the prediction,
each draft is the prediction's next k tokens: no n-gram has to repeat first, as prompt lookup
needs. Where the output leaves the prediction (the edit), the alignment is lost; the drafter
then looks for the output's last n tokens (n from `ALIGN_MAX` down to `ALIGN_MIN`) in the
prediction, the first occurrence at or after the place the output left it (an edit moves
forward through a file), else the latest before, and drafts from there. Without a match it asks
the fallback drafter (prompt lookup, when the engine was started with `--speculative-config`),
else it drafts nothing and the step is a plain one.

Verification is the speculative decoder's: greedy output is plain greedy output token for
token, and sampled output keeps the model's distribution, whatever the prediction says. A
prediction only changes the speed.

Counted as OpenAI counts (`usage.completion_tokens_details`): accepted prediction tokens are
drafts from the prediction that the model kept; rejected ones are drafts from the prediction it
did not keep. Prediction tokens never drafted (after the answer ended, or skipped by an
alignment) count in neither: they cost nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import RequestError
from .drafting import NgramDrafter

# The n-gram lengths that re-align the output with the prediction after an edit. Two tokens: a
# one-token match (a newline, a space) points anywhere in a file; the search prefers the place
# after the edit, where two tokens are rarely wrong (a miss costs one verify step).
ALIGN_MIN, ALIGN_MAX = 2, 8


class PredictionDrafter:
    """Drafts from `prediction` (token ids); `fallback`: another drafter with the same
    interface (extend, propose, strong) asked where the prediction has nothing, or None."""

    cost = None  # the back-off counts a verify row's cost (drafting.NgramDrafter.cost)

    def __init__(self, prediction: Sequence[int], fallback=None):
        self.pred = list(prediction)
        self.fallback = fallback
        self.out: list[int] = []  # the output so far (the first token on)
        self.at: int | None = 0  # the prediction's index of the next expected token; None: lost
        self.left_at = 0  # where the output last left the prediction (the re-alignment's start)
        self.from_prediction = False  # did the last proposal come from the prediction?
        self.followed = 0  # output tokens in a row that match the prediction where aligned
        self.ends: dict[tuple, list[int]] = {}  # n-gram -> its end indices (exclusive), ascending
        for n in range(ALIGN_MIN, ALIGN_MAX + 1):
            for end in range(n, len(self.pred) + 1):
                self.ends.setdefault(tuple(self.pred[end - n : end]), []).append(end)

    def extend(self, tokens: Sequence[int]) -> None:
        """The output's new tokens (the first one too: the drafter starts before any)."""
        for t in tokens:
            self.out.append(t)
            if self.at is not None and self.at < len(self.pred) and self.pred[self.at] == t:
                self.at += 1
                self.followed += 1
            elif self.at is not None:
                self.left_at, self.at, self.followed = self.at, None, 0
        if self.fallback is not None:
            self.fallback.extend(tokens)

    def _align(self) -> int | None:
        """The prediction's index after the longest match of the output's last tokens."""
        for n in range(min(ALIGN_MAX, len(self.out)), ALIGN_MIN - 1, -1):
            ends = self.ends.get(tuple(self.out[-n:]))
            if ends:
                ahead = [e for e in ends if e >= self.left_at]
                self.followed = n
                return ahead[0] if ahead else ends[-1]
        return None

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        if self.at is None:
            self.at = self._align()
        if self.at is not None and self.at < len(self.pred):
            self.from_prediction = True
            return self.pred[self.at : self.at + k]
        self.from_prediction = False
        return self.fallback.propose(k) if self.fallback is not None else []

    @property
    def strong(self) -> bool:
        """Drafting from the prediction where the output has followed it for ALIGN_MAX tokens
        (a back-off pause does not stop such drafts), or the fallback's full-length match. A
        re-alignment on a few tokens is not strong: on text that only shares short phrases with
        the prediction (a log's dates), its drafts missed, and the pauses keep that cheap."""
        if self.from_prediction:
            return self.followed >= ALIGN_MAX
        return self.fallback is not None and self.fallback.strong


def drafter_for(cfg, prompt_ids: Sequence[int], prediction: Sequence[int], own=None):
    """The request's drafter: `own` (a draft model's) or prompt lookup over the prompt when the
    engine speculates (`cfg` the engine's config, or None), drafts from the prediction first
    when there is one. The first generated token is extended by the caller."""
    lookup = own
    if lookup is None and cfg is not None:
        lookup = NgramDrafter(cfg, list(prompt_ids))
    return PredictionDrafter(prediction, lookup) if prediction else lookup


def check_prediction(params, vocab_size: int, supported: bool = True) -> None:
    """What SamplingParams.validate cannot know: the vocabulary, and the engine's support."""
    if params.prediction and not supported:
        raise RequestError("prediction: not supported by this engine (several devices) yet",
                           param="prediction")  # fmt: skip
    if params.prediction and max(params.prediction) >= vocab_size:
        why = f"prediction: a token id is outside the vocabulary [0, {vocab_size})"
        raise RequestError(why, param="prediction")
