"""A request's sampling configuration: SamplingParams, its checks, and OpenAI's logit_bias.

vLLM's field names; `validate` names the field a bad value came in, so that the CLI exits 2 and
the server answers 400 with it. Greedy below GREEDY_TEMPERATURE, as vLLM's _SAMPLING_EPS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing fp32 logits by
# 1e-38 overflows to inf and the softmax turns into NaN, so such a value cannot mean anything else.
GREEDY_TEMPERATURE = 1e-5
# The largest finite fp32: the sampler's knobs are fp32 buffers, and filling one with 1e39 fails.
FP32_MAX = 3.4028234663852886e38


# SamplingParams' logits adjustments (sampler.Penalties), by the name the API gives each
ADJUSTMENTS = ("allowed_token_ids", "bad_words", "logit_bias", "min_tokens", "repetition_penalty",
               "frequency_penalty", "presence_penalty")  # fmt: skip
MAX_BAD_WORD = 64  # tokens in one of bad_words (the pick keeps that many output tokens)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's plus the top n
    skip_special_tokens: bool = True  # vLLM's default: special tokens never reach the text
    kept_special_ids: tuple[int, ...] = ()  # in the text all the same (a tool call's marker)
    spaces_between_special_tokens: bool = True
    grammar: Any = None  # a compiled grammar.Grammar: decoding is constrained to it
    # vLLM's logits adjustments (sampler.Penalties), applied before temperature in this order:
    allowed_token_ids: tuple[int, ...] = ()  # only these may be picked (empty: every token)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed (bad_word_ids)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's {token id: bias}, as pairs
    min_tokens: int = 0  # the end-of-text and stop ids masked until this many tokens
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits / p, others * p
    frequency_penalty: float = 0.0  # output tokens: minus this times their count
    presence_penalty: float = 0.0  # output tokens: minus this once
    # OpenAI's Predicted Outputs: token ids the answer is expected to repeat, drafted and
    # verified as speculation (speculative/prediction.py): the speed changes, never the tokens
    prediction: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Any of the penalties, logit_bias or min_tokens away from its neutral value."""
        return bool(self.allowed_token_ids or self.bad_words or self.logit_bias
                    or self.min_tokens or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)  # fmt: skip

    def validate(self) -> None:
        def check(ok: bool, param: str, rule: str) -> None:
            if not ok:
                raise RequestError(f"{param}={getattr(self, param)!r}: {rule}", param=param)

        check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 0,
            "max_tokens",
            "must be an integer >= 0",
        )
        check(
            math.isfinite(self.temperature) and 0 <= self.temperature <= FP32_MAX,
            "temperature",
            f"must be a finite number in [0, {FP32_MAX:.7g}] (float32)",
        )
        check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            "must be an integer >= -1 (0 or -1 turn it off)",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be an integer in [0, 20]",
        )
        self._validate_adjustments(check)
        if not all(isinstance(t, int) and t >= 0 for t in self.prediction):
            raise RequestError("prediction: must be token ids (integers >= 0)", "prediction")

    def _validate_adjustments(self, check) -> None:
        """vLLM's and OpenAI's ranges; token ids against the vocabulary: Engine.check_logit_bias."""
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            check(_number(v) and -2.0 <= v <= 2.0, name, "must be a number in [-2, 2]")
        r = self.repetition_penalty
        check(_number(r) and 0.0 < r <= FP32_MAX, "repetition_penalty",
              "must be a finite number > 0 (1: off)")  # fmt: skip
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
              "min_tokens", "must be an integer in [0, max_tokens]")  # fmt: skip
        for name in ("allowed_token_ids", "bad_words"):
            ids = [t for seq in self.bad_words for t in seq] if name == "bad_words" else \
                list(getattr(self, name))  # fmt: skip
            check(all(isinstance(t, int) and t >= 0 for t in ids), name, "token ids: integers >= 0")
        check(all(0 < len(w) <= MAX_BAD_WORD for w in self.bad_words), "bad_words",
              f"each 1 to {MAX_BAD_WORD} tokens")  # fmt: skip
        rule = "maps token ids (integers >= 0) to biases in [-100, 100]"
        for tok, bias in self.logit_bias:
            ok = isinstance(tok, int) and tok >= 0 and _number(bias) and -100 <= bias <= 100
            check(ok, "logit_bias", rule)


def logit_bias_pairs(bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias object ({"token id": bias}, keys as strings) as SamplingParams'
    sorted (id, bias) pairs; the server's field and run's --logit-bias both read it here. The
    biases' range is SamplingParams.validate's."""
    if not isinstance(bias, dict):
        raise RequestError("logit_bias: expected an object of token ids to biases", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias: key {key!r} is not a token id", "logit_bias")
        if not _number(value):
            raise RequestError(f"logit_bias: the bias of {key} is not a number", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def bad_word_ids(words: list[str], encode) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token sequences: each word as written and, where that makes other
    tokens of the same count (a word-initial token), with a leading space, so that the word is
    caught at the start of the text and after a space. `encode(text)`: ids without specials."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        for ids in (bare, spaced):
            if ids and ids not in out and (ids is bare or (len(ids) == len(bare)
                                                          and ids[0] != bare[0])):  # fmt: skip
                out.append(ids)
    return tuple(out)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
