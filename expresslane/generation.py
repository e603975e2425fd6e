"""What one generation yields and measures: `Step` (a token, its finish reason and logprobs),
`Stats` (a request's counts and times; `Stats.record` turns a sampled token into a Step), and
`reference_generate`, the naive path (no cache, the whole sequence recomputed for every token)
every fast path is compared with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .model import Laneformer
from .sampling.params import SamplingParams
from .sampling.sampler import logprobs_of, make_generator, sample


@dataclass
class Step:
    """One generated token, with its logprob data when requested."""

    token: int
    finish_reason: str | None = None  # "stop", "length" or None while going on
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    stop_string: str | None = None  # the stop string that ended the text (textgen.stream_text)


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the cache held (None: no prefill ran)
    generated_tokens: int = 0
    ttft_s: float = 0.0  # request start -> first token sampled
    decode_s: float = 0.0  # first token -> last token
    finish_reason: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.ttft_s if self.ttft_s > 0 else 0.0

    def record(
        self,
        tok: torch.Tensor | int,
        logits: torch.Tensor | None,
        params: SamplingParams,
        stops: set[int],
        last: bool,
        t0: float,
        lps: tuple[float, list | None] | None = None,
    ) -> Step:
        """A sampled token as a Step (logprobs from `logits` when given, or `lps`: already
        computed, (logprob, top n)), counted: the first sets ttft_s, each the decode time."""
        step = Step(token=int(tok))  # the one host copy per token
        now = time.perf_counter()
        if self.generated_tokens == 0:
            self.ttft_s = now - t0
        if logits is not None:
            lp, ids, vals = logprobs_of(logits, tok, params.logprobs)
            step.logprob = float(lp)
            if ids is not None:
                step.top_logprobs = list(zip(ids.tolist(), vals.tolist(), strict=True))
        elif lps is not None:
            step.logprob, step.top_logprobs = lps
        self.generated_tokens += 1
        self.decode_s = now - t0 - self.ttft_s
        step.finish_reason = "stop" if step.token in stops else "length" if last else None
        self.finish_reason = step.finish_reason
        return step


@torch.inference_mode()
def reference_generate(
    model: Laneformer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    stop_ids: set[int] | None = None,
) -> list[int]:
    """The naive path: no cache, the whole sequence recomputed for every token."""
    device = next(model.parameters()).device
    stops = set(model.cfg.eos_token_ids) if stop_ids is None else stop_ids
    gen = make_generator(params, device)
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(params.max_tokens):
        logits = model(torch.tensor([ids], device=device))[0, -1]
        tok = int(sample(logits, params, gen))
        out.append(tok)
        ids.append(tok)
        if tok in stops:
            break
    return out
