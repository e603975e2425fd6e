"""MLP prologue in one kernel: RMSNorm -> gate (w1) and up (w3) projections -> SiLU(gate) * up.

Per lane l and each of S <= 8 tokens (one weight read for all of them, each token's row reduced
in the same order whatever S is): xn = ffn_norm(h[l]), out[l] = silu(w1[l] @ xn) * (w3[l] @ xn),
an (L, F/L) activation that feeds the down projection (gemv_reduce.py). w1 and w3 are 2/3 of the MLP
bytes, half of all weights of Laneformer-2B, so this is the kernel that most needs to stream at
full bandwidth.

A program owns BLOCK_O rows of w1 *and* the same BLOCK_O rows of w3 for one lane, so the SiLU
product is formed in registers and the (L, 2F/L) gate/up intermediate never exists in memory. It
recomputes the lane's RMS statistics from h (D elements, L2-resident) instead of a separate norm
kernel. Rounding follows the reference: xn, gate, up, silu(gate) and the product are each
rounded to the activation dtype.
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
    gemv_config,
    launch_kwargs,
    tokens_of,
)
from .tiles import await_inputs, cast_as, first_tile, rms_rstd_rows, round_as, stream_pair


@triton.jit
def norm_swiglu_task(
    # Pointers
    x_ptr,  # (S, L, D) hidden states
    nw_ptr,  # (D,) or (L, D) ffn_norm weight
    w1_ptr,  # (L, FL, D) gate
    w3_ptr,  # (L, FL, D) up
    out_ptr,  # (S, L, FL)
    # Sizes
    S,
    L,
    D,
    FL,
    eps,
    stride_nwl,
    lane,  # the program's coordinates: (lane, row block)
    pid_o,
    dep_ptr,  # what the inputs wait for (tiles.await_inputs)
    dep_target,
    max_spin,
    err_ptr,
    # Meta-parameters
    BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    SYNC: tl.constexpr,
):
    """The work of program (lane, pid_o): a kernel's, or a task of the persistent kernel's."""
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < FL
    g_rows = w1_ptr + lane * FL * D + offs_o[:, None] * D  # (BLOCK_O, 1) row starts
    u_rows = w3_ptr + lane * FL * D + offs_o[:, None] * D
    g = first_tile(g_rows, mask_o, 0, D, BLOCK_K)  # before the wait: weights are ready
    u = first_tile(u_rows, mask_o, 0, D, BLOCK_K)
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
    x_row = x_ptr + lane * D  # token s: x_row + s * L * D
    nw = nw_ptr + lane * stride_nwl
    rstd = rms_rstd_rows(x_row, L * D, S, D, eps, BLOCK_S, BLOCK_K)
    gate, up = stream_pair(
        g_rows,
        u_rows,
        mask_o,
        g,
        u,
        x_row,
        L * D,
        S,
        nw,
        rstd,
        D,
        BLOCK_S,
        BLOCK_O,
        BLOCK_K,
        PREFETCH,
    )  # one weight read for every token
    gate = round_as(gate, out_ptr)  # (BLOCK_S, BLOCK_O)
    up = round_as(up, out_ptr)
    act = round_as(gate * tl.sigmoid(gate), out_ptr)  # silu
    offs_s = tl.arange(0, BLOCK_S)
    dst = out_ptr + (offs_s[:, None] * L + lane) * FL + offs_o[None, :]
    tl.store(dst, cast_as(act * up, out_ptr), mask=(offs_s[:, None] < S) & mask_o[None, :])


@triton.jit
def norm_swiglu_kernel(x_ptr, nw_ptr, w1_ptr, w3_ptr, out_ptr, S, L, D, FL, eps, stride_nwl,
                       BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                       PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    norm_swiglu_task(x_ptr, nw_ptr, w1_ptr, w3_ptr, out_ptr, S, L, D, FL, eps, stride_nwl,
                     tl.program_id(0), tl.program_id(1), None, 0, 0, None, BLOCK_S, BLOCK_O,
                     BLOCK_K, PREFETCH, USE_PDL, False)  # fmt: skip


def norm_swiglu_config(x: torch.Tensor, S: int, L: int, D: int, FL: int,
                       block_o: int | None = None) -> dict:  # fmt: skip
    """The launch configuration: 8 rows of each matrix per program (the norm prologue re-reads x
    from L2 per program, and two (BLOCK_O, BLOCK_K) accumulators must fit in registers). No
    split-K: SiLU needs full dots."""
    cfg = gemv_config(x, "norm_swiglu", FL, D, L, L, S, 2, min_rows=8, max_rows=8)
    cfg.pop("SPLIT_K")
    if block_o:
        cfg["BLOCK_O"] = block_o
    return cfg


def norm_swiglu(
    x: torch.Tensor,  # (L, D) or (S, L, D) residual stream, before ffn_norm
    norm_weight: torch.Tensor,  # (D,) or (L, D)
    w1: torch.Tensor,  # (L, F/L, D) gate
    w3: torch.Tensor,  # (L, F/L, D) up
    *,
    eps: float = 1e-5,
    block_o: int | None = None,
) -> torch.Tensor:
    """silu(w1[l] @ norm(x)[l]) * (w3[l] @ norm(x)[l]) -> (L, F/L) or (S, L, F/L)."""
    xs, axis = tokens_of(x)
    S, L, D = xs.shape
    stride_nwl = assert_norm_weight(norm_weight, L, D, "norm_weight")
    assert_lane_weight(w1, L, D, x.dtype, "w1")
    assert_lane_weight(w3, L, D, x.dtype, "w3")
    assert w1.shape == w3.shape, f"w1 {tuple(w1.shape)} != w3 {tuple(w3.shape)}"
    FL = w1.shape[1]
    consts, opts = tuning.split(norm_swiglu_config(x, S, L, D, FL, block_o))
    out = torch.empty((S, L, FL), device=x.device, dtype=x.dtype)
    norm_swiglu_kernel[(L, triton.cdiv(FL, consts["BLOCK_O"]))](
        xs, norm_weight, w1, w3, out, S, L, D, FL, eps, stride_nwl,
        BLOCK_S=block_s(S), **consts, **opts, **launch_kwargs(x),
    )  # fmt: skip
    return out if axis else out[0]
