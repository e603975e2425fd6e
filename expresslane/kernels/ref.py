"""Plain-PyTorch references of every decode kernel, with the same signatures as the wrappers.

Each function here is the oracle its Triton twin is tested against, and the path the engine
takes off CUDA (see `use_triton`). Shapes are for batch 1 and one decode token:
L lanes, D hidden, hd head_dim, Hq / Hkv query / KV heads, cap cache slots, V vocab. Every
function also takes S consecutive tokens of one sequence (a leading token axis, token s at
position + s) and then is, by definition, the one-token function applied token by token in
order: the kernels must give each token's row the same bits as a launch of that token alone.

Numerics (what the kernels reproduce, rounding point for rounding point):
- RMSNorm in fp32: y = x * rsqrt(mean(x^2) + eps) * w, rounded once to x.dtype. (The HF
  LaneRMSNorm rounds before the scale multiply, a second rounding we deliberately do not copy.)
- Projections accumulate in fp32 and round once to the activation dtype.
- RoPE, softmax and the DTP sums run in fp32 with the rounding order of laneformer.md 5.6.
- LM-head logits are fp32 and never rounded to the activation dtype.

The prefill's `residual_norm` (section 7, kernels/prefill_norm.py) is the model's own math for N
tokens at once (`model.reduce`, `model.rms_norm`), including the per-lane and Llama norms'
rounding before the scale.

Tuning knobs of the wrappers (`split_k`, `num_splits`, `block_p`) are accepted and ignored here, so
that `ref` and the kernel modules are interchangeable (see decode_step.py). Every function avoids
`.item()`, so the references are also CUDA-graph capturable.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import model


# --- building blocks ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D), weight (D,) shared or (L, D) per lane -> x.dtype, computed in fp32."""
    xf = x.float()  # read L*D
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)  # write L*D


def lane_matmul(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Lane l's output is w[l] @ x[l]: w (L, O, K), x (L, K) -> (L, O) in x.dtype."""
    return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)  # read L*O*K weights


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate every head of x (H, hd) by the (1, hd/2) cos/sin row, in fp32."""
    xf = x.float()
    half = x.shape[-1] // 2
    if style == "interleaved":  # pairs (2i, 2i+1): Meta / complex convention
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
    elif style == "half":  # pairs (i, i + hd/2): HF rotate-half convention
        x0, x1 = xf[..., :half], xf[..., half:]
    else:
        raise ValueError(f"rope_style={style!r}: expected 'interleaved' or 'half'")
    o0 = x0 * cos - x1 * sin
    o1 = x0 * sin + x1 * cos
    if style == "interleaved":
        return torch.stack((o0, o1), -1).flatten(-2).to(x.dtype)
    return torch.cat((o0, o1), -1).to(x.dtype)


# --- 1. RMSNorm + Q/K/V + RoPE + KV-cache write --------------------------------------------------
def norm_qkv(
    x: torch.Tensor,  # (L, D) residual stream, before attention_norm
    norm_weight: torch.Tensor,  # (D,) or (L, D)
    wq: torch.Tensor,  # (L, Hq*hd/L, D)
    wk: torch.Tensor,  # (L, Hkv*hd/L, D)
    wv: torch.Tensor,  # (L, Hkv*hd/L, D)
    cos: torch.Tensor,  # (max_pos, hd/2) fp32
    sin: torch.Tensor,  # (max_pos, hd/2) fp32
    position: torch.Tensor,  # (1,) int64, absolute position of this token
    k_cache: torch.Tensor,  # (cap, Hkv, hd), written at slot position % cap
    v_cache: torch.Tensor,  # (cap, Hkv, hd)
    pos_cache: torch.Tensor,  # (cap,) int64, absolute position held by each slot, -1 = empty
    *,
    eps: float = 1e-5,
    rope_style: str = "interleaved",
    block_p: int | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Returns q (Hq, hd) after RoPE; writes k (after RoPE), v and the position into the cache.
    x (S, L, D): token s at position + s, q (S, Hq, hd).

    `biases` (bq, bk, bv), each (L, out/L), are added to the rounded products and rounded again
    (qwen2; the model's lane_linear). `qk_norms` (q_norm, k_norm), each (hd,), normalise every
    query and key head before RoPE, rounding before the scale as transformers' qwen3 does."""
    if x.dim() == 3:
        return torch.stack([
            norm_qkv(x[s], norm_weight, wq, wk, wv, cos, sin, position + s, k_cache, v_cache,
                     pos_cache, eps=eps, rope_style=rope_style, biases=biases, qk_norms=qk_norms)
            for s in range(x.shape[0])
        ])  # fmt: skip
    hd = k_cache.shape[2]
    xn = rms_norm(x, norm_weight, eps)  # (L, D)
    q, k, v = lane_matmul(wq, xn), lane_matmul(wk, xn), lane_matmul(wv, xn)  # (L, out/L)
    if biases is not None:
        q, k, v = (
            (y.float() + b.float()).to(y.dtype) for y, b in zip((q, k, v), biases, strict=True)
        )
    q = q.reshape(-1, hd)  # (Hq, hd): lane l owns heads l*Hq/L ...
    k = k.reshape(-1, hd)  # (Hkv, hd)
    v = v.reshape(-1, hd)  # (Hkv, hd)
    if qk_norms is not None:
        q = model.rms_norm(q, qk_norms[0].to(q.dtype), eps, round_before_scale=True)
        k = model.rms_norm(k, qk_norms[1].to(k.dtype), eps, round_before_scale=True)
    c, s = cos.index_select(0, position), sin.index_select(0, position)  # (1, hd/2)
    q, k = apply_rope(q, c, s, rope_style), apply_rope(k, c, s, rope_style)
    # Full layers have cap = max_len, so the slot is the position; sliding layers are a ring.
    slot = position % k_cache.shape[0]
    k_cache.index_copy_(0, slot, k.unsqueeze(0))
    v_cache.index_copy_(0, slot, v.unsqueeze(0))
    pos_cache.index_copy_(0, slot, position)
    return q


# --- 2. decode attention -------------------------------------------------------------------------
def decode_attention(
    q: torch.Tensor,  # (Hq, hd), RoPE applied
    k_cache: torch.Tensor,  # (cap, Hkv, hd)
    v_cache: torch.Tensor,  # (cap, Hkv, hd)
    pos_cache: torch.Tensor,  # (cap,) int64
    position: torch.Tensor,  # (1,) int64
    *,
    window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v over the valid slots, GQA head h -> KV head h // (Hq/Hkv).
    q (S, Hq, hd): token s at position + s sees the slots of positions <= position + s."""
    if q.dim() == 3:
        return torch.stack([
            decode_attention(q[s], k_cache, v_cache, pos_cache, position + s, window=window)
            for s in range(q.shape[0])
        ])  # fmt: skip
    cap, n_kv, hd = k_cache.shape
    n_q = q.shape[0]
    valid = (pos_cache >= 0) & (pos_cache <= position)  # (cap,) empty slots and the future
    if window is not None:
        valid &= pos_cache > position - window  # W keys including the query's own
    qf = q.float().view(n_kv, n_q // n_kv, hd)  # (Hkv, G, hd)
    scores = torch.einsum("hgd,nhd->hgn", qf, k_cache.float()) * hd**-0.5  # read cap*Hkv*hd
    scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a head with no valid key outputs 0
    out = torch.einsum("hgn,nhd->hgd", probs, v_cache.float())  # read cap*Hkv*hd
    return out.reshape(n_q, hd).to(q.dtype)


# --- 3. column projection + DTP reduce + residual ----------------------------------------------
def gemv_reduce(
    a: torch.Tensor,  # (L, K) per-lane input (attention heads or SwiGLU activations)
    w: torch.Tensor,  # (L, D, K) column projection (wo or w2)
    residual: torch.Tensor,  # (L, D)
    past: torch.Tensor | None,  # (L, D) partials of layer i-d ("past" mode only; None = none)
    *,
    mode: str,
    split_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (new h (L, D), fresh partial y (L, D)), y_l = w[l] @ a[l] (laneformer.md 5.2).
    With a token axis every argument but w is (S, ...), and so are both results."""
    if a.dim() == 3:
        outs = [gemv_reduce(a[s], w, residual[s], None if past is None else past[s], mode=mode)
                for s in range(a.shape[0])]  # fmt: skip
        return torch.stack([h for h, _ in outs]), torch.stack([y for _, y in outs])
    dt = residual.dtype
    y = lane_matmul(w, a)  # (L, D), read L*D*K
    n_lanes = y.shape[0]
    if mode == "present":  # every lane adds the immediate all-reduce
        out = y.float().sum(0).to(dt).expand_as(y)
    elif mode == "no_reduce":  # independent lanes, variance-compensated
        out = (y.float() * math.sqrt(n_lanes)).to(dt)
    elif mode == "past":  # own fresh partial + the other lanes' partials of layer i-d
        if past is None:
            out = y
        else:
            total = past.float().sum(0).to(dt)  # S, fp32 accumulation
            others = (total.float() - past.float()).to(dt)  # T = S - past_l
            out = (y.float() + others.float()).to(dt)  # U
    else:
        raise ValueError(f"mode={mode!r}: expected 'past', 'present' or 'no_reduce'")
    h = (residual.float() + out.float()).to(dt)
    return h, y


# --- 4. RMSNorm + gate/up + SwiGLU --------------------------------------------------------------
def norm_swiglu(
    x: torch.Tensor,  # (L, D) residual stream, before ffn_norm
    norm_weight: torch.Tensor,  # (D,) or (L, D)
    w1: torch.Tensor,  # (L, F/L, D) gate
    w3: torch.Tensor,  # (L, F/L, D) up
    *,
    eps: float = 1e-5,
) -> torch.Tensor:
    """silu(w1[l] @ norm(x)[l]) * (w3[l] @ norm(x)[l]) -> (L, F/L), or (S, L, F/L)."""
    if x.dim() == 3:
        return torch.stack([norm_swiglu(xs, norm_weight, w1, w3, eps=eps) for xs in x])
    xn = rms_norm(x, norm_weight, eps)
    return F.silu(lane_matmul(w1, xn)) * lane_matmul(w3, xn)  # read 2*L*(F/L)*D


# --- 5. final norm + LM head ------------------------------------------------------------------
def _head_input(h, norm_weight, head_type, eps, pre_norm_lane_agg):
    if head_type == "replicate":
        if pre_norm_lane_agg:  # norm of the lane sum, shared weight only
            return rms_norm(h.float().sum(0).to(h.dtype), norm_weight, eps)  # (D,)
        return rms_norm(h, norm_weight, eps).float().mean(0).to(h.dtype)  # (D,)
    if pre_norm_lane_agg:
        raise ValueError("pre_norm_lane_agg is only valid with head_type='replicate'")
    xn = rms_norm(h, norm_weight, eps)  # (L, D)
    if head_type == "lane":
        return xn.reshape(-1)  # (L*D,), lane-major concatenation
    if head_type == "vocab_parallel":
        return xn
    raise ValueError(f"head_type={head_type!r}: expected 'replicate', 'lane' or 'vocab_parallel'")


def _matvec_fp32(w: torch.Tensor, x: torch.Tensor, rows: int = 8192) -> torch.Tensor:
    """fp32 w (R, K) @ x (K,), upcasting `rows` weight rows at a time to bound the transient."""
    xf = x.float()
    return torch.cat([w[i : i + rows].float() @ xf for i in range(0, w.shape[0], rows)])


def lm_head_logits(
    h: torch.Tensor,  # (L, D) final residual stream
    norm_weight: torch.Tensor,  # (D,) or (L, D) final norm
    w: torch.Tensor,  # (V, D) replicate, (V, L*D) lane, (L, V/L, D) vocab_parallel
    *,
    head_type: str,
    eps: float = 1e-5,
    pre_norm_lane_agg: bool = False,
) -> torch.Tensor:
    """fp32 logits (V,), or (S, V) for h (S, L, D); vocab_parallel concatenates the lanes'
    slices in lane order."""
    if h.dim() == 3:
        return torch.stack([
            lm_head_logits(hs, norm_weight, w, head_type=head_type, eps=eps,
                           pre_norm_lane_agg=pre_norm_lane_agg)
            for hs in h
        ])  # fmt: skip
    x = _head_input(h, norm_weight, head_type, eps, pre_norm_lane_agg)
    if head_type == "vocab_parallel":
        return torch.cat([_matvec_fp32(w[lane], x[lane]) for lane in range(w.shape[0])])
    return _matvec_fp32(w, x)  # read V*K weights


def lm_head_argmax(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    w: torch.Tensor,
    *,
    head_type: str,
    eps: float = 1e-5,
    pre_norm_lane_agg: bool = False,
) -> torch.Tensor:
    """Greedy token (1,) int64, or (S,) for h (S, L, D); ties go to the lowest index
    (torch.argmax's rule)."""
    logits = lm_head_logits(
        h, norm_weight, w, head_type=head_type, eps=eps, pre_norm_lane_agg=pre_norm_lane_agg
    )
    return torch.argmax(logits, -1).reshape(-1)


# --- 6. plain lane-major GEMV -----------------------------------------------------------------
def lane_gemv(
    w: torch.Tensor,  # (L, O, K)
    x: torch.Tensor,  # (L, K)
    *,
    norm_weight: torch.Tensor | None = None,  # (K,) or (L, K): RMSNorm x first
    eps: float = 1e-5,
    split_k: int | None = None,
) -> torch.Tensor:
    """(L, O) = w[l] @ (norm(x[l]) or x[l]); x (S, L, K) -> (S, L, O)."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    return lane_matmul(w, x)


# --- 7. prefill: DTP reduce + residual add + the next RMSNorm ----------------------------------
def residual_norm(
    h: torch.Tensor,  # (N, L, D) residual of N tokens
    y: torch.Tensor | None,  # (N, L, D) the module's per-lane output (any strides), or None
    gamma: torch.Tensor | None,  # (D,) or (L, D) the next norm's scale, or None (no norm)
    *,
    mode: str,
    past: torch.Tensor | None = None,  # (N, L, D) partials of layer i - d ("past" mode)
    eps: float = 1e-6,
    round_before_scale: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h + reduce(y), RMSNorm of it): the model's own math (`model.reduce`, `model.rms_norm`),
    rounding point for rounding point, including the norm's rounding before the scale when the
    module has it. y None: h unchanged (the first layer's attention_norm); gamma None: no norm."""
    if y is not None:
        h = h + model.reduce(y, mode, past)
    if gamma is None:
        return h, None
    return h, model.rms_norm(h, gamma, eps, round_before_scale)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, as FeedForward computes it: silu rounded to the dtype, then the product."""
    return torch.nn.functional.silu(gate) * up
