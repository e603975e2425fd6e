"""What a decode step is: S >= 1 tokens of one sequence in, (S, V) logits out; and its reference.

A `Step` scores tokens (S,) at positions position .. position + S - 1 against its KV cache,
writing their keys and values: S = 1 is a decode step, S = k + 1 the verify step of
speculative decoding. Row j depends only on the tokens up to j and the cache, never on S: every
peer computes each row in an order that does not depend on S (batch-invariant), so a verify's
rows are the bits of S single steps and greedy speculation is plain greedy decoding exactly.

`next_token` is the pick on the device after the last row (greedy: the argmax; otherwise
`sampler.sample` with the knobs in device buffers); a peer may fuse it into its head (the
fused GPU step never materialises logits for greedy). `position` is a (1,) device tensor, so a
captured graph (graph.py) replays the step at any position. A peer may also offer
`forward_shared`, the same logits in a buffer of its own, valid until its next call, for callers
that read them at once (split.forward_logits: a grammar's pick, a request's logprobs); the packed
CPU step's head buffer saves a copy of the vocabulary's logits per token there.

The peers: `EagerStep` here (the model's own forward: the reference), the packed CPU step on
packed weights with its C layers (packed.py, native.py) and the fused GPU step (fused.py);
choose.py picks one from the model, the cache and the options.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..cache import KVCache
from ..model import Laneformer
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, sample


class Step(Protocol):
    cache: KVCache

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """tokens (S,) at position (1,) onwards -> fp32 logits (S, V); writes their KV."""
        ...

    def next_token(
        self,
        tokens: torch.Tensor,
        position: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        knobs: SamplerKnobs | None = None,
    ) -> torch.Tensor:
        """The token after the last of `tokens`, a 0-d device tensor."""
        ...


class EagerStep:
    """The model's own forward as a step: the reference every other peer is checked against.

    In a decode graph the cache runs static (positions from the device, slots bounded by
    `live`); outside one it advances the cache's host count like any forward."""

    def __init__(self, model: Laneformer, cache: KVCache):
        self.model, self.cache = model, cache

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        S = tokens.numel()
        positions = position.view(1) + torch.arange(S, device=position.device)  # (S,)
        return self.model(tokens.view(1, S), positions=positions, cache=self.cache)[0].float()

    def next_token(self, tokens, position, params, generator, knobs=None) -> torch.Tensor:
        return sample(self.forward(tokens, position)[-1], params, generator, knobs)
