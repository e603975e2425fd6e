"""Flash-decoding attention for one query token, GQA, masked by the cache's position buffer.

One token's attention reads the whole KV cache once: 2 * n * Hkv * hd elements for n valid
slots. With only Hkv (16 for Laneformer-2B) KV heads there are too few heads to occupy a GPU, so
the KV length is split as well (Flash-Decoding, Dao et al. 2023):

1. `attn_partial_kernel`, grid (Hkv, NUM_SPLITS): program (g, s) takes KV head g and the s-th
   chunk of the scanned slots, and all G = Hq/Hkv query heads that share g (so K/V are read once
   per group, not once per query head). It runs the online softmax over its chunk and writes the
   partial (running max m, sum l, unnormalised acc) per query head.
2. `attn_combine_kernel`, grid (Hq,): rescales the NUM_SPLITS partials to the global max and
   normalises: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

The grid is static (CUDA-graph friendly) while the context grows: the position is read on the
device and every split takes ceil(n / NUM_SPLITS) slots (rounded to BLOCK_N), so short contexts
are spread over all splits too. Slots scanned: min(position + 1, cap), i.e. [0, position] for a
full layer (slot = position) and the whole ring once a sliding layer has wrapped. A slot counts
iff 0 <= pos <= position and, on sliding layers, pos > position - window; the buffer's -1 marks
empty slots. Scores and softmax are fp32, in base 2 (the log2(e) factor is folded into the scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import cast_as, launch_kwargs, num_sms, pdl_prologue

LOG2E = 1.4426950408889634


@triton.jit
def attn_partial_kernel(
    # Pointers
    q_ptr,  # (Hq, hd)
    k_cache_ptr,  # (cap, Hkv, hd)
    v_cache_ptr,  # (cap, Hkv, hd)
    pos_cache_ptr,  # (cap,) int64
    position_ptr,  # (1,) int64
    m_ptr,  # (Hq, NUM_SPLITS) fp32, running max (base 2)
    l_ptr,  # (Hq, NUM_SPLITS) fp32, softmax denominator
    acc_ptr,  # (Hq, NUM_SPLITS, hd) fp32, unnormalised output
    # Sizes
    cap,
    n_kv,
    window,  # sliding window W, ignored unless HAS_WINDOW
    qk_scale,  # hd^-0.5 * log2(e)
    # Meta-parameters
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    pdl_prologue(USE_PDL)
    q_pos = tl.load(position_ptr)
    n_scan = tl.minimum(q_pos + 1, cap)
    chunk = tl.cdiv(tl.cdiv(n_scan, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_scan)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # (BLOCK_G,) query heads of this group
    q = tl.load(
        q_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)  # (BLOCK_G, BLOCK_D)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    row = n_kv * HEAD_DIM  # elements per cache slot
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        p_n = tl.load(pos_cache_ptr + offs_n, mask=mask_n, other=-1)
        valid = mask_n & (p_n >= 0) & (p_n <= q_pos)
        if HAS_WINDOW:
            valid = valid & (p_n > q_pos - window)
        kv_offs = offs_n[:, None] * row + kv_head * HEAD_DIM + offs_d[None, :]  # (BLOCK_N, BLOCK_D)
        kv_mask = valid[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32)
        # (BLOCK_G, BLOCK_N): G is 1 to 8, too small for tl.dot's 16-row minimum, so FMAs.
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: avoid inf-inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # (BLOCK_G, BLOCK_N), 0 where masked
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new

    part = heads * NUM_SPLITS + split  # (BLOCK_G,) index into (Hq, NUM_SPLITS)
    tl.store(m_ptr + part, m_i, mask=mask_g)
    tl.store(l_ptr + part, l_i, mask=mask_g)
    tl.store(
        acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        acc,
        mask=mask_g[:, None] & mask_d[None, :],
    )


@triton.jit
def attn_combine_kernel(
    m_ptr,  # (Hq, NUM_SPLITS) fp32
    l_ptr,  # (Hq, NUM_SPLITS) fp32
    acc_ptr,  # (Hq, NUM_SPLITS, hd) fp32
    out_ptr,  # (Hq, hd)
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    head = tl.program_id(0)
    pdl_prologue(USE_PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    m = tl.load(m_ptr + head * NUM_SPLITS + offs_s, mask=mask_s, other=float("-inf"))
    l_s = tl.load(l_ptr + head * NUM_SPLITS + offs_s, mask=mask_s, other=0.0)
    acc = tl.load(
        acc_ptr + (head * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # (BLOCK_S, BLOCK_D)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: output 0
    scale = tl.exp2(m - m_max)  # (BLOCK_S,), 0 for empty splits
    denom = tl.sum(scale * l_s, 0)
    out = tl.sum(scale[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + head * HEAD_DIM + offs_d, cast_as(out, out_ptr), mask=mask_d)


def _pick_splits(q: torch.Tensor, n_kv: int, cap: int, block_n: int) -> int:
    sms = num_sms(q)
    if sms == 0:  # interpreter: a few splits exercise the combine without many programs
        return min(4, triton.cdiv(cap, block_n))
    # ~2 programs per SM at full length; never more splits than BLOCK_N tiles in the cache.
    return max(1, min(triton.cdiv(2 * sms, n_kv), triton.cdiv(cap, block_n)))


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
    """softmax(q k^T / sqrt(hd)) v over the valid slots, GQA head h -> KV head h // (Hq/Hkv)."""
    cap, n_kv, hd = k_cache.shape
    assert q.dim() == 2 and q.shape[1] == hd and q.is_contiguous(), f"q: (Hq, {hd}), {q.shape}"
    n_q = q.shape[0]
    assert n_q % n_kv == 0, f"Hq={n_q} must be a multiple of Hkv={n_kv}"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.shape == (cap, n_kv, hd) and c.is_contiguous() and c.dtype == q.dtype, (
            f"{name}: expected contiguous {(cap, n_kv, hd)} {q.dtype}"
        )
    assert pos_cache.shape == (cap,) and pos_cache.dtype == torch.int64, "pos_cache: (cap,) int64"
    assert position.shape == (1,) and position.dtype == torch.int64, "position: (1,) int64"
    assert window is None or window >= 1, f"window={window}"

    group = n_q // n_kv
    block_d = triton.next_power_of_2(hd)
    # K and V tiles are (BLOCK_N, BLOCK_D) and the (G, BLOCK_N, BLOCK_D) products live in
    # registers, so BLOCK_N shrinks as the group grows (4096 elements: ~32 registers a thread).
    block_g = triton.next_power_of_2(group)
    block_n = max(16, min(64, 4096 // (block_g * block_d)))
    num_splits = num_splits or _pick_splits(q, n_kv, cap, block_n)
    m = torch.empty((n_q, num_splits), device=q.device, dtype=torch.float32)
    l_s = torch.empty_like(m)
    acc = torch.empty((n_q, num_splits, hd), device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    opts = launch_kwargs(q)
    attn_partial_kernel[(n_kv, num_splits)](
        q, k_cache, v_cache, pos_cache, position, m, l_s, acc,
        cap, n_kv, window or 0, hd**-0.5 * LOG2E,
        GROUP=group, HEAD_DIM=hd, NUM_SPLITS=num_splits, HAS_WINDOW=window is not None,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, **opts,
    )  # fmt: skip
    attn_combine_kernel[(n_q,)](
        m, l_s, acc, out,
        NUM_SPLITS=num_splits, HEAD_DIM=hd,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, **opts,
    )  # fmt: skip
    return out
