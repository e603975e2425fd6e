"""Logits -> next token on the model's device: greedy, temperature, top-k, top-p, min-p.

Sampling draws with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which equals a
multinomial draw and needs no host round trip; the noise comes from a per-request
torch.Generator on the logits' device, so the same seed gives the same tokens.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks; logits (..., V) in fp32."""
    x = logits.float() / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token once the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return x


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """logits (..., V) -> token ids (...,) as a device tensor (no host synchronisation)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, params).softmax(-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(-1)


def logprobs_of(logits: torch.Tensor, token: torch.Tensor, top_n: int):
    """(chosen token's logprob, top-n ids, top-n logprobs) from raw logits (V,)."""
    lp = logits.float().log_softmax(-1)
    top = torch.topk(lp, top_n) if top_n > 0 else None
    return (lp[token], None if top is None else top.indices, None if top is None else top.values)
