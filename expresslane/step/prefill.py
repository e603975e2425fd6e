"""The prefill forwards: FusedPrefill (a GPU's, the residual stream fused) and StepPrefill (a
CPU's, short chunks through the packed decode step); each called like the model.

Applied to a loaded model from outside (the model stays pure math; its forward is the
reference). A prefill is the model's forward with every `h + reduce(y)` and the RMSNorm after it
replaced by one kernel (kernels/prefill_norm.py): the attention and feed-forward modules, the
embedding and the head are the model's own, so attention biases, q/k norms and quantized
projections come as they are. On a Laneformer the residual stream (S, L, D) is L times a
Llama's, and the eager norm and reduce walk it several times each (issue 24: ~13 ms of a
1,024-token prefill of the 2B on an H200).

Per layer, with the past partials kept exactly as `Laneformer.forward` keeps them:
    a     = attention(x)                     x = attention_norm(h), from the previous kernel
    h, x  = residual_norm(h, a, ffn_norm)    h + reduce(a), then ffn_norm of it
    m     = w2(silu_mul(w1(x), w3(x)))      the feed-forward's projections, one element-wise kernel
    h, x  = residual_norm(h, m, next layer's attention_norm, or none after the last layer)
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..kernels import ref, use_triton
from ..model import Block, FeedForward, Laneformer, Partials, RMSNorm
from .packed import PackedDecoder

# The longest chunk of new prompt tokens that prefills through the packed step rather than the
# model's forward, by the weights' formats: where the two crossed in `python -m
# expresslane.bench.cpu_prefill` (the 2-vCPU VM, 2 threads, SmolLM2-135M as F32, BF16, F16,
# Q8_0 and Q4_K_M; BENCHMARKS.md "Prefill on a CPU"). The forward dequantizes packed blocks on
# every call, a fixed cost a short chunk does not repay; fp32 weights have none. A mix takes
# its smallest entry; the block formats cross at 256-350 tokens.
STEP_PREFILL_MAX = {"float32": 48, "bfloat16": 128, "float16": 192}
STEP_PREFILL_MAX_DEFAULT = 256


def supports(model) -> bool:
    """A Laneformer whose forward, blocks and norms are the model's own classes' (a subclass
    with its own forward, a parallel shard, a patched block: their forward runs), with norm
    scales in the activation dtype (the kernel rounds to one dtype)."""
    if not isinstance(model, Laneformer) or type(model).forward is not Laneformer.forward:
        return False
    dtype = model.model.tok_embeddings.weight.dtype
    for block in model.model.layers:
        if not isinstance(block, Block) or type(block).forward is not Block.forward:
            return False
        if type(block.feed_forward).forward is not FeedForward.forward:
            return False
        for norm in (block.attention_norm, block.ffn_norm):
            if type(norm).forward is not RMSNorm.forward or norm.gamma.dtype != dtype:
                return False
    return True


def _hooked(model: Laneformer) -> bool:
    """Forward hooks on the model or a block (they would not run here)."""
    mods = (model, *model.model.layers)
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


class FusedPrefill:
    """Callable like the model: (tokens (B, S), positions, cache, last_only) -> logits."""

    def __init__(self, model: Laneformer, kernels: bool | None = None):
        if not supports(model):
            raise ValueError("FusedPrefill: the model's forward, blocks or norms are not its own")
        self.model = model
        w0 = model.model.tok_embeddings.weight
        self.kernels = use_triton(w0) if kernels is None else kernels
        if self.kernels:
            from ..kernels.prefill_norm import residual_norm, silu_mul  # imports triton

            self._residual_norm, self._silu_mul = residual_norm, silu_mul
        else:
            self._residual_norm, self._silu_mul = ref.residual_norm, ref.silu_mul

    def _mlp(self, ff: FeedForward, x: torch.Tensor) -> torch.Tensor:
        """FeedForward's forward with SiLU(gate) * up as one kernel; its own projections."""
        return ff.w2(self._silu_mul(ff.w1(x), ff.w3(x)))

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        model = self.model
        if _hooked(model):
            return model(tokens, positions, cache, last_only)
        layers = model.model.layers
        h, positions, cos, sin = model.embed(tokens, positions, cache)
        B, S, L, D = h.shape
        h, x = self._update(h.flatten(0, 1), None, layers[0].attention_norm)  # (B*S, L, D)
        partials = Partials(model.cfg)
        for i, block in enumerate(layers):
            pa, pm = partials.arriving(i)
            a = block.attention(x.view(B, S, L, D), cos, sin, positions, cache).flatten(0, 1)
            h, x = self._update(h, a, block.ffn_norm, block.mode, pa)
            m = self._mlp(block.feed_forward, x.view(B, S, L, D)).flatten(0, 1)
            after = layers[i + 1].attention_norm if i + 1 < len(layers) else None
            h, x = self._update(h, m, after, block.mode, pm)
            partials.keep(i, a, m)
        return model.finish(h.view(B, S, L, D), S, cache, last_only)

    def _update(self, h, y, norm: RMSNorm | None, mode: str = "present", past=None):
        """(h + reduce(y), norm of it) through the kernel, with the norm module's own
        parameters (no norm after the last layer: the head applies its own)."""
        if norm is None:
            return self._residual_norm(h, y, None, mode=mode, past=past)
        return self._residual_norm(h, y, norm.gamma, mode=mode, past=past, eps=norm.eps,
                                   round_before_scale=norm.round_before_scale)  # fmt: skip


class StepPrefill:
    """Callable like the model. A chunk of at most `max_tokens` new tokens that wants only its
    last position's logits (a prompt, or the new part of one whose prefix the cache holds: an
    agent's next turn) goes through the packed decode step (step/packed.py: the C layers read
    the weights as stored, and the cache then holds the bits decode steps write); anything else
    (longer chunks, every row's logits, explicit positions, hooks) through the model."""

    def __init__(self, model, step: PackedDecoder, max_tokens: int | None = None):
        self.model, self.step = model, step
        if max_tokens is None:
            fmts = step.weights.formats
            max_tokens = min(STEP_PREFILL_MAX.get(f, STEP_PREFILL_MAX_DEFAULT) for f in fmts)
        self.max_tokens = max_tokens

    def __call__(self, tokens, positions=None, cache=None, last_only=False) -> torch.Tensor:
        S = tokens.shape[-1]
        short = 0 < S <= self.max_tokens and tokens.shape[0] == 1
        mine = cache is self.step.cache and positions is None and not cache.static
        if not (short and mine and last_only) or _hooked(self.model):
            return self.model(tokens, positions, cache, last_only)
        logits = self.step.prefill_logits(tokens[0], cache.length)
        cache.advance(S)
        return logits.view(1, 1, -1)
