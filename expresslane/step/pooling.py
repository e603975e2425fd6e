"""A prompt's pooled final hidden state: what /v1/embeddings returns (serve/embeddings.py).

`pooled(engine, ids, how, cancel)` prefills the input into the engine's KV cache from position 0,
by the prompt's own way where it has one, and pools what the LM head would read
(Laneformer.head_input): the last position's, or every position's mean. The cache then holds the
input as a scoring prefill leaves it (committed, the rings snapshotted), so prefix reuse stays
coherent. The engine is taken by duck type (model, cache, prefix, prefill_forward, device,
prefill_chunk): this module sits below engine.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..weights.packed_modules import products_in
from .native import native_dequantize
from .prefill import StepPrefill


@torch.inference_mode()
def pooled(engine, ids: list[int], how: str, cancel) -> torch.Tensor | None:
    """The input's vector, fp32 on the CPU, not yet normalised (the engine thread's work); None
    when cancelled between chunks."""
    engine.cache.reset()
    total = last = None
    for h in _streams(engine, ids):
        z = engine.model.head_input(h[None])[0].float()  # (S, E)
        total = z.sum(0) if total is None else total + z.sum(0)
        last = z[-1]
        if cancel is not None and cancel.is_set():
            return None
    engine.prefix.prefilled()  # the rings as a prompt's prefill leaves them
    return (total / len(ids) if how == "mean" else last).cpu()


def _streams(engine, ids: list[int]):
    """The final residual streams (S, L, D) of the input, chunk by chunk, each written to the
    cache and committed, by the prompt's own way where it has one: on a CPU with the packed
    step, a short input through its C layers (StepPrefill's bound: 3x faster than the model's
    layers at 64 tokens on SmolLM2), a longer one through the model's layers with the C
    decoder's weights; elsewhere the model's layers."""
    model, cache, pre = engine.model, engine.cache, engine.prefill_forward
    packed = isinstance(pre, StepPrefill) and pre.step.step is not None
    if packed and len(ids) <= pre.max_tokens:
        h = pre.step.prefill_hidden(torch.tensor(ids), 0)
        cache.advance(len(ids))
        cache.commit(ids)  # before the yield: a cancel there leaves it committed
        yield h
        return
    tokens = torch.tensor(ids, device=engine.device, dtype=torch.long)[None]
    for s in range(0, len(ids), engine.prefill_chunk):
        chunk = tokens[:, s : s + engine.prefill_chunk]
        with products_in(pre.products, native_dequantize) if packed else nullcontext():
            h = model.hidden(chunk, None, cache)[0]
        cache.advance(chunk.shape[1])
        cache.commit(ids[s : s + chunk.shape[1]])
        yield h
