"""One decoder layer for S <= 8 tokens of one sequence, as five fused kernels, and its reference.

h is (L, D) for one token or (S, L, D) for S consecutive tokens (token s at position + s; the
plain decode step is S = 1, a speculative verify S = k + 1); every kernel reads its weights once
for all S tokens and gives each token the bits it would get alone.

    q      = norm_qkv(h)               attention_norm, wq/wk/wv, RoPE, KV-cache write   (Hq, hd)
    o      = decode_attention(q)       over the layer's cache (ring on sliding layers)  (Hq, hd)
    h, a   = gemv_reduce(o, wo, h)     + DTP reduce + residual; a = attention partials  (L, D)
    g      = norm_swiglu(h)            ffn_norm, w1/w3, silu(gate) * up                 (L, F/L)
    h, m   = gemv_reduce(g, w2, h)     + DTP reduce + residual; m = MLP partials        (L, D)

The interface is plain tensors (no model classes), so the engine, a CUDA graph or a test can call
it directly. `weights` holds the layer's tensors under the checkpoint names: attention_norm
(D,) or (L, D), wq (L, Hq*hd/L, D), wk / wv (L, Hkv*hd/L, D), wo (L, D, Hq*hd/L), ffn_norm, w1 /
w3 (L, F/L, D), w2 (L, D, F/L); a qwen2 layer adds bq (L, Hq*hd/L), bk / bv (L, Hkv*hd/L), a
qwen3 layer q_norm / k_norm (hd,). A Llama layer is the L = 1 case with reduce_mode "present" and
rope_style "half". `past_attn` / `past_mlp` are the partials `a` / `m` returned by layer i - d
(None when the layer adds none, see ModelConfig.past_source); the caller keeps the last d.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import ref


def _decode_layer(ops, h, weights, k_cache, v_cache, pos_cache, position, cos, sin, *,
                  reduce_mode, past_attn, past_mlp, window, eps, rope_style):  # fmt: skip
    w = weights
    n_lanes = h.shape[-2]
    biases = (w["bq"], w["bk"], w["bv"]) if "bq" in w else None
    qk_norms = (w["q_norm"], w["k_norm"]) if "q_norm" in w else None
    q = ops.norm_qkv(
        h, w["attention_norm"], w["wq"], w["wk"], w["wv"], cos, sin, position,
        k_cache, v_cache, pos_cache, eps=eps, rope_style=rope_style, biases=biases,
        qk_norms=qk_norms,
    )  # fmt: skip
    o = ops.decode_attention(q, k_cache, v_cache, pos_cache, position, window=window)
    # (L, Hq*hd/L) or (S, L, Hq*hd/L): lane l owns query heads l*Hq/L .. (l+1)*Hq/L - 1
    o = o.reshape(*h.shape[:-2], n_lanes, -1)
    h, attn_partial = ops.gemv_reduce(o, w["wo"], h, past_attn, mode=reduce_mode)
    g = ops.norm_swiglu(h, w["ffn_norm"], w["w1"], w["w3"], eps=eps)  # (L, F/L)
    h, mlp_partial = ops.gemv_reduce(g, w["w2"], h, past_mlp, mode=reduce_mode)
    return h, attn_partial, mlp_partial


def _kernel_ops() -> SimpleNamespace:
    # Imported here so that importing this module never needs triton.
    from .decode_attention import decode_attention
    from .gemv_reduce import gemv_reduce
    from .norm_qkv import norm_qkv
    from .swiglu import norm_swiglu

    return SimpleNamespace(
        norm_qkv=norm_qkv,
        decode_attention=decode_attention,
        gemv_reduce=gemv_reduce,
        norm_swiglu=norm_swiglu,
    )


def fused_decode_layer(
    h: torch.Tensor,  # (L, D) or (S, L, D) residual stream entering the layer
    weights: dict[str, torch.Tensor],
    k_cache: torch.Tensor,  # (cap, Hkv, hd) this layer's keys (after RoPE)
    v_cache: torch.Tensor,  # (cap, Hkv, hd)
    pos_cache: torch.Tensor,  # (cap,) int64, -1 = empty
    position: torch.Tensor,  # (1,) int64 on the device: CUDA-graph friendly
    cos: torch.Tensor,  # (max_pos, hd/2) fp32
    sin: torch.Tensor,  # (max_pos, hd/2) fp32
    *,
    reduce_mode: str,  # "past", "present" or "no_reduce"
    past_attn: torch.Tensor | None = None,  # like h: attention partials of layer i - d
    past_mlp: torch.Tensor | None = None,  # like h: MLP partials of layer i - d
    window: int | None = None,  # sliding window W, None on full-attention layers
    eps: float = 1e-5,
    rope_style: str = "interleaved",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs the layer with the Triton kernels: returns (h, attention partials, MLP partials)."""
    return _decode_layer(
        _kernel_ops(), h, weights, k_cache, v_cache, pos_cache, position, cos, sin,
        reduce_mode=reduce_mode, past_attn=past_attn, past_mlp=past_mlp, window=window,
        eps=eps, rope_style=rope_style,
    )  # fmt: skip


def reference_decode_layer(
    h: torch.Tensor,
    weights: dict[str, torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    position: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    reduce_mode: str,
    past_attn: torch.Tensor | None = None,
    past_mlp: torch.Tensor | None = None,
    window: int | None = None,
    eps: float = 1e-5,
    rope_style: str = "interleaved",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_decode_layer built from kernels/ref.py: same arguments, same results."""
    return _decode_layer(
        ref, h, weights, k_cache, v_cache, pos_cache, position, cos, sin,
        reduce_mode=reduce_mode, past_attn=past_attn, past_mlp=past_mlp, window=window,
        eps=eps, rope_style=rope_style,
    )  # fmt: skip
