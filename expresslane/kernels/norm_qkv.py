"""Attention prologue in one kernel: RMSNorm -> Q/K/V projection -> RoPE -> KV-cache write.

For S <= 8 consecutive tokens of one sequence (token s at position + s), lane l computes
xn = attention_norm(h[l]) and q/k/v = wq/wk/wv[l] @ xn, rotates q and k by the position's RoPE
angles, and appends k and v to the cache. Each weight tile is read once for all S tokens, and
each token's row is accumulated in the same order whatever S is (batch invariance). Unfused that
is a norm kernel, three GEMVs, two RoPE kernels and two cache copies; here it is one pass over
wq, wk, wv (the only bytes that matter: L*(Hq + 2*Hkv)*hd*D weights) with a tiny prologue.

Work split. RoPE rotates pairs of rows of the same head: interleaved (Laneformer, Meta) pairs
(2i, 2i+1), half (Llama, HF) pairs (i, i + hd/2). A program therefore owns BLOCK_P pairs of one
head: it streams both rows of every pair, so the rotation needs nothing from other programs.
BLOCK_P divides hd/2, so a program never straddles a head, and the per-lane "pair blocks" are laid
out q heads, then k heads, then v heads (v pairs are just not rotated).

Every program recomputes the lane's RMS statistics from h (D elements, L2-resident), which is
cheaper than a separate norm kernel and its launch.

Llama-family extras: qwen2's biases are loaded with the weights and added to the rounded product;
qwen3's q/k norms need a whole head's rows, which kernels/qk_norm.py gathers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .gemv import (
    assert_lane_weight,
    assert_norm_weight,
    block_s,
    fit_rows,
    fit_warps,
    launch_kwargs,
    num_sms,
    tokens_of,
)
from .qk_norm import qk_norm_head, qk_scratch
from .tiles import await_inputs, cast_as, first_tile, rms_rstd_rows, round_as, stream_pair


@triton.jit
def norm_qkv_task(
    # Pointers
    x_ptr,  # (S, L, D) hidden states of S consecutive tokens
    nw_ptr,  # (D,) or (L, D) attention_norm weight
    wq_ptr,  # (L, QL, D), QL = Hq*hd/L
    wk_ptr,  # (L, KL, D), KL = Hkv*hd/L
    wv_ptr,  # (L, KL, D)
    cos_ptr,  # (max_pos, hd/2) fp32
    sin_ptr,  # (max_pos, hd/2) fp32
    position_ptr,  # (1,) int64, position of token 0; token s is at position + s
    q_ptr,  # (S, Hq, hd) output
    k_cache_ptr,  # (cap, Hkv, hd)
    v_cache_ptr,  # (cap, Hkv, hd)
    pos_cache_ptr,  # (cap,) int64
    # Sizes
    S,
    L,
    D,
    cap,
    eps,
    stride_nwl,  # 0 when the norm weight is shared
    HQ_LANE,  # query heads per lane
    HKV_LANE,  # KV heads per lane
    N_KV,  # KV heads in total (cache row = N_KV * HEAD_DIM)
    lane,  # the program's coordinates: (lane, pair block)
    blk,
    dep_ptr,  # what the inputs wait for (tiles.await_inputs)
    dep_target,
    max_spin,
    err_ptr,
    bq_ptr,  # (L, QL) biases (qwen2), with bk_ptr, bv_ptr (L, KL); unused without HAS_BIAS
    bk_ptr,
    bv_ptr,
    qn_ptr,  # (hd,) q_norm and k_norm (qwen3); unused without QK_NORM
    kn_ptr,
    raw_ptr,  # (MAX_TOKENS, L, HQ_LANE + HKV_LANE, hd) fp32 scratch: a head's rows before norm
    count_ptr,  # (L, HQ_LANE + HKV_LANE) int32 arrivals per head, left at 0
    # Meta-parameters
    HEAD_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    SYNC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    QK_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hd/2 rounded up to a power of two (QK_NORM's rows)
):
    """The work of program (lane, blk): a kernel's, or a task of the persistent kernel's."""
    HALF: tl.constexpr = HEAD_DIM // 2
    BLOCKS_PER_HEAD: tl.constexpr = HALF // BLOCK_P
    n_q = HQ_LANE * BLOCKS_PER_HEAD  # pair blocks of q in this lane
    n_k = HKV_LANE * BLOCKS_PER_HEAD  # ... of k, and as many of v

    # Which projection this program computes (its weights need nothing from earlier kernels).
    if blk < n_q:
        hb = blk
        w_lane = wq_ptr + lane * HQ_LANE * HEAD_DIM * D
    elif blk < n_q + n_k:
        hb = blk - n_q
        w_lane = wk_ptr + lane * HKV_LANE * HEAD_DIM * D
    else:
        hb = blk - n_q - n_k
        w_lane = wv_ptr + lane * HKV_LANE * HEAD_DIM * D
    head = hb // BLOCKS_PER_HEAD
    offs_i = (hb % BLOCKS_PER_HEAD) * BLOCK_P + tl.arange(0, BLOCK_P)  # pair index in the head
    if INTERLEAVED:
        r0 = 2 * offs_i  # (BLOCK_P,) rows of the pair inside the head
        r1 = r0 + 1
    else:
        r0 = offs_i
        r1 = offs_i + HALF
    w0_rows = w_lane + (head * HEAD_DIM + r0)[:, None] * D  # (BLOCK_P, 1)
    w1_rows = w_lane + (head * HEAD_DIM + r1)[:, None] * D
    all_p = offs_i >= 0
    w0 = first_tile(w0_rows, all_p, 0, D, BLOCK_K)
    w1 = first_tile(w1_rows, all_p, 0, D, BLOCK_K)
    if HAS_BIAS:  # weights too: loaded before the wait
        if blk < n_q:
            b_head = bq_ptr + (lane * HQ_LANE + head) * HEAD_DIM
        elif blk < n_q + n_k:
            b_head = bk_ptr + (lane * HKV_LANE + head) * HEAD_DIM
        else:
            b_head = bv_ptr + (lane * HKV_LANE + head) * HEAD_DIM
        b0 = tl.load(b_head + r0).to(tl.float32)
        b1 = tl.load(b_head + r1).to(tl.float32)
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)

    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    pos0 = tl.load(position_ptr)
    pos = pos0 + offs_s  # (BLOCK_S,) token positions
    slot = pos % cap  # full layers: cap = max_len so slot = pos; sliding layers: a ring
    x_row = x_ptr + lane * D  # token s: x_row + s * L * D
    nw = nw_ptr + lane * stride_nwl
    rstd = rms_rstd_rows(x_row, L * D, S, D, eps, BLOCK_S, BLOCK_K)
    a0, a1 = stream_pair(
        w0_rows,
        w1_rows,
        all_p,
        w0,
        w1,
        x_row,
        L * D,
        S,
        nw,
        rstd,
        D,
        BLOCK_S,
        BLOCK_P,
        BLOCK_K,
        PREFETCH,
    )  # one weight read for every token
    a0 = round_as(a0, x_ptr)  # (BLOCK_S, BLOCK_P), rounded like the reference
    a1 = round_as(a1, x_ptr)
    if HAS_BIAS:  # added to the rounded product and rounded again, as the model's lane_linear
        a0 = round_as(a0 + b0[None, :], x_ptr)
        a1 = round_as(a1 + b1[None, :], x_ptr)
    if (lane == 0) & (blk == n_q):  # exactly one program records the slots' positions
        tl.store(pos_cache_ptr + slot, pos, mask=mask_s)

    plain = blk >= 0
    if QK_NORM:  # a q or k head is normalised over all its rows, by the program finishing last
        plain = blk >= n_q + n_k
        if blk < n_q + n_k:
            if blk < n_q:
                g_ptr = qn_ptr
                out = q_ptr + (lane * HQ_LANE + head) * HEAD_DIM
                out_stride = HQ_LANE * L * HEAD_DIM  # token s: out + s * out_stride
            else:
                g_ptr = kn_ptr
                out = k_cache_ptr + (lane * HKV_LANE + head) * HEAD_DIM
                out_stride = 0  # token s: out + ((pos0 + s) % cap) * N_KV * HEAD_DIM
            qk_norm_head(a0, a1, r0, r1, mask_s, blk // BLOCKS_PER_HEAD, lane, L, S, pos0, cap,
                         N_KV, HQ_LANE + HKV_LANE, raw_ptr, count_ptr, g_ptr, out, out_stride,
                         cos_ptr, sin_ptr, eps, HEAD_DIM, INTERLEAVED, BLOCK_S, BLOCK_H,
                         BLOCKS_PER_HEAD)  # fmt: skip
    if plain:
        _rope_store(a0, a1, offs_i, r0, r1, offs_s, mask_s, pos, slot, blk, lane, head, n_q,
                    n_k, L, HQ_LANE, HKV_LANE, N_KV, q_ptr, k_cache_ptr, v_cache_ptr, cos_ptr,
                    sin_ptr, HEAD_DIM)  # fmt: skip


@triton.jit
def _rope_store(a0, a1, offs_i, r0, r1, offs_s, mask_s, pos, slot, blk, lane, head, n_q, n_k, L,
                HQ_LANE, HKV_LANE, N_KV, q_ptr, k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr,
                HEAD_DIM: tl.constexpr):  # fmt: skip
    """RoPE in fp32 on the program's pairs, and their store: q, or k and v into the cache; v
    programs rotate by angle 0 (cos 1, sin 0) instead of branching."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rotate = blk < n_q + n_k
    angle = pos[:, None] * HALF + offs_i[None, :]  # (BLOCK_S, BLOCK_P)
    c = tl.load(cos_ptr + angle, mask=mask_s[:, None], other=1.0)
    s = tl.load(sin_ptr + angle, mask=mask_s[:, None], other=0.0)
    c = tl.where(rotate, c, 1.0)
    s = tl.where(rotate, s, 0.0)
    o0 = a0 * c - a1 * s
    o1 = a0 * s + a1 * c
    if blk < n_q:  # (S, Hq, hd): lane l owns heads l*Hq/L ...
        row = q_ptr + offs_s * (HQ_LANE * L * HEAD_DIM) + lane * HQ_LANE * HEAD_DIM
    elif blk < n_q + n_k:
        row = k_cache_ptr + slot * N_KV * HEAD_DIM + lane * HKV_LANE * HEAD_DIM
    else:
        row = v_cache_ptr + slot * N_KV * HEAD_DIM + lane * HKV_LANE * HEAD_DIM
    dst = row[:, None] + head * HEAD_DIM  # (BLOCK_S, 1)
    tl.store(dst + r0[None, :], cast_as(o0, q_ptr), mask=mask_s[:, None])
    tl.store(dst + r1[None, :], cast_as(o1, q_ptr), mask=mask_s[:, None])


@triton.jit
def norm_qkv_kernel(x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr, position_ptr, q_ptr,
                    k_cache_ptr, v_cache_ptr, pos_cache_ptr, S, L, D, cap, eps, stride_nwl,
                    HQ_LANE, HKV_LANE, N_KV, bq_ptr, bk_ptr, bv_ptr, qn_ptr, kn_ptr, raw_ptr,
                    count_ptr, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, HAS_BIAS: tl.constexpr,
                    QK_NORM: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    norm_qkv_task(x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr, position_ptr, q_ptr,
                  k_cache_ptr, v_cache_ptr, pos_cache_ptr, S, L, D, cap, eps, stride_nwl,
                  HQ_LANE, HKV_LANE, N_KV, tl.program_id(0), tl.program_id(1), None, 0, 0, None,
                  bq_ptr, bk_ptr, bv_ptr, qn_ptr, kn_ptr, raw_ptr, count_ptr, HEAD_DIM,
                  INTERLEAVED, BLOCK_S, BLOCK_P, BLOCK_K, PREFETCH, USE_PDL, False, HAS_BIAS,
                  QK_NORM, BLOCK_H)  # fmt: skip


def _pick_block_p(x: torch.Tensor, half: int) -> int:
    """Largest power of two dividing hd/2, at most 8 on a GPU (64 in the interpreter).

    8 pairs = 16 rows a program: two (8, BLOCK_K) fp32 accumulators stay in registers, and the
    per-program norm prologue (3*D reads from L2) stays small next to the 16*D weights streamed.
    Laneformer-2B: 8 lanes x (4 + 2 + 2) heads x 48/8 blocks = 384 programs.
    """
    block_p = 1
    while half % (block_p * 2) == 0 and block_p * 2 <= (8 if num_sms(x) else 64):
        block_p *= 2
    return block_p


def norm_qkv_config(x: torch.Tensor, S: int, D: int, L: int, hq_lane: int, hkv_lane: int,
                    hd: int, block_p: int | None = None) -> dict:  # fmt: skip
    """The launch configuration for S tokens (the default, the GPU's table, or block_p)."""
    half = hd // 2
    default = {
        "BLOCK_P": _pick_block_p(x, half),
        "BLOCK_K": min(triton.next_power_of_2(D), 256 if num_sms(x) else 512),
        "PREFETCH": 0,
    }
    key = tuning.shape_key(L=L, Q=hq_lane, K=hkv_lane, HD=hd, D=D)
    cfg = tuning.choose("norm_qkv", x, key, default)
    if block_p:
        cfg["BLOCK_P"] = block_p
    cfg["BLOCK_P"] = fit_rows(x, cfg["BLOCK_P"], cfg["BLOCK_K"], S, 2)
    assert half % cfg["BLOCK_P"] == 0, f"block_p={cfg['BLOCK_P']} must divide hd/2={half}"
    return fit_warps(x, cfg, cfg["BLOCK_P"], cfg["BLOCK_K"])  # a program's tile: BLOCK_P rows


def norm_qkv(
    x: torch.Tensor,  # (L, D) or (S, L, D) residual stream, before attention_norm
    norm_weight: torch.Tensor,  # (D,) or (L, D)
    wq: torch.Tensor,  # (L, Hq*hd/L, D)
    wk: torch.Tensor,  # (L, Hkv*hd/L, D)
    wv: torch.Tensor,  # (L, Hkv*hd/L, D)
    cos: torch.Tensor,  # (max_pos, hd/2) fp32
    sin: torch.Tensor,  # (max_pos, hd/2) fp32
    position: torch.Tensor,  # (1,) int64, absolute position of token 0 (token s: position + s)
    k_cache: torch.Tensor,  # (cap, Hkv, hd), written at slot position % cap
    v_cache: torch.Tensor,  # (cap, Hkv, hd)
    pos_cache: torch.Tensor,  # (cap,) int64, absolute position held by each slot, -1 = empty
    *,
    eps: float = 1e-5,
    rope_style: str = "interleaved",
    block_p: int | None = None,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (L, out/L) each
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None,  # q_norm, k_norm (hd,) each
) -> torch.Tensor:
    """Returns q (Hq, hd) or (S, Hq, hd) after RoPE; writes k (after RoPE), v and the positions
    of the S tokens into the cache. `biases` (qwen2) and `qk_norms` (qwen3): as ref.norm_qkv.

    The position stays on the device (no sync, CUDA-graph safe), so two things are not checked:
    position + S <= cos.shape[0], and, on a full-attention layer, position + S <= cap.
    """
    xs, axis = tokens_of(x)
    S, L, D = xs.shape
    dt = x.dtype
    cap, n_kv, hd = k_cache.shape
    assert hd % 2 == 0, f"head_dim={hd} must be even for RoPE"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.shape == (cap, n_kv, hd) and c.is_contiguous() and c.dtype == dt, (
            f"{name}: expected contiguous {(cap, n_kv, hd)} {dt}, got {tuple(c.shape)} {c.dtype}"
        )
    assert pos_cache.shape == (cap,) and pos_cache.dtype == torch.int64, "pos_cache: (cap,) int64"
    assert position.shape == (1,) and position.dtype == torch.int64, "position: (1,) int64"
    assert rope_style in ("interleaved", "half"), f"rope_style={rope_style!r}"
    stride_nwl = assert_norm_weight(norm_weight, L, D, "norm_weight")
    assert_lane_weight(wq, L, D, dt, "wq")
    assert_lane_weight(wk, L, D, dt, "wk")
    assert_lane_weight(wv, L, D, dt, "wv")
    assert wq.shape[1] % hd == 0 and wk.shape[1] % hd == 0, "per-lane widths must be whole heads"
    assert wv.shape == wk.shape, f"wv {tuple(wv.shape)} != wk {tuple(wk.shape)}"
    hq_lane, hkv_lane = wq.shape[1] // hd, wk.shape[1] // hd
    assert hkv_lane * L == n_kv, f"wk gives {hkv_lane * L} KV heads, the cache holds {n_kv}"
    assert hq_lane % hkv_lane == 0, "GQA needs Hq divisible by Hkv"
    for name, t in (("cos", cos), ("sin", sin)):
        assert t.dim() == 2 and t.shape[1] == hd // 2, f"{name}: expected (max_pos, {hd // 2})"
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name}: contiguous fp32"

    if biases is not None:
        for name, b, w in zip(("bq", "bk", "bv"), biases, (wq, wk, wv), strict=True):
            assert b.shape == w.shape[:2] and b.is_contiguous() and b.dtype == dt, (
                f"{name}: expected contiguous {tuple(w.shape[:2])} {dt}, got {tuple(b.shape)}"
            )
    raw = counts = None
    if qk_norms is not None:
        for name, g in zip(("q_norm", "k_norm"), qk_norms, strict=True):
            assert g.shape == (hd,) and g.is_contiguous(), f"{name}: expected contiguous ({hd},)"
        raw, counts = qk_scratch(x.device, L * (hq_lane + hkv_lane), hd)

    half = hd // 2
    consts, opts = tuning.split(norm_qkv_config(x, S, D, L, hq_lane, hkv_lane, hd, block_p))
    q = torch.empty((S, hq_lane * L, hd), device=x.device, dtype=dt)
    grid = (L, (hq_lane + 2 * hkv_lane) * (half // consts["BLOCK_P"]))
    bq, bk, bv = biases or (None, None, None)
    qn, kn = qk_norms or (None, None)
    norm_qkv_kernel[grid](
        xs, norm_weight, wq, wk, wv, cos, sin, position, q, k_cache, v_cache, pos_cache,
        S, L, D, cap, eps, stride_nwl, hq_lane, hkv_lane, n_kv, bq, bk, bv, qn, kn, raw, counts,
        HEAD_DIM=hd, INTERLEAVED=rope_style == "interleaved", BLOCK_S=block_s(S), **consts,
        **opts, HAS_BIAS=biases is not None, QK_NORM=qk_norms is not None,
        BLOCK_H=triton.next_power_of_2(half), **launch_kwargs(x),
    )  # fmt: skip
    return q if axis else q[0]
