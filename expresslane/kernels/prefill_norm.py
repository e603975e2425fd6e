"""Prefill's fused element-wise kernels: the DTP reduce + residual add with the next RMSNorm,
one pass per token (`residual_norm`), and the MLP's SiLU(gate) * up (`silu_mul`).

Between two modules of the eager forward the residual stream (S, L, D) is walked several times:
`h + reduce(y)` (a lane sum or a scale, then the add) and the next RMSNorm (x.float(), pow,
mean, rsqrt, two multiplies, the cast), each a full pass over tensors that are L times a
Llama's. Here one program owns one token, all L lanes (the present and past modes need the lane
sum), and walks D in BLOCK_D chunks:

    pass 1   read y (and past) and h, h_new = h + reduce(y), write h_new, sum each lane's h_new^2
    pass 2   re-read h_new (the token's own row, just written: L2-hot), write RMSNorm(h_new)

by reduce mode (laneformer.md 5.2, the order of 5.6; sums in fp32, each step rounded to the
activation dtype where the eager ops round):
    present    h_l = r_l + sum_k y_k
    no_reduce  h_l = r_l + sqrt(L) * y_l
    past       h_l = r_l + (y_l + (sum_k past_k - past_l))     or r_l + y_l with no past
and the norm as `model.rms_norm`: fp32 statistics, x * rstd rounded to the dtype before the
scale (`round_before_scale`: Llama and per-lane norms) or scaled in fp32 and rounded once.
y and past may be strided views (lane_linear's bmm returns (L, N, D) storage seen as (N, L, D)),
h too (the first layer's h is the embedding row broadcast over the lanes, lane stride 0).

The references are `ref.residual_norm` (the model's own math) and `ref.silu_mul`; the launchers
run them where triton does not (`use_triton`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import ref, use_triton
from .gemv_reduce import MODES
from .tiles import cast_as, round_as

# The (BLOCK_L, BLOCK_D) tile holds at most this many elements: 8 a thread at 8 warps (one
# 16-byte load of bf16 per tensor and chunk). Compiled for sm_90 at the 2B's shape (L = 8,
# BLOCK_D = 256; the aot.py recording): 40-63 registers, no spills, 4-6 CTAs an SM; 4096-element
# tiles took 68-100 registers (2-3 CTAs an SM). Not yet timed on a GPU: `block` and `num_warps`
# of `residual_norm` override both for a sweep.
TILE_ELEMENTS = 2048
NUM_WARPS = 8


@triton.jit
def _load_tile(ptr, n, offs_l, offs_d, mask, s_n, s_l, s_d):
    """The (BLOCK_L, BLOCK_D) tile of token n, lanes offs_l, columns offs_d, as fp32."""
    at = n * s_n + offs_l[:, None] * s_l + offs_d[None, :] * s_d
    return tl.load(ptr + at, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def residual_norm_kernel(
    h_ptr,  # (N, L, D) residual, strides h_sn, h_sl, h_sd
    y_ptr,  # (N, L, D) the module's partials (unused unless HAS_Y)
    past_ptr,  # (N, L, D) partials of layer i-d (unused unless HAS_PAST)
    gamma_ptr,  # (D,) or (L, D) norm scale, lane stride g_sl (0 when shared)
    out_ptr,  # (N, L, D) contiguous h_new (unused unless HAS_Y: then h_new is h)
    normed_ptr,  # (N, L, D) contiguous RMSNorm(h_new) (unused unless HAS_NORM)
    L,
    D,
    h_sn,
    h_sl,
    h_sd,
    y_sn,
    y_sl,
    y_sd,
    p_sn,
    p_sl,
    p_sd,
    g_sl,
    sqrt_l,
    eps,
    MODE: tl.constexpr,  # 0 past, 1 present, 2 no_reduce
    HAS_Y: tl.constexpr,
    HAS_PAST: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROUND_BEFORE_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    mask_l = offs_l < L
    row = n * L * D  # token n's row in the contiguous outputs
    squares = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        m = mask_l[:, None] & (offs_d < D)[None, :]
        x = _load_tile(h_ptr, n, offs_l, offs_d, m, h_sn, h_sl, h_sd)
        if HAS_Y:
            y = _load_tile(y_ptr, n, offs_l, offs_d, m, y_sn, y_sl, y_sd)
            if MODE == 1:
                u = round_as(tl.sum(y, 0), out_ptr)[None, :]  # the lane sum, one rounding
            elif MODE == 2:
                u = round_as(y * sqrt_l, out_ptr)
            elif HAS_PAST:
                p = _load_tile(past_ptr, n, offs_l, offs_d, m, p_sn, p_sl, p_sd)
                total = round_as(tl.sum(p, 0), out_ptr)  # S
                u = round_as(y + round_as(total[None, :] - p, out_ptr), out_ptr)  # y + T
            else:
                u = y
            x = round_as(x + u, out_ptr)
            at = row + offs_l[:, None] * D + offs_d[None, :]
            tl.store(out_ptr + at, x.to(out_ptr.dtype.element_ty), mask=m)  # exact: rounded
        if HAS_NORM:
            squares += x * x
    if HAS_NORM:
        # every thread's h_new stores visible to the whole program before pass 2 reads them
        tl.debug_barrier()
        rstd = tl.math.rsqrt(tl.sum(squares, 1) / D + eps)  # (BLOCK_L,)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            m = mask_l[:, None] & (offs_d < D)[None, :]
            if HAS_Y:
                x = _load_tile(out_ptr, n, offs_l, offs_d, m, L * D, D, 1)
            else:
                x = _load_tile(h_ptr, n, offs_l, offs_d, m, h_sn, h_sl, h_sd)
            g = tl.load(gamma_ptr + offs_l[:, None] * g_sl + offs_d[None, :], mask=m, other=0.0)
            x = x * rstd[:, None]
            if ROUND_BEFORE_SCALE:
                x = round_as(x, normed_ptr)
            at = row + offs_l[:, None] * D + offs_d[None, :]
            tl.store(normed_ptr + at, cast_as(x * g.to(tl.float32), normed_ptr), mask=m)


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = SiLU(g) * u over n contiguous elements, rounded as FeedForward rounds them."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    act = round_as(g * tl.sigmoid(g), out_ptr)  # F.silu's result in the dtype
    tl.store(out_ptr + offs, cast_as(act * u, out_ptr), mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up in one pass (FeedForward's two element-wise ops read and write the
    (S, L, F/L) activations three times: ~0.15 ms a layer of the 2B at 1,024 tokens, by
    bytes); ref.silu_mul where triton does not run."""
    if not use_triton(gate):
        return ref.silu_mul(gate, up)
    assert gate.shape == up.shape and gate.dtype == up.dtype, (
        f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
    )
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        silu_mul_kernel[(triton.cdiv(n, 2048),)](gate, up, out, n, BLOCK=2048, num_warps=8)
    return out


def block_d(lanes: int, dim: int) -> int:
    """Columns per chunk: the tile of all lanes within TILE_ELEMENTS, 16 to 1024 wide."""
    lanes_p2 = triton.next_power_of_2(lanes)
    return max(16, min(triton.next_power_of_2(dim), TILE_ELEMENTS // lanes_p2, 1024))


def _check(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape and t.dtype == like.dtype and t.device == like.device, (
        f"{name}: expected {tuple(like.shape)} {like.dtype} on {like.device}, "
        f"got {tuple(t.shape)} {t.dtype} on {t.device}"
    )


def residual_norm(
    h: torch.Tensor,
    y: torch.Tensor | None,
    gamma: torch.Tensor | None,
    *,
    mode: str,
    past: torch.Tensor | None = None,
    eps: float = 1e-6,
    round_before_scale: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(h_new, normed): h_new = h + reduce(y, mode, past) (h itself when y is None), normed the
    RMSNorm of h_new with scale gamma (D,) shared or (L, D) per lane (None: no norm, normed
    None). h, y, past: (N, L, D), any strides; the outputs are contiguous. `block` and
    `num_warps` override the launch configuration (sweeps)."""
    assert mode in MODES, f"mode={mode!r}: expected one of {sorted(MODES)}"
    assert h.dim() == 3, f"h: expected (N, L, D), got {tuple(h.shape)}"
    if not use_triton(h):
        return ref.residual_norm(h, y, gamma, mode=mode, past=past, eps=eps,
                                 round_before_scale=round_before_scale)  # fmt: skip
    N, L, D = h.shape
    has_y = y is not None
    has_past = has_y and mode == "past" and past is not None
    if has_y:
        _check("y", y, h)
    if has_past:
        _check("past", past, h)
    if gamma is not None:
        assert gamma.shape in ((D,), (L, D)) and gamma.is_contiguous(), (
            f"gamma: expected contiguous ({D},) or ({L}, {D}), got {tuple(gamma.shape)}"
        )
        assert gamma.dtype == h.dtype, f"gamma: dtype {gamma.dtype}, activations are {h.dtype}"
    if not has_y and gamma is None:
        return h, None
    out = torch.empty((N, L, D), device=h.device, dtype=h.dtype) if has_y else h
    normed = None if gamma is None else torch.empty((N, L, D), device=h.device, dtype=h.dtype)
    if N == 0:
        return out, normed
    yy = y if has_y else h  # never read without HAS_Y / HAS_PAST / HAS_NORM
    pp = past if has_past else h
    residual_norm_kernel[(N,)](
        h, yy, pp, h if gamma is None else gamma, out if has_y else h,
        h if normed is None else normed, L, D, *h.stride(), *yy.stride(), *pp.stride(),
        0 if gamma is None or gamma.dim() == 1 else D, math.sqrt(L), eps,
        MODE=MODES[mode], HAS_Y=has_y, HAS_PAST=has_past, HAS_NORM=gamma is not None,
        ROUND_BEFORE_SCALE=round_before_scale, BLOCK_L=triton.next_power_of_2(L),
        BLOCK_D=block or block_d(L, D), num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
    return out, normed
