"""Column projection (wo or w2) fused with the DTP reduce and the residual add.

Per lane, y_l = W[l] @ a_l is a full-width (D) partial: the lane's share of what an all-reduce
would sum (laneformer.md 3.2 and 5). The residual update of lane l is then, by reduce mode:
    past       h_l = r_l + (y_l + (sum_k past_k - past_l))   other lanes' partials of layer i-d
    present    h_l = r_l + sum_k y_k                          immediate all-reduce (Llama: L=1)
    no_reduce  h_l = r_l + sqrt(L) * y_l
with the rounding order of laneformer.md 5.6 (S = sum past, T = S - past_l, U = y_l + T,
h = r_l + U, each rounded to the activation dtype, sums in fp32). The kernel also stores y,
which layer i+d needs. A token axis (S <= 8 tokens, each with its own r, past, h, y) reads W
once for all tokens; every token's row is reduced in the same order whatever S is.

Grids:
- past / no_reduce: (D / BLOCK_O, L), every program independent: stream BLOCK_O rows of W[l],
  then the epilogue reads BLOCK_O columns of r and of past (all L lanes, for the sum).
- present: (D / BLOCK_O,), each program loops over the lanes, because lane l's new h needs every
  lane's y for the same columns.
- split-K (narrow outputs, e.g. a 1-lane Llama with D = 2048): `lane_gemv_kernel` writes fp32
  partials (SPLIT_K, L, D) and `reduce_epilogue_kernel` sums them and applies the same epilogue;
  in the persistent kernel (`split_reduce_task`) the last program to arrive does that epilogue.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import tuning
from .gemv import (
    assert_lane_weight,
    block_s,
    gemv_config,
    lane_gemv_task,
    launch_kwargs,
    launch_lane_gemv,
    tokens_of,
)
from .tiles import await_inputs, cast_as, first_tile, pdl_prologue, round_as, stream_rows

MODES = {"past": 0, "present": 1, "no_reduce": 2}


@triton.jit
def _lane_update(y, lane, offs_s, mask_s, offs_o, mask_o, r_ptr, past_ptr, h_ptr, L, D, sqrt_l,
                 MODE: tl.constexpr, HAS_PAST: tl.constexpr, BLOCK_L: tl.constexpr):  # fmt: skip
    """h[s, lane, offs_o] = r + reduce(y) for the past and no_reduce modes; y (BLOCK_S, BLOCK_O)
    is rounded fp32."""
    m2 = mask_s[:, None] & mask_o[None, :]
    own = (offs_s[:, None] * L + lane) * D + offs_o[None, :]  # (BLOCK_S, BLOCK_O)
    if MODE == 0:
        if HAS_PAST:
            # S = sum over lanes of layer i-d's partials, lane by lane in order: a tree over a
            # (BLOCK_S, BLOCK_L, BLOCK_O) tile would be laid out by BLOCK_S.
            total = tl.zeros_like(y)  # (BLOCK_S, BLOCK_O) fp32
            for src in range(L):
                at = (offs_s[:, None] * L + src) * D + offs_o[None, :]
                total += tl.load(past_ptr + at, mask=m2, other=0.0).to(tl.float32)
            total = round_as(total, h_ptr)  # S
            mine = tl.load(past_ptr + own, mask=m2, other=0.0).to(tl.float32)
            u = round_as(y + round_as(total - mine, h_ptr), h_ptr)  # U = y + T
        else:
            u = y
    else:
        u = round_as(y * sqrt_l, h_ptr)
    r = tl.load(r_ptr + own, mask=m2, other=0.0).to(tl.float32)
    tl.store(h_ptr + own, cast_as(r + u, h_ptr), mask=m2)


@triton.jit
def _present_update(total, offs_s, mask_s, offs_o, mask_o, r_ptr, h_ptr, L, D):
    """h[s, l, offs_o] = r[s, l] + S for every lane, S the fp32 lane sum of rounded partials."""
    total = round_as(total, h_ptr)
    m2 = mask_s[:, None] & mask_o[None, :]
    for lane in range(L):
        at = (offs_s[:, None] * L + lane) * D + offs_o[None, :]
        r = tl.load(r_ptr + at, mask=m2, other=0.0).to(tl.float32)
        tl.store(h_ptr + at, cast_as(r + total, h_ptr), mask=m2)


@triton.jit
def gemv_reduce_task(
    # Pointers
    a_ptr,  # (S, L, K) per-lane inputs
    w_ptr,  # (L, D, K) column projection
    r_ptr,  # (S, L, D) residual
    past_ptr,  # (S, L, D) partials of layer i-d (unused unless HAS_PAST)
    h_ptr,  # (S, L, D) new residual (may alias r_ptr: each element is read before it is written)
    y_ptr,  # (S, L, D) fresh partials
    # Sizes
    S,
    L,
    D,
    K,
    sqrt_l,
    pid_o,  # the program's coordinates: (column block, lane; the lane unused when present)
    lane,
    dep_ptr,  # what the inputs wait for (tiles.await_inputs)
    dep_target,
    max_spin,
    err_ptr,
    # Meta-parameters
    MODE: tl.constexpr,  # 0 past, 1 present, 2 no_reduce
    HAS_PAST: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    SYNC: tl.constexpr,
):
    """The work of program (pid_o, lane): a kernel's, or a task of the persistent kernel's."""
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < D
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    m2 = mask_s[:, None] & mask_o[None, :]
    if MODE == 1:
        w_rows = w_ptr + offs_o[:, None] * K  # lane 0's rows first
        w_first = first_tile(w_rows, mask_o, 0, K, BLOCK_K)
        await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
        total = tl.zeros([BLOCK_S, BLOCK_O], dtype=tl.float32)
        for lane in range(L):
            w_rows = w_ptr + lane * D * K + offs_o[:, None] * K
            if lane > 0:
                w_first = first_tile(w_rows, mask_o, 0, K, BLOCK_K)
            y = stream_rows(w_rows, mask_o, w_first, a_ptr + lane * K, L * K, S, a_ptr,
                            tl.zeros([BLOCK_S], dtype=tl.float32), 0, K, False, BLOCK_S, BLOCK_O,
                            BLOCK_K, PREFETCH)  # fmt: skip
            y = round_as(y, y_ptr)
            at = (offs_s[:, None] * L + lane) * D + offs_o[None, :]
            tl.store(y_ptr + at, cast_as(y, y_ptr), mask=m2)
            total += y
        _present_update(total, offs_s, mask_s, offs_o, mask_o, r_ptr, h_ptr, L, D)
    else:
        w_rows = w_ptr + lane * D * K + offs_o[:, None] * K
        w_first = first_tile(w_rows, mask_o, 0, K, BLOCK_K)
        await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
        y = stream_rows(w_rows, mask_o, w_first, a_ptr + lane * K, L * K, S, a_ptr,
                        tl.zeros([BLOCK_S], dtype=tl.float32), 0, K, False, BLOCK_S, BLOCK_O,
                        BLOCK_K, PREFETCH)  # fmt: skip
        y = round_as(y, y_ptr)
        at = (offs_s[:, None] * L + lane) * D + offs_o[None, :]
        tl.store(y_ptr + at, cast_as(y, y_ptr), mask=m2)
        _lane_update(y, lane, offs_s, mask_s, offs_o, mask_o, r_ptr, past_ptr, h_ptr, L, D,
                     sqrt_l, MODE, HAS_PAST, BLOCK_L)  # fmt: skip


@triton.jit
def gemv_reduce_kernel(a_ptr, w_ptr, r_ptr, past_ptr, h_ptr, y_ptr, S, L, D, K, sqrt_l,
                       MODE: tl.constexpr, HAS_PAST: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr,
                       PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    gemv_reduce_task(a_ptr, w_ptr, r_ptr, past_ptr, h_ptr, y_ptr, S, L, D, K, sqrt_l,
                     tl.program_id(0), tl.program_id(1), None, 0, 0, None, MODE, HAS_PAST,
                     BLOCK_S, BLOCK_O, BLOCK_K, BLOCK_L, PREFETCH, USE_PDL, False)  # fmt: skip


@triton.jit
def _split_epilogue(ws_ptr, r_ptr, past_ptr, h_ptr, y_ptr, S, L, D, sqrt_l, pid_o, lane_lo,
                    lane_hi, SPLIT_K: tl.constexpr, MODE: tl.constexpr, HAS_PAST: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr,
                    BLOCK_L: tl.constexpr):  # fmt: skip
    """Columns pid_o * BLOCK_O ... of lanes [lane_lo, lane_hi): y = the splits' fp32 partials
    summed in split order and rounded, then the mode's update (present: every lane's). The sum
    is elementwise, so any BLOCK_O gives the same bits."""
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < D
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < S
    m2 = mask_s[:, None] & mask_o[None, :]
    total = tl.zeros([BLOCK_S, BLOCK_O], dtype=tl.float32)
    for lane in range(lane_lo, lane_hi):
        at = (offs_s[:, None] * L + lane) * D + offs_o[None, :]
        y = tl.zeros([BLOCK_S, BLOCK_O], dtype=tl.float32)
        for k in tl.static_range(SPLIT_K):  # fixed order: deterministic
            y += tl.load(ws_ptr + k * S * L * D + at, mask=m2, other=0.0)
        y = round_as(y, y_ptr)
        tl.store(y_ptr + at, cast_as(y, y_ptr), mask=m2)
        if MODE == 1:
            total += y
        else:
            _lane_update(y, lane, offs_s, mask_s, offs_o, mask_o, r_ptr, past_ptr, h_ptr, L, D,
                         sqrt_l, MODE, HAS_PAST, BLOCK_L)  # fmt: skip
    if MODE == 1:
        _present_update(total, offs_s, mask_s, offs_o, mask_o, r_ptr, h_ptr, L, D)


@triton.jit
def reduce_epilogue_kernel(ws_ptr, r_ptr, past_ptr, h_ptr, y_ptr, S, L, D, sqrt_l,
                           SPLIT_K: tl.constexpr, MODE: tl.constexpr, HAS_PAST: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_L: tl.constexpr,
                           USE_PDL: tl.constexpr):  # fmt: skip
    """The split-K kernels' second launch: every lane of BLOCK_O columns a program."""
    pdl_prologue(USE_PDL)
    _split_epilogue(ws_ptr, r_ptr, past_ptr, h_ptr, y_ptr, S, L, D, sqrt_l, tl.program_id(0), 0,
                    L, SPLIT_K, MODE, HAS_PAST, BLOCK_S, BLOCK_O, BLOCK_L)  # fmt: skip


@triton.jit
def split_reduce_task(a_ptr, w_ptr, r_ptr, past_ptr, h_ptr, y_ptr, ws_ptr, arrive_ptr, S, L, D,
                      K, sqrt_l, pid_o, lane, pid_k, dep_ptr, dep_target, max_spin, err_ptr,
                      MODE: tl.constexpr, HAS_PAST: tl.constexpr, SPLIT_K: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_L: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """A split-K projection as tasks of the persistent kernel: program (lane, pid_o, pid_k) of
    lane_gemv_kernel writes its fp32 partial to ws (SPLIT_K, S, L, D); the last of the programs
    whose partials an update needs (every lane's splits of the columns when present, else the
    lane's own) sums them as reduce_epilogue_kernel does, so no phase of its own waits between.
    arrive_ptr: int32 per column block (present) or per (column block, lane), left at 0."""
    lane_gemv_task(w_ptr, a_ptr, a_ptr, ws_ptr, S, L, D, K, 0.0, 0, lane, pid_o, pid_k, dep_ptr,
                   dep_target, max_spin, err_ptr, False, SPLIT_K, BLOCK_S, BLOCK_O, BLOCK_K,
                   PREFETCH, False, True)  # fmt: skip
    tl.debug_barrier()  # every thread's partials are written before the arrival
    if MODE == 1:
        counter, n, lo, hi = arrive_ptr + pid_o, L * SPLIT_K, 0, L
    else:
        counter, n, lo, hi = arrive_ptr + pid_o * L + lane, SPLIT_K, lane, lane + 1
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n - 1:
        tl.atomic_xchg(counter, 0)  # ready for the next layer and the next launch
        _split_epilogue(ws_ptr, r_ptr, past_ptr, h_ptr, y_ptr, S, L, D, sqrt_l, pid_o, lo, hi,
                        SPLIT_K, MODE, HAS_PAST, BLOCK_S, BLOCK_O, BLOCK_L)  # fmt: skip


def gemv_reduce_config(a: torch.Tensor, mode: str, S: int, L: int, D: int, K: int,
                       split_k: int | None = None, block_o: int | None = None) -> dict:  # fmt: skip
    """The launch configuration (gemv.gemv_config), or the forced split / rows."""
    programs = L if mode != "present" else 1
    cfg = gemv_config(a, f"gemv_reduce_{mode}", D, K, programs, L, S)
    if block_o:
        cfg["BLOCK_O"] = block_o
    if split_k:
        cfg["SPLIT_K"] = split_k
    return cfg


def gemv_reduce(
    a: torch.Tensor,  # (L, K) or (S, L, K) per-lane input (attention heads or SwiGLU activations)
    w: torch.Tensor,  # (L, D, K) column projection (wo or w2)
    residual: torch.Tensor,  # (L, D) or (S, L, D)
    past: torch.Tensor | None,  # like residual: partials of layer i-d ("past" mode; None = none)
    *,
    mode: str,
    split_k: int | None = None,
    block_o: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (new h, fresh partial y), both like residual, y_l = w[l] @ a[l] (laneformer.md
    5.2), for each of the S tokens with one read of w."""
    assert mode in MODES, f"mode={mode!r}: expected one of {sorted(MODES)}"
    a_s, axis = tokens_of(a, "a")
    S, L, K = a_s.shape
    dt = a.dtype
    assert_lane_weight(w, L, K, dt, "w")
    D = w.shape[1]
    want = (S, L, D) if axis else (L, D)
    assert residual.shape == want and residual.is_contiguous() and residual.dtype == dt, (
        f"residual: expected contiguous {want} {dt}, got {tuple(residual.shape)}"
    )
    has_past = mode == "past" and past is not None
    if has_past:
        assert past.shape == want and past.is_contiguous() and past.dtype == dt, (
            f"past: expected contiguous {want} {dt}, got {tuple(past.shape)}"
        )
    h = torch.empty_like(residual)
    y = torch.empty_like(residual)
    past_arg = past if has_past else residual  # never read without HAS_PAST
    programs = L if mode != "present" else 1
    cfg = gemv_reduce_config(a, mode, S, L, D, K, split_k, block_o)
    common = dict(MODE=MODES[mode], HAS_PAST=has_past, BLOCK_S=block_s(S),
                  BLOCK_L=triton.next_power_of_2(L))  # fmt: skip
    opts = launch_kwargs(a)
    if cfg["SPLIT_K"] == 1:
        consts, options = tuning.split(cfg)
        consts.pop("SPLIT_K")
        gemv_reduce_kernel[(triton.cdiv(D, consts["BLOCK_O"]), programs)](
            a_s, w, residual, past_arg, h, y, S, L, D, K, math.sqrt(L),
            **consts, **options, **common, **opts,
        )  # fmt: skip
        return h, y
    ws = torch.empty((cfg["SPLIT_K"], S, L, D), device=a.device, dtype=torch.float32)
    launch_lane_gemv(w, a_s, None, 0, 0.0, ws, cfg)
    epi_block = min(triton.next_power_of_2(D), 256)
    reduce_epilogue_kernel[(triton.cdiv(D, epi_block),)](
        ws, residual, past_arg, h, y, S, L, D, math.sqrt(L),
        SPLIT_K=cfg["SPLIT_K"], BLOCK_O=epi_block, **common, **opts,
    )  # fmt: skip
    return h, y
