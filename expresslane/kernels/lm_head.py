"""Final norm + LM head, fused with greedy argmax, or producing fp32 logits for sampling.

Every kernel takes S <= 8 tokens (h (S, L, D)), reading the head weights once for all of them;
each token's logits are reduced in the same order whatever S is.

Head types (laneformer.md 6), h (L, D) the final residual stream, n_l = final_norm(h_l):
    replicate          W (V, D)      on mean_l n_l, or on norm(sum_l h_l) with pre_norm_lane_agg
    lane               W (V, L*D)    on the lane-major concatenation [n_0, n_1, ...]
    vocab_parallel     W (L, V/L, D) lane l: W[l] @ n_l, the lanes' slices concatenated in order

`head_logits` (a jit helper) computes BLOCK_V fp32 logits of one program, normalising the input
on the fly (each program re-reads h from L2; a separate norm kernel would cost a launch). Two
kernels use it, so greedy and sampling see bitwise the same logits:
- `head_argmax_kernel` keeps only its block's (max, first index) and `argmax_combine_kernel`
  reduces those few hundred pairs; ties go to the lowest index, like torch.argmax. Nothing of
  size V is ever written: the greedy path reads the head weights and writes 8 bytes.
- `head_logits_kernel` writes the fp32 logits (V,) once, for temperature / top-k / top-p.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .gemv import assert_norm_weight, block_s, fit_rows, launch_kwargs, num_sms, tokens_of
from .tiles import await_inputs, normed_rows, rms_rstd_rows, round_as

HEAD_MODES = {"replicate": 0, "replicate_prenorm": 1, "lane": 2, "vocab_parallel": 3}


@triton.jit
def _lane_sum_chunk(h_ptr, offs_s, offs_k, mask_k, S, L, D, BLOCK_S: tl.constexpr,
                    BLOCK_K: tl.constexpr):  # fmt: skip
    """(BLOCK_S, BLOCK_K) sum_l h[s, l, offs_k], lane by lane (fp32), rounded like the reference.
    Sums here run lane by lane or row by row, never as a tree over a tile with a token axis,
    whose layout (and so whose order) would follow BLOCK_S."""
    m = (offs_s[:, None] < S) & mask_k[None, :]
    acc = tl.zeros([BLOCK_S, BLOCK_K], dtype=tl.float32)
    for src in range(L):
        x = tl.load(h_ptr + (offs_s[:, None] * L + src) * D + offs_k[None, :], mask=m, other=0.0)
        acc += x.to(tl.float32)
    return round_as(acc, h_ptr)


@triton.jit
def _prenorm_rstd(h_ptr, S, L, D, eps, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """(BLOCK_S,) rsqrt(mean(sum_l h[s, l]^2) + eps), token by token (1-D reductions)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs1 = tl.arange(0, 1)
    out = tl.full([BLOCK_S], 1.0, dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):
        if s < S:
            ss = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xs = _lane_sum_chunk(h_ptr + s * L * D, offs1, offs_k, offs_k < D, 1, L, D, 1,
                                     BLOCK_K)  # fmt: skip
                ss += tl.sum(xs * xs, 0)
            r = 1.0 / tl.sqrt(tl.sum(ss, 0) / D + eps)
            out = tl.where(offs_s == s, r, out)
    return out


@triton.jit
def head_logits(
    h_ptr, nw_ptr, w_ptr, S, L, D, VL, eps, stride_nwl, lane, offs_v, mask_v,
    MODE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
):  # fmt: skip
    """(BLOCK_S, BLOCK_V) fp32 logits of rows offs_v (rows of lane `lane`'s slice for
    vocab_parallel) for every token, one read of those weight rows."""
    offs_s = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S, BLOCK_V, BLOCK_K], dtype=tl.float32)
    if MODE == 0:  # replicate: mean over lanes of the normed lanes
        mask_s = offs_s < S
        # each lane's statistics once (a pass over D), not once per chunk of D
        offs_l = tl.arange(0, BLOCK_L)
        rstds = tl.full([BLOCK_L, BLOCK_S], 1.0, dtype=tl.float32)
        for src in range(L):
            r = rms_rstd_rows(h_ptr + src * D, L * D, S, D, eps, BLOCK_S, BLOCK_K)
            rstds = tl.where(offs_l[:, None] == src, r[None, :], rstds)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            xsum = tl.zeros([BLOCK_S, BLOCK_K], dtype=tl.float32)
            for src in range(L):  # lane by lane (see _lane_sum_chunk)
                x_row = h_ptr + src * D  # token s: x_row + s * L * D
                rstd = tl.sum(tl.where(offs_l[:, None] == src, rstds, 0.0), 0)  # exact: one term
                xsum += normed_rows(x_row, L * D, S, nw_ptr + src * stride_nwl, offs_k, mask_k,
                                    rstd, True, BLOCK_S)  # fmt: skip
            xm = round_as(xsum / L, h_ptr)  # (BLOCK_S, BLOCK_K)
            xm = tl.where(mask_s[:, None], xm, 0.0)
            w = tl.load(w_ptr + offs_v[None, :, None] * D + offs_k[None, None, :],
                        mask=mask_v[None, :, None] & mask_k[None, None, :], other=0.0)  # fmt: skip
            acc += w.to(tl.float32) * xm[:, None, :]
    elif MODE == 1:  # replicate, pre_norm_lane_agg: norm of the lane sum (shared weight)
        rstd = _prenorm_rstd(h_ptr, S, L, D, eps, BLOCK_S, BLOCK_K)  # (BLOCK_S,)
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            xs = _lane_sum_chunk(h_ptr, offs_s, offs_k, mask_k, S, L, D, BLOCK_S, BLOCK_K)
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            xn = round_as(xs * rstd[:, None] * nw[None, :], h_ptr)
            w = tl.load(w_ptr + offs_v[None, :, None] * D + offs_k[None, None, :],
                        mask=mask_v[None, :, None] & mask_k[None, None, :], other=0.0)  # fmt: skip
            acc += w.to(tl.float32) * xn[:, None, :]
    else:  # lane (all lanes, W row = L*D wide) or vocab_parallel (one lane, its own W slice)
        if MODE == 2:
            lane_lo = 0
            lane_hi = L
            row_len = L * D
            w_base = w_ptr
        else:
            lane_lo = lane
            lane_hi = lane + 1
            row_len = D
            w_base = w_ptr + lane * VL * D
        for src in range(lane_lo, lane_hi):
            x_row = h_ptr + src * D  # token s: x_row + s * L * D
            rstd = rms_rstd_rows(x_row, L * D, S, D, eps, BLOCK_S, BLOCK_K)
            col0 = (src - lane_lo) * D  # this lane's columns inside the W row
            for k0 in range(0, D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < D
                xn = normed_rows(x_row, L * D, S, nw_ptr + src * stride_nwl, offs_k, mask_k,
                                 rstd, True, BLOCK_S)  # fmt: skip
                w = tl.load(w_base + offs_v[None, :, None] * row_len + col0 + offs_k[None, None, :],
                            mask=mask_v[None, :, None] & mask_k[None, None, :],
                            other=0.0)  # fmt: skip
                acc += w.to(tl.float32) * xn[:, None, :]
    return tl.sum(acc, 2)


@triton.jit
def head_logits_task(
    h_ptr, nw_ptr, w_ptr, logits_ptr, S, L, D, VL, V, eps, stride_nwl, lane, pid_v,
    dep_ptr, dep_target, max_spin, err_ptr,
    MODE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    """Program (lane, pid_v) of the logits: lane is 0 but for vocab_parallel."""
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < VL
    logits = head_logits(h_ptr, nw_ptr, w_ptr, S, L, D, VL, eps, stride_nwl, lane, offs_v,
                         mask_v, MODE, BLOCK_S, BLOCK_V, BLOCK_K, BLOCK_L)  # fmt: skip
    offs_s = tl.arange(0, BLOCK_S)
    dst = logits_ptr + offs_s[:, None] * V + lane * VL + offs_v[None, :]
    tl.store(dst, logits, mask=(offs_s[:, None] < S) & mask_v[None, :])


@triton.jit
def head_logits_kernel(
    h_ptr, nw_ptr, w_ptr, logits_ptr, S, L, D, VL, V, eps, stride_nwl,
    MODE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    head_logits_task(h_ptr, nw_ptr, w_ptr, logits_ptr, S, L, D, VL, V, eps, stride_nwl,
                     tl.program_id(0), tl.program_id(1), None, 0, 0, None, MODE, BLOCK_S,
                     BLOCK_V, BLOCK_K, BLOCK_L, USE_PDL, False)  # fmt: skip


@triton.jit
def head_argmax_task(
    h_ptr, nw_ptr, w_ptr, part_val_ptr, part_idx_ptr, S, L, D, VL, eps, stride_nwl, lane, pid_v,
    n_lanes, n_v, dep_ptr, dep_target, max_spin, err_ptr,
    MODE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr, SYNC: tl.constexpr,
):  # fmt: skip
    """Program (lane, pid_v) of (n_lanes, n_v): its block's (max, first index) for each token."""
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < VL
    logits = head_logits(h_ptr, nw_ptr, w_ptr, S, L, D, VL, eps, stride_nwl, lane, offs_v,
                         mask_v, MODE, BLOCK_S, BLOCK_V, BLOCK_K, BLOCK_L)  # fmt: skip
    logits = tl.where(mask_v[None, :], logits, float("-inf"))  # (BLOCK_S, BLOCK_V)
    best = tl.argmax(logits, 1, tie_break_left=True)  # first index of each token's block max
    n_parts = n_lanes * n_v
    offs_s = tl.arange(0, BLOCK_S)
    part = offs_s * n_parts + lane * n_v + pid_v  # (S, n_parts) partials
    mask_s = offs_s < S
    tl.store(part_val_ptr + part, tl.max(logits, 1), mask=mask_s)
    tl.store(part_idx_ptr + part, lane * VL + pid_v * BLOCK_V + best, mask=mask_s)


@triton.jit
def head_argmax_kernel(
    h_ptr, nw_ptr, w_ptr, part_val_ptr, part_idx_ptr, S, L, D, VL, eps, stride_nwl,
    MODE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    head_argmax_task(h_ptr, nw_ptr, w_ptr, part_val_ptr, part_idx_ptr, S, L, D, VL, eps,
                     stride_nwl, tl.program_id(0), tl.program_id(1), tl.num_programs(0),
                     tl.num_programs(1), None, 0, 0, None, MODE, BLOCK_S, BLOCK_V, BLOCK_K,
                     BLOCK_L, USE_PDL, False)  # fmt: skip


@triton.jit
def argmax_combine_task(part_val_ptr, part_idx_ptr, token_ptr, n_parts, tok, dep_ptr, dep_target,
                        max_spin, err_ptr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
                        SYNC: tl.constexpr):  # fmt: skip
    """Token tok's greedy pick from the (max, first index) pairs of every block, BLOCK pairs at
    a time (combine_block: a 150k vocabulary's 8k pairs at once spilled at 2 warps). The pick
    is the maximum and the lowest index holding it: the same whatever the chunking."""
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    first = tl.full([BLOCK], 2**62, dtype=tl.int64)
    for p0 in range(0, n_parts, BLOCK):
        mask = p0 + offs < n_parts
        at = tok * n_parts + p0 + offs
        val = tl.load(part_val_ptr + at, mask=mask, other=float("-inf"), cache_modifier=".cg")
        idx = tl.load(part_idx_ptr + at, mask=mask, other=2**62, cache_modifier=".cg")
        # per slot: the larger value, or on a tie the lower index (blocks are not in index order)
        take = (val > best) | ((val == best) & (idx < first))
        best = tl.where(take, val, best)
        first = tl.where(take, idx, first)
    top = tl.max(best, 0)
    tl.store(token_ptr + tok, tl.min(tl.where(best == top, first, 2**62), 0))


COMBINE_MAX = 1024  # pairs a combine reads at once: 16 + 16 registers a thread at 2 warps


def combine_block(n_parts: int) -> int:
    """The pairs argmax_combine_task reads at once: all of them up to COMBINE_MAX."""
    return min(triton.next_power_of_2(n_parts), COMBINE_MAX)


@triton.jit
def argmax_combine_kernel(part_val_ptr, part_idx_ptr, token_ptr, n_parts, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr):  # fmt: skip
    argmax_combine_task(part_val_ptr, part_idx_ptr, token_ptr, n_parts, tl.program_id(0), None,
                        0, 0, None, BLOCK, USE_PDL, False)  # fmt: skip


def _prepare(h, norm_weight, w, head_type, pre_norm_lane_agg):
    """Checks shapes, returns (mode, lanes in grid, rows per lane VL, stride_nwl, V)."""
    L, D = h.shape[-2:]
    assert w.is_contiguous() and w.dtype == h.dtype, f"head weight: contiguous {h.dtype}"
    stride_nwl = assert_norm_weight(norm_weight, L, D, "norm_weight")
    if head_type == "replicate":
        assert w.dim() == 2 and w.shape[1] == D, f"replicate head: (V, {D}), got {w.shape}"
        if pre_norm_lane_agg:
            assert stride_nwl == 0, "pre_norm_lane_agg needs a shared (D,) final norm"
        mode = "replicate_prenorm" if pre_norm_lane_agg else "replicate"
        return HEAD_MODES[mode], 1, w.shape[0], stride_nwl, w.shape[0]
    assert not pre_norm_lane_agg, "pre_norm_lane_agg is only valid with head_type='replicate'"
    if head_type == "lane":
        assert w.dim() == 2 and w.shape[1] == L * D, f"lane head: (V, {L * D}), got {w.shape}"
        return HEAD_MODES["lane"], 1, w.shape[0], stride_nwl, w.shape[0]
    assert head_type == "vocab_parallel", f"head_type={head_type!r}"
    assert w.dim() == 3 and w.shape[0] == L and w.shape[2] == D, (
        f"vocab_parallel head: expected ({L}, V/L, {D}), got {tuple(w.shape)}"
    )
    return HEAD_MODES["vocab_parallel"], L, w.shape[1], stride_nwl, L * w.shape[1]


def _blocks(h: torch.Tensor, vl: int, lanes: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_K): the default below, or the GPU's tuning table (one choice for the
    logits and the argmax kernels, so greedy and sampling see the same bits)."""
    D = h.shape[-1]
    if num_sms(h) == 0:
        default = {"BLOCK_V": min(triton.next_power_of_2(vl), 64),
                   "BLOCK_K": min(triton.next_power_of_2(D), 512)}  # fmt: skip
    else:
        block_v = 32  # shrink until ~4 programs per SM
        while block_v > 8 and lanes * triton.cdiv(vl, block_v) < 4 * num_sms(h):
            block_v //= 2
        # (BLOCK_V, BLOCK_K) fp32 accumulator <= 4096 elements (see gemv.tile_sizes): an sm_90
        # build of a 32 x 256 tile needs 153-158 registers (3 CTAs per SM) where 32 x 128 needs
        # 80-91 (5-6).
        default = {"BLOCK_V": block_v, "BLOCK_K": min(triton.next_power_of_2(D), 4096 // block_v)}
    cfg = tuning.choose("lm_head", h, tuning.shape_key(L=lanes, V=vl, D=D), default)
    return fit_rows(h, cfg["BLOCK_V"], cfg["BLOCK_K"], h.shape[0]), cfg["BLOCK_K"]


def lm_head_logits(
    h: torch.Tensor,  # (L, D) or (S, L, D) final residual stream
    norm_weight: torch.Tensor,  # (D,) or (L, D) final norm
    w: torch.Tensor,  # (V, D) replicate, (V, L*D) lane, (L, V/L, D) vocab_parallel
    *,
    head_type: str,
    eps: float = 1e-5,
    pre_norm_lane_agg: bool = False,
) -> torch.Tensor:
    """fp32 logits (V,) or (S, V); vocab_parallel concatenates the lanes' slices in lane order."""
    hs, axis = tokens_of(h, "h")
    S, L, D = hs.shape
    mode, lanes, vl, stride_nwl, V = _prepare(hs, norm_weight, w, head_type, pre_norm_lane_agg)
    block_v, block_k = _blocks(hs, vl, lanes)
    logits = torch.empty((S, V), device=h.device, dtype=torch.float32)
    head_logits_kernel[(lanes, triton.cdiv(vl, block_v))](
        hs, norm_weight, w, logits, S, L, D, vl, V, eps, stride_nwl,
        MODE=mode, BLOCK_S=block_s(S), BLOCK_V=block_v, BLOCK_K=block_k,
        BLOCK_L=triton.next_power_of_2(L), **launch_kwargs(h),
    )  # fmt: skip
    return logits if axis else logits[0]


def lm_head_argmax(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    w: torch.Tensor,
    *,
    head_type: str,
    eps: float = 1e-5,
    pre_norm_lane_agg: bool = False,
) -> torch.Tensor:
    """Greedy token of each row: (1,) int64 for h (L, D), (S,) for h (S, L, D); ties go to the
    lowest index (torch.argmax's rule)."""
    hs, _ = tokens_of(h, "h")
    S, L, D = hs.shape
    mode, lanes, vl, stride_nwl, V = _prepare(hs, norm_weight, w, head_type, pre_norm_lane_agg)
    block_v, block_k = _blocks(hs, vl, lanes)
    grid = (lanes, triton.cdiv(vl, block_v))
    n_parts = grid[0] * grid[1]
    part_val = torch.empty((S, n_parts), device=h.device, dtype=torch.float32)
    part_idx = torch.empty((S, n_parts), device=h.device, dtype=torch.int64)
    token = torch.empty((S,), device=h.device, dtype=torch.int64)
    opts = launch_kwargs(h)
    head_argmax_kernel[grid](
        hs, norm_weight, w, part_val, part_idx, S, L, D, vl, eps, stride_nwl,
        MODE=mode, BLOCK_S=block_s(S), BLOCK_V=block_v, BLOCK_K=block_k,
        BLOCK_L=triton.next_power_of_2(L), **opts,
    )  # fmt: skip
    argmax_combine_kernel[(S,)](
        part_val, part_idx, token, n_parts, BLOCK=combine_block(n_parts), **opts
    )
    return token
