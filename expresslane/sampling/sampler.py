"""Logits -> next token on the model's device: greedy, temperature, top-k, top-p, min-p, and
a grammar's token mask (packed bits in a static buffer, `apply_token_mask`); before them, a
request's logit_bias, min_tokens and penalties (`Penalties`, with its counts on the device).

A draw (`draw`) needs no host round trip. On a GPU it is the exponential race (argmax of p / E,
E ~ Exp(1)): elementwise, so it captures into a graph. On the CPU it is the inverse CDF with one
uniform a row: torch's CPU `exponential_` measured 876 us for a 49,152-token vocabulary, a fifth
of a SmolLM2 decode step, the CDF 79 us (2026-12-06, the VM). Both are exact draws from the same
distribution, not the same token for a seed. The randomness comes from a per-request
torch.Generator on the logits' device, so the same seed gives the same tokens on a device.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import RequestError
from .params import ADJUSTMENTS, MAX_BAD_WORD, SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def on_host(x: torch.Tensor) -> bool:
    """Does x take the CPU's fast paths (numpy, host loops)? Not on a GPU, and not while
    torch.compile traces: those keep the elementwise, capture-safe references."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1): the first maximum of each row, as a tensor on x's device. On the CPU (fp32)
    through numpy: torch's CPU argmax measured 65 us over a 49,152-token vocabulary and 316 us
    over 5 rows, numpy's 5 us (2026-12-06, the VM), and a greedy token takes one a token (a
    verify one a row). Both take the first of equal maxima and a NaN as the maximum."""
    if not on_host(x) or x.dtype != torch.float32:
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(np.argmax(x.detach().numpy(), axis=-1)))


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of non-negative weights (..., V), drawn in proportion to them (a row
    need not sum to 1; a zero weight is never drawn), on the weights' device (module docstring:
    the race on a GPU, the inverse CDF on the CPU)."""
    if not on_host(weights):
        return race(weights, generator)
    u = torch.rand((*weights.shape[:-1], 1), generator=generator, dtype=torch.float64)
    cdf = weights.double().cumsum(-1)  # fp64: tail tokens keep their mass over a large vocabulary
    total = cdf[..., -1:].contiguous()  # (..., 1)
    at = torch.searchsorted(cdf, u * total, right=True)  # the first index whose cdf passes u
    # u * total may round up to total: the last token of positive weight, never a zero one
    return torch.minimum(at, torch.searchsorted(cdf, total)).squeeze(-1)


def race(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """`draw` as the exponential race, argmax of w / E with E ~ Exp(1) per entry: elementwise
    and capture-safe (a GPU's draw; the CPU's reference)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return argmax(weights / noise)


class SamplerKnobs:
    """Temperature, top-p and min-p as (1,) device tensors, for a captured decode graph.

    A CUDA graph freezes Python floats into its kernels' arguments. With the continuous settings
    in buffers one captured graph serves every value (a server sees a new temperature on every
    other request, and each capture costs a warm-up and a memory pool), so the graph is keyed
    only by the step's structure (`structure_key`). The arithmetic is the float path's: the
    scalar would be rounded to fp32 the same way, so the same seed gives the same tokens.
    """

    def __init__(self, device: torch.device | str):
        self.temperature = torch.ones(1, device=device)
        self.top_p = torch.ones(1, device=device)
        self.min_p = torch.zeros(1, device=device)
        # a grammar's allowed tokens as packed bits (W,) int32, or None: the host writes the
        # next mask into it while the device runs the forward (grammar.py, structured.py)
        self.token_mask: torch.Tensor | None = None

    def with_token_mask(self, words: int) -> SamplerKnobs:
        """Give the pick a static token-mask buffer of `words` int32 (32 tokens each)."""
        dev = self.temperature.device
        self.token_mask = torch.full((words,), -1, dtype=torch.int32, device=dev)
        return self

    def load(self, params: SamplingParams) -> None:
        """Set the buffers for a request (three fills on the device, no synchronisation)."""
        self.temperature.fill_(1.0 if params.greedy else params.temperature)
        self.top_p.fill_(params.top_p)
        self.min_p.fill_(params.min_p)


def check_adjustments(params: SamplingParams, vocab_size: int, supported: bool,
                      stops: set[int] | frozenset = frozenset()) -> None:  # fmt: skip
    """What SamplingParams.validate cannot know: logit_bias's ids against the vocabulary, and
    the adjustments' combinations: refused on an engine whose pick takes none (`supported`
    False: the vocab-parallel one). Decided: with a grammar, min_tokens is refused (the grammar
    decides where the output ends: one that allows only the end of text, min_tokens unmet, would
    leave no token); the others apply before the grammar's mask."""
    if not params.adjusts_logits:
        return
    neutral = SamplingParams()
    name = next(n for n in ADJUSTMENTS if getattr(params, n) != getattr(neutral, n))
    if not supported:
        raise RequestError(f"{name}: not supported by this engine (several devices)", name)
    if params.grammar is not None and params.min_tokens:
        why = "min_tokens: not supported with structured output (the grammar ends the output)"
        raise RequestError(why, "min_tokens")
    if params.grammar is not None and (params.allowed_token_ids or params.bad_words):
        name = "allowed_token_ids" if params.allowed_token_ids else "bad_words"
        raise RequestError(f"{name}: not supported with structured output (a token the grammar "
                           "needs may be the one masked: a dead end)", name)  # fmt: skip
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                      ("allowed_token_ids", params.allowed_token_ids),
                      ("bad_words", [t for seq in params.bad_words for t in seq])):  # fmt: skip
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            why = f"{name}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
            raise RequestError(why, name)
    if params.allowed_token_ids and not _some_left(params, stops):
        raise RequestError("allowed_token_ids: bad_words (and min_tokens, which holds the stop "
                           "ids back) leave no token to pick", "allowed_token_ids")  # fmt: skip


def _some_left(params: SamplingParams, stops) -> bool:
    """Does a token stay allowed whatever bad_words (each may mask its last token) and
    min_tokens (the stop ids, `stops`) hold back?"""
    masked = {seq[-1] for seq in params.bad_words} | (set(stops) if params.min_tokens else set())
    return bool(set(params.allowed_token_ids) - masked)


class Penalties:
    """One request's logits adjustments, vLLM's in vLLM's order: allowed_token_ids (the others
    at -inf), bad_words (a sequence's last token at -inf where the output ends with the rest of
    it), logit_bias, then min_tokens
    (end-of-text and stop ids at -inf until that many tokens), then the repetition penalty
    (tokens of the prompt or the output: a positive logit divided by it, another multiplied,
    as transformers' RepetitionPenaltyLogitsProcessor), then the frequency penalty (times each
    output token's count) and the presence penalty (once per output token), all before the
    temperature. The counts live on the logits' device and `advance` adds a picked token there,
    so a step needs no host copy of them."""

    def __init__(self, params: SamplingParams, prompt_ids, vocab_size: int, stop_ids,
                 device: torch.device):  # fmt: skip
        self.params, self.generated = params, 0
        self.counts = torch.zeros(vocab_size, device=device)  # each output token's count
        self._one = torch.ones(1, device=device)  # what `advance` adds: no allocation a step
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # prompt or output
        if params.repetition_penalty != 1.0 and len(prompt_ids):
            self.seen[torch.tensor(list(prompt_ids), device=device)] = True
        self.bias = None
        if params.logit_bias:
            ids, values = zip(*params.logit_bias, strict=True)
            self.bias = torch.zeros(vocab_size, device=device)
            self.bias[torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
        stops = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        self.stops = torch.tensor(stops, dtype=torch.long, device=device) if stops else None
        # one mask for allowed_token_ids and one-token bad words; longer bad words need the
        # output's last tokens on the host (`history`, kept only for them)
        self.banned = None
        if params.allowed_token_ids or any(len(w) == 1 for w in params.bad_words):
            self.banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if params.allowed_token_ids:
                self.banned.fill_(True)
                self.banned[torch.tensor(params.allowed_token_ids, device=device)] = False
            for w in params.bad_words:
                if len(w) == 1:
                    self.banned[w[0]] = True
        self.sequences = [w for w in params.bad_words if len(w) > 1]
        self.history: list[int] = []

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids, vocab_size: int, stop_ids,
           device: torch.device) -> Penalties | None:  # fmt: skip
        """A request's adjustments, or None where it asks for none."""
        return (
            cls(params, prompt_ids, vocab_size, stop_ids, device) if params.adjusts_logits else None
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (..., V) -> adjusted fp32 logits (a new tensor)."""
        p, x = self.params, logits.float()
        if self.banned is not None:
            x = x.masked_fill(self.banned, float("-inf"))
        if self.sequences:
            last = [w[-1] for w in self.sequences if list(w[:-1]) == self.history[1 - len(w) :]]
            if last:
                x = x.index_fill(-1, torch.tensor(last, device=x.device), float("-inf"))
        if self.bias is not None:
            x = x + self.bias
        if self.generated < p.min_tokens and self.stops is not None:
            x = x.index_fill(-1, self.stops, float("-inf"))
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            x = torch.where(self.seen, torch.where(x > 0, x / r, x * r), x)
        if p.frequency_penalty:
            x = x - p.frequency_penalty * self.counts
        if p.presence_penalty:
            x = x - p.presence_penalty * (self.counts > 0)
        return x

    def advance(self, token: torch.Tensor | int) -> None:
        """Count a picked token (a device tensor: no host copy)."""
        t = torch.as_tensor(token, device=self.counts.device).view(1)
        self.counts.index_add_(0, t, self._one)
        self.seen.index_fill_(0, t, True)
        self.generated += 1
        if self.sequences:  # a host copy, for requests with bad words of several tokens only
            self.history = [*self.history[-MAX_BAD_WORD:], int(t)]

    def apply_rows(self, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """A verify's logits (k + 1, V) adjusted row by row: row j as if drafts[:j] had been
        picked (what a plain step would see there); the state is left as it was."""
        saved = self.counts, self.seen, self.generated, self.history
        self.counts, self.seen = self.counts.clone(), self.seen.clone()
        try:
            out = []
            for j in range(rows.shape[0]):
                out.append(self.apply(rows[j]))
                if j < len(drafts):
                    self.advance(drafts[j])
            return torch.stack(out)
        finally:
            self.counts, self.seen, self.generated, self.history = saved


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """-inf where a token's bit is 0: logits (..., V), words (..., W) int32, bit j of word w
    for token 32 w + j (llguidance's and xgrammar's layout). On the device, no host sync."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (..., W, 32)
    allowed = bits.flatten(-2)[..., : logits.shape[-1]].bool()  # (..., V)
    return logits.masked_fill(~allowed, float("-inf"))


def structure_key(params: SamplingParams) -> tuple:
    """What changes the sampling step's ops (and so needs its own graph); values do not."""
    return (params.greedy, params.top_k, params.top_p < 1.0, params.min_p > 0.0)


def top_p_sorted(x: torch.Tensor, top_p) -> torch.Tensor:
    """x (..., V) with -inf where top-p drops a token: in descending order, a token is dropped
    once the mass before it reaches top_p. One sort of the vocabulary, no host sync (a GPU's;
    the CPU's reference)."""
    order = torch.sort(x, dim=-1, descending=True)[1]
    # the softmax of x as it comes, then in that order: a softmax of the sorted row sums in
    # another order (other bits), which top_p_candidates, reading x's, could not match
    probs = x.softmax(-1).gather(-1, order)
    # the first always stays, also when a tiny top_p rounds to 0 in fp32 (everything masked
    # would sample NaN). fill_, not `drop[..., 0] = False`: on CUDA that assignment copies a
    # host scalar, which a graph capture refuses (tests/test_capture_safe.py)
    drop = (probs.cumsum(-1) - probs) >= top_p
    drop[..., 0].fill_(False)
    return x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def top_p_candidates(x: torch.Tensor, top_p) -> torch.Tensor:
    """top_p_sorted's result, sorting only the tokens that can stay (the CPU's: the sort of a
    49,152-token vocabulary measured 2.8 ms a token, most of a SmolLM2 step; SmolLM2 had 273
    candidates at top_p 0.9). A token of probability under (1 - top_p) / 2V is always dropped:
    all such tokens together hold less than (1 - top_p) / 2, so the larger ones before them
    already hold more than top_p. Near top_p = 1 that margin is within rounding, and the whole
    vocabulary is sorted."""
    keep_p, V = float(top_p), x.shape[-1]
    if keep_p > 1.0 - 1e-4:
        return top_p_sorted(x, top_p)
    rows = x.reshape(-1, V)  # (R, V)
    probs = rows.softmax(-1).numpy()  # numpy: torch's CPU nonzero took 100 us, its sort 3 ms
    out = torch.full_like(rows, float("-inf"))
    for r in range(rows.shape[0]):
        cand = np.flatnonzero(probs[r] >= (1.0 - keep_p) / (2 * V))  # (C,)
        if cand.size == 0:  # a row of NaN: the reference's answer, whatever it is
            return top_p_sorted(x, top_p)
        order = np.argsort(-probs[r, cand])
        p = probs[r, cand[order]]  # descending, fp32
        # torch's fp32 cumsum adds in fp64 and rounds each sum to fp32; then fp32's difference
        mass = np.cumsum(p.astype(np.float64)).astype(np.float32) - p
        keep = mass < np.float32(keep_p)
        keep[0] = True
        at = torch.from_numpy(cand[order[keep]])
        out[r, at] = rows[r, at]
    return out.view_as(x)


def filter_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    knobs: SamplerKnobs | None = None,
    top_k: bool = True,
) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks; logits (..., V) in fp32.

    `params` decides which filters run; `knobs`, when given, supplies their values. `top_k`
    False: the logits are already the top k (`top_k_draw`).
    """
    temperature, top_p, min_p = params.temperature, params.top_p, params.min_p
    if knobs is not None:
        temperature, top_p, min_p = knobs.temperature, knobs.top_p, knobs.min_p
    x = logits.float() / temperature
    V = x.shape[-1]
    if top_k and 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        x = (top_p_candidates if on_host(x) else top_p_sorted)(x, top_p)
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return x


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    knobs: SamplerKnobs | None = None,
) -> torch.Tensor:
    """logits (..., V) -> token ids (...,) as a device tensor (no host synchronisation)."""
    if knobs is not None and knobs.token_mask is not None:
        logits = apply_token_mask(logits, knobs.token_mask)
    if params.greedy:
        return argmax(logits)
    if on_host(logits) and 0 < params.top_k < logits.shape[-1]:
        picked = top_k_draw(logits, params, knobs, generator)
        if picked is not None:
            return picked
    return draw(filter_logits(logits, params, knobs).softmax(-1), generator)


def top_k_draw(logits: torch.Tensor, params: SamplingParams, knobs: SamplerKnobs | None,
               generator: torch.Generator | None) -> torch.Tensor | None:  # fmt: skip
    """`sample` of a top-k request over the k best tokens alone (the CPU's: the filters and the
    draw over the whole vocabulary measured 300 us a token, topk alone 82 us): the same
    distribution, as the other tokens have probability 0. None where a token ties with the
    k-th (the whole-vocabulary path keeps every tie) or fewer than k are finite."""
    x = logits.float()
    best, at = torch.topk(x, params.top_k, dim=-1)  # (..., k), descending
    if bool(((x >= best[..., -1:]).sum(-1) > params.top_k).any()):
        return None
    pick = draw(filter_logits(best, params, knobs, top_k=False).softmax(-1), generator)
    return at.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


def logprobs_of(logits: torch.Tensor, token: torch.Tensor, top_n: int):
    """(chosen token's logprob, top-n ids, top-n logprobs) from raw logits (V,), as device
    tensors; `token` an int or a device tensor, read with `take`: `lp[token]` would read a
    0-dim tensor index on the host (a sync)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp[token] if isinstance(token, int) else lp.take(token)
    if top_n <= 0:
        return chosen, None, None
    top = torch.topk(lp, top_n)
    return chosen, top.indices, top.values
