"""Lane-major products over int8 / int4 weights (weights/gpu_pack.py), dequantized in registers.

    y[s, l] = W[l] @ x[s, l]   for S <= 8 tokens of one sequence, W read once for all of them

The calling convention of kernels/gemv.py's lane_gemv, with a token axis in front: x (S, L, K)
-> y (S, L, O) in x's dtype (an (L, K) x is one token), optional RMSNorm of x first (fp32
statistics, rounded to x's dtype like tiles.normed_chunk), fp32 accumulation, one rounding.

Each program owns BLOCK_O output rows of one lane and walks K in chunks of BLOCK_K values:
- it loads the chunk's integers once as a (BLOCK_O, groups, group) tile (int8) or (BLOCK_O,
  chunks, 32) bytes (int4, whose low nibbles are 32 consecutive values and high nibbles the next
  32), with the scales (and mins) of those groups, and dequantizes in fp32: q * scale (+ mins);
- then, for each token, it reduces the tile against that token's slice of x and adds the
  (BLOCK_O,) result into row s of a (BLOCK_S, BLOCK_O) accumulator.
The per-token reduction has the same shapes and order whatever S is, and tiles depend on the
weight's shape only, so each row's result is bitwise independent of S (batch-invariant, which
verify-equals-decode needs). No split-K: at the shapes we run, rows alone fill the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..weights.gpu_pack import CHUNK, GPUQuant
from .gemv import assert_norm_weight, launch_kwargs, num_sms
from .tiles import cast_as, normed_chunk, pdl_prologue

MAX_TOKENS = 8


@triton.jit
def _token_rstd(x_ptr, stride, K, eps, S, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_S,) rsqrt(mean(x_s^2) + eps) of each token's K-vector (x_ptr + s * stride)."""
    offs_s = tl.arange(0, BLOCK_S)
    rstd = tl.zeros([BLOCK_S], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_K)
    for s in tl.static_range(BLOCK_S):
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = k0 + offs < tl.where(s < S, K, 0)
            x = tl.load(x_ptr + s * stride + k0 + offs, mask=m, other=0.0).to(tl.float32)
            acc += x * x
        r = 1.0 / tl.sqrt(tl.sum(acc, 0) / K + eps)
        rstd = tl.where(offs_s == s, r, rstd)
    return rstd


@triton.jit
def qgemv_kernel(
    w_ptr,  # (L, O, KW) int8 values, or uint8 nibble pairs (KW = Kp / 2)
    s_ptr,  # (L, O, NG) scales
    m_ptr,  # (L, O, NG) mins (int4 only)
    x_ptr,  # (S, L, K) activations
    nw_ptr,  # (K,) or (L, K) norm weight (unused without HAS_NORM)
    y_ptr,  # (S, L, O)
    S,
    L,
    O,
    K,
    KW,
    NG,
    eps,
    stride_nwl,
    INT4: tl.constexpr,
    HAS_NORM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    lane = tl.program_id(0)
    pid_o = tl.program_id(1)
    pdl_prologue(USE_PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < O
    x_lane = x_ptr + lane * K  # token s at + s * L * K
    nw_lane = nw_ptr + lane * stride_nwl
    rstd = tl.full([BLOCK_S], 1.0, tl.float32)
    if HAS_NORM:
        rstd = _token_rstd(x_lane, L * K, K, eps, S, BLOCK_S, BLOCK_K)
    row = (lane * O + offs_o)[:, None, None]  # (BLOCK_O, 1, 1)
    acc = tl.zeros([BLOCK_S, BLOCK_O], dtype=tl.float32)
    if INT4:
        NC: tl.constexpr = BLOCK_K // 64  # 32-byte chunks per step
        c = tl.arange(0, NC)[None, :, None]
        i = tl.arange(0, 32)[None, None, :]
        for k0 in range(0, K, BLOCK_K):
            kc = k0 + c * 64  # (1, NC, 1) first value of each chunk
            m3 = mask_o[:, None, None] & (kc < K)
            b = tl.load(w_ptr + row * KW + kc // 2 + i, mask=m3, other=0)  # (BLOCK_O, NC, 32)
            g_lo = row * NG + kc // GROUP
            g_hi = row * NG + (kc + 32) // GROUP
            s_lo = tl.load(s_ptr + g_lo, mask=m3, other=0.0).to(tl.float32)
            s_hi = tl.load(s_ptr + g_hi, mask=m3, other=0.0).to(tl.float32)
            mn_lo = tl.load(m_ptr + g_lo, mask=m3, other=0.0).to(tl.float32)
            mn_hi = tl.load(m_ptr + g_hi, mask=m3, other=0.0).to(tl.float32)
            w_lo = (b & 0x0F).to(tl.float32) * s_lo + mn_lo
            w_hi = (b >> 4).to(tl.float32) * s_hi + mn_hi
            for s in tl.static_range(BLOCK_S):
                x_s = x_lane + s * L * K
                k_end = tl.where(s < S, K, 0)  # a token past S reads nothing
                mk_lo = kc + i < k_end
                mk_hi = kc + 32 + i < k_end
                r = tl.sum(tl.where(offs_s == s, rstd, 0.0), 0)
                x_lo = normed_chunk(x_s, nw_lane, kc + i, mk_lo, r, HAS_NORM)  # (1, NC, 32)
                x_hi = normed_chunk(x_s, nw_lane, kc + 32 + i, mk_hi, r, HAS_NORM)
                part = tl.sum(tl.sum(w_lo * x_lo + w_hi * x_hi, 2), 1)  # (BLOCK_O,)
                acc = tl.where(offs_s[:, None] == s, acc + part[None, :], acc)
    else:
        NGB: tl.constexpr = BLOCK_K // GROUP  # groups per step
        g = tl.arange(0, NGB)[None, :, None]
        i = tl.arange(0, GROUP)[None, None, :]
        for k0 in range(0, K, BLOCK_K):
            kg = k0 + g * GROUP  # (1, NGB, 1)
            m3 = mask_o[:, None, None] & (kg < K)
            q = tl.load(w_ptr + row * KW + kg + i, mask=m3, other=0)  # (BLOCK_O, NGB, GROUP)
            sc = tl.load(s_ptr + row * NG + kg // GROUP, mask=m3, other=0.0).to(tl.float32)
            w = q.to(tl.float32) * sc
            for s in tl.static_range(BLOCK_S):
                x_s = x_lane + s * L * K
                mk = kg + i < tl.where(s < S, K, 0)  # a token past S reads nothing
                r = tl.sum(tl.where(offs_s == s, rstd, 0.0), 0)
                x = normed_chunk(x_s, nw_lane, kg + i, mk, r, HAS_NORM)  # (1, NGB, GROUP)
                part = tl.sum(tl.sum(w * x, 2), 1)
                acc = tl.where(offs_s[:, None] == s, acc + part[None, :], acc)
    y = y_ptr + (offs_s[:, None] * L + lane) * O + offs_o[None, :]
    tl.store(y, cast_as(acc, y_ptr), mask=(offs_s[:, None] < S) & mask_o[None, :])


def tiles(w: GPUQuant, lanes: int, rows: int, device_probe: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_O, BLOCK_K) from the weight's shape and the GPU, never from the token count.

    On a GPU: BLOCK_O from 16 down to 4 until there are ~4 programs per SM, then BLOCK_K so that
    a step's tile is >= 2 KB of integers: 16 bytes a thread at 4 warps, the width of one load
    (sm_90 builds of smaller tiles load 2-8 bytes a thread, kernels/aot.py). In the interpreter:
    fewer, larger programs.
    """
    k_step = max(CHUNK, w.group)
    sms = num_sms(device_probe)
    if sms == 0:
        block_k = max(k_step, min(512, triton.next_power_of_2(w.padded_k)))
        return min(triton.next_power_of_2(rows), 64), block_k
    block_o = min(16, triton.next_power_of_2(rows))
    while block_o > 4 and lanes * triton.cdiv(rows, block_o) < 4 * sms:
        block_o //= 2
    per_row = 2048 // block_o * (2 if w.fmt == "int4" else 1)  # values for 2 KB a step
    return block_o, max(k_step, min(per_row, triton.next_power_of_2(w.padded_k)))


def qgemv(
    w: GPUQuant,
    x: torch.Tensor,  # (S, L, K) or (L, K)
    *,
    norm_weight: torch.Tensor | None = None,  # (K,) or (L, K): RMSNorm each token first
    eps: float = 1e-5,
) -> torch.Tensor:
    """(S, L, O) (or (L, O)) = W[l] @ (norm(x[s, l]) or x[s, l]), fp32 sums, x's dtype."""
    one = x.dim() == 2
    xs = x.unsqueeze(0) if one else x
    assert xs.dim() == 3 and xs.is_contiguous(), f"x: expected contiguous (S, L, K), got {x.shape}"
    S, L, K = xs.shape
    assert 1 <= S <= MAX_TOKENS, f"x: {S} tokens, the products take 1 to {MAX_TOKENS}"
    assert w.data.dim() == 3 and w.data.shape[0] == L and w.k == K, (
        f"w: expected (L={L}, O, K={K}), got {tuple(w.shape)}"
    )
    assert all(t.is_contiguous() for t in w.fields), "w: fields must be contiguous"
    stride_nwl = 0
    if norm_weight is not None:
        stride_nwl = assert_norm_weight(norm_weight, L, K, "norm_weight")
    O = w.data.shape[1]
    block_o, block_k = tiles(w, L, O, xs)
    y = torch.empty((S, L, O), device=x.device, dtype=x.dtype)
    grid = (L, triton.cdiv(O, block_o))
    qgemv_kernel[grid](
        w.data, w.scale, w.mins if w.mins is not None else w.scale, xs,
        norm_weight if norm_weight is not None else xs, y,
        S, L, O, K, w.data.shape[-1], w.scale.shape[-1], eps, stride_nwl,
        INT4=w.fmt == "int4", HAS_NORM=norm_weight is not None, GROUP=w.group,
        BLOCK_S=triton.next_power_of_2(S), BLOCK_O=block_o, BLOCK_K=block_k,
        **launch_kwargs(xs),
    )  # fmt: skip
    return y[0] if one else y


def qgemv_reference(
    w: GPUQuant, x: torch.Tensor, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """qgemv in plain PyTorch: the dequantized fp32 matrix, fp32 products, one rounding."""
    xf = x.float()
    if norm_weight is not None:  # tiles.normed_chunk's rounding: fp32 statistics, one rounding
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xf = (xf * rstd * norm_weight.float()).to(x.dtype).float()
    wf = w.dequantize()  # (L, O, K)
    y = torch.einsum("lok,...lk->...lo", wf, xf)
    return y.to(x.dtype)
