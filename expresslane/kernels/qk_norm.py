"""qwen3's q/k norm inside norm_qkv: a query or key head normalised over all its rows before RoPE.

norm_qkv splits a head over hd/2 / BLOCK_P programs. Each writes its rows (rounded, biases added)
to an fp32 scratch; the last of the head's programs to arrive (an acq_rel counter, the pattern of
decode_attention's combine) normalises the whole head, a token at a time, scales it, rotates it
and stores it: q, or k into its cache slot. Whole heads per program would need no counter but
leave a 0.6B qwen3 with 32 programs a layer on a 132-SM GPU; the scratch round trip is a few KB
through L2. Rounding follows transformers' Qwen3RMSNorm: x / rms(x) rounded to the activation
dtype, times the scale, rounded again (ref.norm_qkv, model.rms_norm with round_before_scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import MAX_TOKENS
from .tiles import cast_as, rms_rstd, round_as

_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def qk_scratch(device: torch.device, heads: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k norm's fp32 rows (MAX_TOKENS, heads, hd) and zeroed int32 arrival counts
    (heads,), shared by every launch on the device: a step's launches run one after another, and
    each leaves its counts at 0. Allocated on the first (uncaptured) call, as decode_attention's
    counters are."""
    key = (str(device), heads, hd)
    if key not in _SCRATCH:
        _SCRATCH[key] = (
            torch.empty((MAX_TOKENS * heads * hd,), device=device, dtype=torch.float32),
            torch.zeros((heads,), device=device, dtype=torch.int32),
        )
    return _SCRATCH[key]


@triton.jit
def qk_norm_head(a0, a1, r0, r1, mask_s, unit, lane, L, S, pos0, cap, N_KV, n_units, raw_ptr,
                 count_ptr, g_ptr, out, out_stride, cos_ptr, sin_ptr, eps,
                 HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCKS_PER_HEAD: tl.constexpr):  # fmt: skip
    """qwen3's q/k norm: this program's rows (a0, a1) of head `unit` go to the scratch; the last
    of the head's BLOCKS_PER_HEAD programs to arrive (the pattern of decode_attention's combine)
    normalises the whole head, scales it, rotates it and stores it."""
    raw = raw_ptr + ((tl.arange(0, BLOCK_S) * L + lane) * n_units + unit) * HEAD_DIM  # (BLOCK_S,)
    tl.store(raw[:, None] + r0[None, :], a0, mask=mask_s[:, None])
    tl.store(raw[:, None] + r1[None, :], a1, mask=mask_s[:, None])
    tl.debug_barrier()  # every thread's rows are written before the head is read back
    if BLOCKS_PER_HEAD == 1:
        norm_rope_rows(raw_ptr, unit, lane, L, S, pos0, cap, N_KV, n_units, g_ptr, out,
                       out_stride, cos_ptr, sin_ptr, eps, HEAD_DIM, INTERLEAVED, BLOCK_S,
                       BLOCK_H)  # fmt: skip
    else:
        counter = count_ptr + lane * n_units + unit
        if tl.atomic_add(counter, 1, sem="acq_rel") == BLOCKS_PER_HEAD - 1:
            tl.atomic_xchg(counter, 0)  # ready for the next launch / graph replay
            norm_rope_rows(raw_ptr, unit, lane, L, S, pos0, cap, N_KV, n_units, g_ptr, out,
                           out_stride, cos_ptr, sin_ptr, eps, HEAD_DIM, INTERLEAVED,
                           BLOCK_S, BLOCK_H)  # fmt: skip


@triton.jit
def norm_rope_rows(raw_ptr, unit, lane, L, S, pos0, cap, N_KV, n_units, g_ptr, out, out_stride,
                   cos_ptr, sin_ptr, eps, HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """One head of every token, a token at a time: x / rms(x), rounded, times g, rounded (the
    order of transformers' Qwen3RMSNorm), then RoPE in fp32. Each token's statistics come from
    its own 1-D row load (tiles.rms_rstd), so its bits do not depend on S."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HALF
    if INTERLEAVED:
        h0 = 2 * offs_h
        h1 = h0 + 1
    else:
        h0 = offs_h
        h1 = offs_h + HALF
    g0 = tl.load(g_ptr + h0, mask=mask_h, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + h1, mask=mask_h, other=0.0).to(tl.float32)
    for s in tl.static_range(BLOCK_S):
        if s < S:
            row = raw_ptr + ((s * L + lane) * n_units + unit) * HEAD_DIM
            rstd = rms_rstd(row, HEAD_DIM, eps, 64)
            x0 = tl.load(row + h0, mask=mask_h, other=0.0)
            x1 = tl.load(row + h1, mask=mask_h, other=0.0)
            y0 = round_as(round_as(x0 * rstd, out) * g0, out)
            y1 = round_as(round_as(x1 * rstd, out) * g1, out)
            angle = (pos0 + s) * HALF + offs_h
            c = tl.load(cos_ptr + angle, mask=mask_h, other=1.0)
            sn = tl.load(sin_ptr + angle, mask=mask_h, other=0.0)
            if out_stride == 0:  # a key: the cache slot of its position
                dst = out + ((pos0 + s) % cap) * N_KV * HEAD_DIM
            else:
                dst = out + s * out_stride
            tl.store(dst + h0, cast_as(y0 * c - y1 * sn, out), mask=mask_h)
            tl.store(dst + h1, cast_as(y0 * sn + y1 * c, out), mask=mask_h)
