"""Column projection (wo or w2) fused with the DTP reduce and the residual add.

Per lane, y_l = W[l] @ a_l is a full-width (D) partial: the lane's share of what an all-reduce
would sum (laneformer.md 3.2 and 5). The residual update of lane l is then, by reduce mode:
    past       h_l = r_l + (y_l + (sum_k past_k - past_l))   other lanes' partials of layer i-d
    present    h_l = r_l + sum_k y_k                          immediate all-reduce (Llama: L=1)
    no_reduce  h_l = r_l + sqrt(L) * y_l
with the rounding order of laneformer.md 5.6 (S = sum past, T = S - past_l, U = y_l + T,
h = r_l + U, each rounded to the activation dtype, sums in fp32). The kernel also stores y,
which layer i+d needs.

Grids:
- past / no_reduce: (D / BLOCK_O, L), every program independent: stream BLOCK_O rows of W[l],
  then the epilogue reads BLOCK_O columns of r and of past (all L lanes, for the sum).
- present: (D / BLOCK_O,), each program loops over the lanes, because lane l's new h needs every
  lane's y for the same columns.
- split-K (narrow outputs, e.g. a 1-lane Llama with D = 2048): `lane_gemv_kernel` writes fp32
  partials (SPLIT_K, L, D) and `reduce_epilogue_kernel` sums them and applies the same epilogue.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .gemv import (
    assert_lane_weight,
    cast_as,
    launch_kwargs,
    launch_lane_gemv,
    pdl_prologue,
    round_as,
    tile_sizes,
)

MODES = {"past": 0, "present": 1, "no_reduce": 2}


@triton.jit
def _lane_update(y, lane, offs_o, mask_o, r_ptr, past_ptr, h_ptr, L, D, sqrt_l,
                 MODE: tl.constexpr, HAS_PAST: tl.constexpr, BLOCK_L: tl.constexpr):  # fmt: skip
    """h[lane, offs_o] = r + reduce(y) for the past and no_reduce modes; y is rounded fp32."""
    if MODE == 0:
        if HAS_PAST:
            offs_l = tl.arange(0, BLOCK_L)
            past = tl.load(
                past_ptr + offs_l[:, None] * D + offs_o[None, :],
                mask=(offs_l[:, None] < L) & mask_o[None, :],
                other=0.0,
            ).to(tl.float32)  # (BLOCK_L, BLOCK_O): every lane's partial of layer i-d
            total = round_as(tl.sum(past, 0), h_ptr)  # S
            own = tl.load(past_ptr + lane * D + offs_o, mask=mask_o, other=0.0).to(tl.float32)
            u = round_as(y + round_as(total - own, h_ptr), h_ptr)  # U = y + T
        else:
            u = y
    else:
        u = round_as(y * sqrt_l, h_ptr)
    r = tl.load(r_ptr + lane * D + offs_o, mask=mask_o, other=0.0).to(tl.float32)
    tl.store(h_ptr + lane * D + offs_o, cast_as(r + u, h_ptr), mask=mask_o)


@triton.jit
def _present_update(s, offs_o, mask_o, r_ptr, h_ptr, L, D):
    """h[l, offs_o] = r[l] + S for every lane, S the fp32 lane sum of the rounded partials."""
    total = round_as(s, h_ptr)
    for lane in range(L):
        r = tl.load(r_ptr + lane * D + offs_o, mask=mask_o, other=0.0).to(tl.float32)
        tl.store(h_ptr + lane * D + offs_o, cast_as(r + total, h_ptr), mask=mask_o)


@triton.jit
def _row_dot(w_ptr, a_ptr, offs_o, mask_o, K, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[offs_o, :] @ a for one lane: (BLOCK_O,) fp32."""
    acc = tl.zeros([BLOCK_O, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + offs_o[:, None] * K + offs_k[None, :],
            mask=mask_o[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * a[None, :]
    return tl.sum(acc, 1)


@triton.jit
def gemv_reduce_kernel(
    # Pointers
    a_ptr,  # (L, K) per-lane inputs
    w_ptr,  # (L, D, K) column projection
    r_ptr,  # (L, D) residual
    past_ptr,  # (L, D) partials of layer i-d (unused unless HAS_PAST)
    h_ptr,  # (L, D) new residual (may alias r_ptr: each element is read before it is written)
    y_ptr,  # (L, D) fresh partials
    # Sizes
    L,
    D,
    K,
    sqrt_l,
    # Meta-parameters
    MODE: tl.constexpr,  # 0 past, 1 present, 2 no_reduce
    HAS_PAST: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_o = tl.program_id(0)
    pdl_prologue(USE_PDL)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < D
    if MODE == 1:
        s = tl.zeros([BLOCK_O], dtype=tl.float32)
        for lane in range(L):
            y = round_as(_row_dot(w_ptr + lane * D * K, a_ptr + lane * K, offs_o, mask_o, K,
                                  BLOCK_O, BLOCK_K), y_ptr)  # fmt: skip
            tl.store(y_ptr + lane * D + offs_o, cast_as(y, y_ptr), mask=mask_o)
            s += y
        _present_update(s, offs_o, mask_o, r_ptr, h_ptr, L, D)
    else:
        lane = tl.program_id(1)
        y = round_as(_row_dot(w_ptr + lane * D * K, a_ptr + lane * K, offs_o, mask_o, K,
                              BLOCK_O, BLOCK_K), y_ptr)  # fmt: skip
        tl.store(y_ptr + lane * D + offs_o, cast_as(y, y_ptr), mask=mask_o)
        _lane_update(y, lane, offs_o, mask_o, r_ptr, past_ptr, h_ptr, L, D, sqrt_l,
                     MODE, HAS_PAST, BLOCK_L)  # fmt: skip


@triton.jit
def reduce_epilogue_kernel(
    ws_ptr,  # (SPLIT_K, L, D) fp32 split-K partials of y
    r_ptr,
    past_ptr,
    h_ptr,
    y_ptr,
    L,
    D,
    sqrt_l,
    SPLIT_K: tl.constexpr,
    MODE: tl.constexpr,
    HAS_PAST: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_L: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_o = tl.program_id(0)
    pdl_prologue(USE_PDL)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < D
    s = tl.zeros([BLOCK_O], dtype=tl.float32)
    for lane in range(L):
        y = tl.zeros([BLOCK_O], dtype=tl.float32)
        for k in tl.static_range(SPLIT_K):  # fixed order: deterministic
            y += tl.load(ws_ptr + (k * L + lane) * D + offs_o, mask=mask_o, other=0.0)
        y = round_as(y, y_ptr)
        tl.store(y_ptr + lane * D + offs_o, cast_as(y, y_ptr), mask=mask_o)
        if MODE == 1:
            s += y
        else:
            _lane_update(y, lane, offs_o, mask_o, r_ptr, past_ptr, h_ptr, L, D, sqrt_l,
                         MODE, HAS_PAST, BLOCK_L)  # fmt: skip
    if MODE == 1:
        _present_update(s, offs_o, mask_o, r_ptr, h_ptr, L, D)


def gemv_reduce(
    a: torch.Tensor,  # (L, K) per-lane input (attention heads or SwiGLU activations)
    w: torch.Tensor,  # (L, D, K) column projection (wo or w2)
    residual: torch.Tensor,  # (L, D)
    past: torch.Tensor | None,  # (L, D) partials of layer i-d ("past" mode only; None = none)
    *,
    mode: str,
    split_k: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (new h (L, D), fresh partial y (L, D)), y_l = w[l] @ a[l] (laneformer.md 5.2)."""
    assert mode in MODES, f"mode={mode!r}: expected one of {sorted(MODES)}"
    assert a.dim() == 2 and a.is_contiguous(), f"a: expected contiguous (L, K), got {a.shape}"
    L, K = a.shape
    dt = a.dtype
    assert_lane_weight(w, L, K, dt, "w")
    D = w.shape[1]
    assert residual.shape == (L, D) and residual.is_contiguous() and residual.dtype == dt, (
        f"residual: expected contiguous ({L}, {D}) {dt}, got {tuple(residual.shape)}"
    )
    has_past = mode == "past" and past is not None
    if has_past:
        assert past.shape == (L, D) and past.is_contiguous() and past.dtype == dt, (
            f"past: expected contiguous ({L}, {D}) {dt}, got {tuple(past.shape)}"
        )
    h = torch.empty_like(residual)
    y = torch.empty_like(residual)
    past_arg = past if has_past else residual  # never read without HAS_PAST
    programs = L if mode != "present" else 1
    block_o, block_k, auto_split = tile_sizes(a, D, K, programs)
    split_k = split_k or auto_split
    common = dict(MODE=MODES[mode], HAS_PAST=has_past, BLOCK_L=triton.next_power_of_2(L))
    opts = launch_kwargs(a)
    if split_k == 1:
        gemv_reduce_kernel[(triton.cdiv(D, block_o), programs)](
            a, w, residual, past_arg, h, y, L, D, K, math.sqrt(L),
            BLOCK_O=block_o, BLOCK_K=block_k, **common, **opts,
        )  # fmt: skip
        return h, y
    ws = torch.empty((split_k, L, D), device=a.device, dtype=torch.float32)
    launch_lane_gemv(w, a, None, 0, 0.0, ws, block_o, block_k, split_k)
    epi_block = min(triton.next_power_of_2(D), 256)
    reduce_epilogue_kernel[(triton.cdiv(D, epi_block),)](
        ws, residual, past_arg, h, y, L, D, math.sqrt(L),
        SPLIT_K=split_k, BLOCK_O=epi_block, **common, **opts,
    )  # fmt: skip
    return h, y
