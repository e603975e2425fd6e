"""The decode step assembled from the fused kernels: S <= 8 tokens through every layer and the head.

Applied to a loaded model from outside (the model stays pure math): the layer weights are taken
by reference, in the checkpoint's lane-major layout, and each layer runs as five kernels
(kernels/decode_step.py). On CUDA with triton the Triton kernels run; elsewhere their
plain-PyTorch twins from kernels/ref.py, so the same wiring is checked on any machine. The KV
cache is the engine's static cache; positions live on the device only, so a CUDA graph can
capture `next_token` (width 1) or `forward` (width k + 1, a speculative verify) whole. The
kernels are batch-invariant: row j of `forward` is the bits of a decode step of token j, so
greedy speculation on the GPU is plain greedy decoding exactly.
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..kernels import MAX_TOKENS, decode_step, ref, use_triton
from ..model import Laneformer, Partials
from ..rope import cos_sin
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, sample

# The most steps one CUDA-graph replay may run (Engine checks steps_per_replay against it).
MAX_OVERRUN = 64


def supports(model: Laneformer) -> bool:
    """The kernels cover everything but quantized projections (kernels/qlinear.py: those decode
    through the graph of the model's forward)."""
    return getattr(model, "gpu_quantization", None) is None


def layer_weights(block) -> dict[str, torch.Tensor]:
    """A decoder block's tensors under decode_step's names, by reference: qwen2's biases and
    qwen3's q/k norms only where the model has them."""
    att = block.attention
    w = {
        "attention_norm": block.attention_norm.gamma,
        "wq": att.wq.weight,
        "wk": att.wk.weight,
        "wv": att.wv.weight,
        "wo": att.wo.weight,
        "ffn_norm": block.ffn_norm.gamma,
        "w1": block.feed_forward.w1.weight,
        "w3": block.feed_forward.w3.weight,
        "w2": block.feed_forward.w2.weight,
    }
    if att.wq.bias is not None:
        w.update(bq=att.wq.bias, bk=att.wk.bias, bv=att.wv.bias)
    if getattr(att, "q_norm", None) is not None:
        w.update(q_norm=att.q_norm.gamma, k_norm=att.k_norm.gamma)
    return w


def check_width(cache: KVCache, S: int, step: str) -> None:
    """S tokens in one forward of the kernels' steps: at most MAX_TOKENS, and no more than a
    ring's headroom lets it write (cache.forward_room)."""
    if S > MAX_TOKENS:
        raise ValueError(f"{S} tokens: {step} takes at most {MAX_TOKENS}")
    room = cache.forward_room()  # a ring must keep token 0's window to the last write
    if room is not None and S > room:
        raise ValueError(f"{S} tokens need a KV cache with headroom >= {S - 1} on its "
                         f"sliding layers (it has room for {room})")  # fmt: skip


class FusedDecoder:
    def __init__(self, model: Laneformer, cache: KVCache, kernels: bool | None = None):
        if not supports(model):
            raise ValueError("the fused decode step does not cover quantized projections")
        cfg = model.cfg
        self.cfg, self.cache = cfg, cache
        w0 = model.model.tok_embeddings.weight
        self.kernels = use_triton(w0) if kernels is None else kernels
        self.layer_fn = (
            decode_step.fused_decode_layer if self.kernels else decode_step.reference_decode_layer
        )
        self.embed = w0
        self.layers = [layer_weights(b) for b in model.model.layers]
        self.final_norm = model.model.norm.gamma
        head = cfg.lm_head_type
        self.head_w = (
            model.lm_head.linear.weight
            if head == "lane"
            else model.lm_head.weight
            if head == "vocab_parallel" or not cfg.tie_word_embeddings
            else w0
        )
        # A multi-step replay may run up to MAX_OVERRUN positions past the budget (tokens that are
        # then discarded); the tables cover them so the kernels never read past their end.
        positions = torch.arange(cache.max_len + MAX_OVERRUN, device=w0.device)
        self.cos, self.sin = cos_sin(model.inv_freq, positions)  # (max_len + slack, hd/2) fp32
        self.cos, self.sin = self.cos.contiguous(), self.sin.contiguous()

    def hidden(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """tokens (S,) (any shape of S elements) at position (1,) onwards -> final residual
        streams (S, L, D); writes their KV. Every kernel reads its weights once for the S tokens,
        and row j is the bits a lone step of token j would give (batch-invariant kernels)."""
        cfg, cache = self.cfg, self.cache
        L, D = cfg.num_lanes, cfg.hidden_size
        S = tokens.numel()
        h = self.embed[tokens.view(S)].unsqueeze(1).expand(S, L, D).contiguous()  # (S, L, D)
        partials = Partials(cfg)
        for i, w in enumerate(self.layers):
            past_attn, past_mlp = partials.arriving(i)
            h, a, m = self.layer_fn(
                h,
                w,
                cache.k[i],
                cache.v[i],
                cache.pos[i],
                position,
                self.cos,
                self.sin,
                reduce_mode=cfg.reduce_mode(i),
                past_attn=past_attn,
                past_mlp=past_mlp,
                window=cfg.window(i),
                eps=cfg.norm_eps,
                rope_style=cfg.rope_style,
            )
            partials.keep(i, a, m)
        return h

    def _head(self, fn_name: str, h: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            from ..kernels import lm_head

            fn = getattr(lm_head, fn_name)
        else:
            fn = getattr(ref, fn_name)
        return fn(
            h,
            self.final_norm,
            self.head_w,
            head_type=self.cfg.lm_head_type,
            eps=self.cfg.norm_eps,
            pre_norm_lane_agg=self.cfg.pre_norm_lane_agg,
        )

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The `Step`: tokens (S,), S <= MAX_TOKENS, from position (1,) -> fp32 logits (S, V).
        One pass of every kernel for all S rows; row j equals a decode step of token j."""
        check_width(self.cache, tokens.numel(), "the fused step")
        return self._head("lm_head_logits", self.hidden(tokens, position))

    def pick(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Greedy token after each of tokens (S,): (S,) int64, no logits materialised."""
        return self._head("lm_head_argmax", self.hidden(tokens, position))

    def next_token(
        self,
        tokens: torch.Tensor,
        position: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        knobs: SamplerKnobs | None = None,
    ) -> torch.Tensor:
        """The sampled token after the last of `tokens` (S,), a 0-d device tensor; greedy never
        materialises logits."""
        h = self.hidden(tokens, position)[-1:]  # (1, L, D): the rows before only wrote the KV
        if params.greedy:
            return self._head("lm_head_argmax", h).view(())
        return sample(self._head("lm_head_logits", h)[0], params, generator, knobs)
