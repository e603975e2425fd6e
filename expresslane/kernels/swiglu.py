"""MLP prologue in one kernel: RMSNorm -> gate (w1) and up (w3) projections -> SiLU(gate) * up.

Per lane l and one token: xn = ffn_norm(h[l]), out[l] = silu(w1[l] @ xn) * (w3[l] @ xn), an
(L, F/L) activation that feeds the down projection (gemv_reduce.py). w1 and w3 are 2/3 of the MLP
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

from .gemv import (
    assert_lane_weight,
    assert_norm_weight,
    cast_as,
    launch_kwargs,
    normed_chunk,
    pdl_prologue,
    rms_rstd,
    round_as,
    tile_sizes,
)


@triton.jit
def norm_swiglu_kernel(
    # Pointers
    x_ptr,  # (L, D) hidden state
    nw_ptr,  # (D,) or (L, D) ffn_norm weight
    w1_ptr,  # (L, FL, D) gate
    w3_ptr,  # (L, FL, D) up
    out_ptr,  # (L, FL)
    # Sizes
    D,
    FL,
    eps,
    stride_nwl,
    # Meta-parameters
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    lane = tl.program_id(0)
    pid_o = tl.program_id(1)
    pdl_prologue(USE_PDL)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < FL
    rows = lane * FL * D + offs_o[:, None] * D  # (BLOCK_O, 1) element offsets of the rows
    x_row = x_ptr + lane * D
    rstd = rms_rstd(x_row, D, eps, BLOCK_K)
    acc_g = tl.zeros([BLOCK_O, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_O, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        xn = normed_chunk(x_row, nw_ptr + lane * stride_nwl, offs_k, mask_k, rstd, True)
        m = mask_o[:, None] & mask_k[None, :]
        g = tl.load(w1_ptr + rows + offs_k[None, :], mask=m, other=0.0)
        u = tl.load(w3_ptr + rows + offs_k[None, :], mask=m, other=0.0)
        acc_g += g.to(tl.float32) * xn[None, :]
        acc_u += u.to(tl.float32) * xn[None, :]
    gate = round_as(tl.sum(acc_g, 1), out_ptr)
    up = round_as(tl.sum(acc_u, 1), out_ptr)
    act = round_as(gate * tl.sigmoid(gate), out_ptr)  # silu
    tl.store(out_ptr + lane * FL + offs_o, cast_as(act * up, out_ptr), mask=mask_o)


def norm_swiglu(
    x: torch.Tensor,  # (L, D) residual stream, before ffn_norm
    norm_weight: torch.Tensor,  # (D,) or (L, D)
    w1: torch.Tensor,  # (L, F/L, D) gate
    w3: torch.Tensor,  # (L, F/L, D) up
    *,
    eps: float = 1e-5,
) -> torch.Tensor:
    """silu(w1[l] @ norm(x)[l]) * (w3[l] @ norm(x)[l]) -> (L, F/L)."""
    assert x.dim() == 2 and x.is_contiguous(), f"x: expected contiguous (L, D), got {x.shape}"
    L, D = x.shape
    stride_nwl = assert_norm_weight(norm_weight, L, D, "norm_weight")
    assert_lane_weight(w1, L, D, x.dtype, "w1")
    assert_lane_weight(w3, L, D, x.dtype, "w3")
    assert w1.shape == w3.shape, f"w1 {tuple(w1.shape)} != w3 {tuple(w3.shape)}"
    FL = w1.shape[1]
    # 8 rows of each matrix per program: the norm prologue re-reads x from L2 per program, and two
    # (BLOCK_O, BLOCK_K) accumulators must fit in registers. No split-K: SiLU needs full dots.
    block_o, block_k, _ = tile_sizes(x, FL, D, L, min_rows=8, max_rows=8)
    out = torch.empty((L, FL), device=x.device, dtype=x.dtype)
    norm_swiglu_kernel[(L, triton.cdiv(FL, block_o))](
        x, norm_weight, w1, w3, out, D, FL, eps, stride_nwl,
        BLOCK_O=block_o, BLOCK_K=block_k, **launch_kwargs(x),
    )  # fmt: skip
    return out
