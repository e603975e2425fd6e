"""Flash-decoding GQA attention for S <= 8 new tokens, masked by the cache's position buffer.

Attention of S consecutive tokens (token s at position + s, its own key and those of tokens < s
already in the cache, written by norm_qkv) reads the scanned slots of the KV cache from HBM
about once for all of them: 2 * n * Hkv * hd elements for n scanned slots. With only Hkv (16
for Laneformer-2B) KV heads there are too few heads to occupy a GPU, so the slots are split as
well (Flash-Decoding, Dao et al. 2023).

One kernel, grid (S, Hkv, NUM_SPLITS): program (s, g, c) takes token s, KV head g and the c-th
split of the slots that token scans, for all G = Hq/Hkv query heads that share g (K/V are read
once per group; the S programs of a split run side by side, so the later tokens' K/V reads hit
L2). It runs the online softmax over its split and writes the partial (running max m, sum l,
unnormalised acc) of each head. The program that finishes last for its (token, KV head) (an
atomic count, reset by that program) combines the partials: out = sum_c 2^(m_c - M) acc_c /
sum_c 2^(m_c - M) l_c. No second kernel, no launch.

A token's program does exactly what a lone step at its position does: it scans min(position +
s + 1, cap) slots in the same splits and tiles (the splits spread the scanned slots, so short
contexts use every split too), and the keys of later tokens, or of older positions a ring
overwrote, are masked and add exact zeros. So token s's output has the bits of a lone step,
by construction. The grid is static (CUDA-graph friendly): the position is read on the device.
A slot counts for token s iff 0 <= pos <= position + s and, on sliding layers, pos > position
+ s - window; -1 marks empty slots. Scores and softmax are fp32, in base 2 (the log2(e) factor
is folded into the scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import MAX_TOKENS, tuning
from .gemv import launch_kwargs, num_sms
from .tiles import await_inputs, cast_as

LOG2E = 1.4426950408889634
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


@triton.jit
def attention_task(
    # Pointers
    q_ptr,  # (S, Hq, hd)
    k_cache_ptr,  # (cap, Hkv, hd)
    v_cache_ptr,  # (cap, Hkv, hd)
    pos_cache_ptr,  # (cap,) int64
    position_ptr,  # (1,) int64, position of token 0
    m_ptr,  # (S*Hq, NUM_SPLITS) fp32, running max (base 2)
    l_ptr,  # (S*Hq, NUM_SPLITS) fp32, softmax denominator
    acc_ptr,  # (S*Hq, NUM_SPLITS, hd) fp32, unnormalised output
    count_ptr,  # (MAX_TOKENS*Hkv,) int32 arrivals per (token, KV head), 0 between launches
    out_ptr,  # (S, Hq, hd)
    # Sizes
    cap,
    n_kv,
    window,  # sliding window W, ignored unless HAS_WINDOW
    qk_scale,  # hd^-0.5 * log2(e)
    tok,  # the program's coordinates: (token, KV head, split)
    kv_head,
    split,
    dep_ptr,  # what the inputs wait for (tiles.await_inputs)
    dep_target,
    max_spin,
    err_ptr,
    # Meta-parameters
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # NUM_SPLITS rounded up to a power of 2
    BLOCK_C: tl.constexpr,  # chunks whose partial outputs the combine loads at once
    PREFETCH: tl.constexpr,  # load tile i + 1 before computing tile i (same bits either way)
    USE_PDL: tl.constexpr,
    SYNC: tl.constexpr,
):
    """The work of program (tok, kv_head, split): a kernel's or a persistent kernel's task."""
    # K/V and q come from the previous kernel: nothing to prefetch
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
    q_pos = tl.load(position_ptr) + tok
    # Exactly what a lone step at q_pos scans: its own slots, chunks and tiles.
    n_scan = tl.minimum(q_pos + 1, cap)
    chunk = tl.cdiv(tl.cdiv(n_scan, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_busy = tl.cdiv(n_scan, chunk)  # chunks holding scanned slots
    if split < n_busy:
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n_scan)
        offs_g = tl.arange(0, BLOCK_G)
        mask_g = offs_g < GROUP
        part = tok * (n_kv * GROUP) + kv_head * GROUP + offs_g  # rows of (S*Hq, ...)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        q = tl.load(q_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)  # fmt: skip

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        row = n_kv * HEAD_DIM  # elements per cache slot
        kv_at = k_cache_ptr + kv_head * HEAD_DIM  # this head's slice of slot 0
        vv_at = v_cache_ptr + kv_head * HEAD_DIM
        if PREFETCH:  # the next tile's loads are in flight while this one is computed
            k, v, p_n = _tile(kv_at, vv_at, pos_cache_ptr, lo, hi, row, offs_d, mask_d, BLOCK_N)
            for n0 in range(lo, hi, BLOCK_N):
                k_nx, v_nx, p_nx = _tile(kv_at, vv_at, pos_cache_ptr, n0 + BLOCK_N, hi, row,
                                         offs_d, mask_d, BLOCK_N)  # fmt: skip
                m_i, l_i, acc = _update(q, k, v, p_n, n0, hi, q_pos, window, qk_scale, m_i, l_i,
                                        acc, HAS_WINDOW, BLOCK_N)  # fmt: skip
                k, v, p_n = k_nx, v_nx, p_nx
        else:
            for n0 in range(lo, hi, BLOCK_N):
                k, v, p_n = _tile(kv_at, vv_at, pos_cache_ptr, n0, hi, row, offs_d, mask_d,
                                  BLOCK_N)  # fmt: skip
                m_i, l_i, acc = _update(q, k, v, p_n, n0, hi, q_pos, window, qk_scale, m_i, l_i,
                                        acc, HAS_WINDOW, BLOCK_N)  # fmt: skip

        idx = part * NUM_SPLITS + split
        tl.store(m_ptr + idx, m_i, mask=mask_g)
        tl.store(l_ptr + idx, l_i, mask=mask_g)
        tl.store(acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=mask_g[:, None] & mask_d[None, :])  # fmt: skip
        # Every thread's partials are written before one thread's release increments the count
        # (the pattern of a cooperative grid sync); the last of n_busy arrivals combines.
        tl.debug_barrier()
        counter = count_ptr + tok * n_kv + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == n_busy - 1:
            tl.atomic_xchg(counter, 0)  # ready for the next launch / graph replay
            _combine(m_ptr, l_ptr, acc_ptr, out_ptr, part, mask_g, offs_d, mask_d, n_busy,
                     NUM_SPLITS, HEAD_DIM, BLOCK_G, BLOCK_D, SPLITS_P2, BLOCK_C)  # fmt: skip


@triton.jit
def attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_cache_ptr, position_ptr, m_ptr, l_ptr,
                     acc_ptr, count_ptr, out_ptr, cap, n_kv, window, qk_scale,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_C: tl.constexpr,
                     PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    # grid (S, Hkv, NUM_SPLITS): tokens fastest, so a chunk's tokens run together, K/V hit L2
    attention_task(q_ptr, k_cache_ptr, v_cache_ptr, pos_cache_ptr, position_ptr, m_ptr, l_ptr,
                   acc_ptr, count_ptr, out_ptr, cap, n_kv, window, qk_scale, tl.program_id(0),
                   tl.program_id(1), tl.program_id(2), None, 0, 0, None, GROUP, HEAD_DIM,
                   NUM_SPLITS, HAS_WINDOW, BLOCK_G, BLOCK_N, BLOCK_D, SPLITS_P2, BLOCK_C,
                   PREFETCH, USE_PDL, False)  # fmt: skip


@triton.jit
def _tile(k_at, v_at, pos_ptr, n0, hi, row, offs_d, mask_d, BLOCK_N: tl.constexpr):
    """The K and V tiles (BLOCK_N, BLOCK_D) of slots n0.. (< hi) as stored, and their positions.

    Loaded by slot range, not by validity, so the K/V loads do not wait for the positions' load
    (one memory round trip a tile instead of two); `_update` zeroes what a slot must not add."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    kv_offs = offs_n[None, :, None] * row + offs_d[None, None, :]  # (1, N, D)
    kv_mask = mask_n[None, :, None] & mask_d[None, None, :]
    k = tl.load(k_at + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_at + kv_offs, mask=kv_mask, other=0.0)
    return k, v, tl.load(pos_ptr + offs_n, mask=mask_n, other=-1)


@triton.jit
def _update(q, k, v, p_n, n0, hi, q_pos, window, qk_scale, m_i, l_i, acc,
            HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """One tile of the online softmax (base 2) for the BLOCK_G heads of q: (m, l, acc).

    A slot that is empty, past the range, in the future (a later token's key) or out of the
    window scores -inf and its value is zeroed: whatever it holds (stale keys, never-written
    memory) adds exact zeros."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    valid = (offs_n < hi) & (p_n >= 0) & (p_n <= q_pos)
    if HAS_WINDOW:
        valid = valid & (p_n > q_pos - window)
    k = k.to(tl.float32)
    v = tl.where(valid[None, :, None], v.to(tl.float32), 0.0)
    # (BLOCK_G, BLOCK_N): G is 1 to 8, too small for tl.dot's 16-row minimum, so FMAs.
    s = tl.sum(q[:, None, :] * k, 2) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # (BLOCK_G, BLOCK_N), 0 where masked
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 1)
    return m_new, l_i, acc


@triton.jit
def _combine(m_ptr, l_ptr, acc_ptr, out_ptr, part, mask_r, offs_d, mask_d, n_busy,
             NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, R: tl.constexpr,
             BLOCK_D: tl.constexpr, SPLITS_P2: tl.constexpr,
             BLOCK_C: tl.constexpr):  # fmt: skip
    """out = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c over chunks 0..n_busy-1.

    Every load is issued up front, not one chunk per loop trip: the maxima and sums of all
    chunks as one (R, NUM_SPLITS) tile, the partial outputs BLOCK_C chunks at a time in an
    unrolled loop, so the loads overlap and the combine costs a few memory round trips, not two
    per chunk (the serial form cost ~1 us a chunk on an H200 and made more splits a loss). The
    chunk-group sums are added in a fixed order: the bits depend on the launch configuration
    only, never on S. A chunk where a row saw no valid key holds (-inf, 0, 0) and adds exact
    zeros. Loads are .cg: other SMs wrote the partials, and this SM's L1 may hold a previous
    launch's lines."""
    offs_c = tl.arange(0, SPLITS_P2)
    mask_rc = mask_r[:, None] & (offs_c < n_busy)[None, :]
    idx = part[:, None] * NUM_SPLITS + offs_c[None, :]  # (R, SPLITS_P2)
    m_c = tl.load(m_ptr + idx, mask=mask_rc, other=float("-inf"), cache_modifier=".cg")
    l_c = tl.load(l_ptr + idx, mask=mask_rc, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_c, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no valid key at all: output 0
    denom = tl.sum(tl.exp2(m_c - m_max[:, None]) * l_c, 1)  # 0 for chunks without valid keys
    num = tl.zeros([R, BLOCK_D], dtype=tl.float32)
    for c0 in tl.static_range(0, SPLITS_P2, BLOCK_C):
        offs_g = c0 + tl.arange(0, BLOCK_C)
        mask_g = mask_r[:, None] & (offs_g < n_busy)[None, :]  # (R, BLOCK_C)
        at = part[:, None] * NUM_SPLITS + offs_g[None, :]
        m_g = tl.load(m_ptr + at, mask=mask_g, other=float("-inf"), cache_modifier=".cg")
        a_g = tl.load(acc_ptr + at[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=mask_g[:, :, None] & mask_d[None, None, :], other=0.0,
                      cache_modifier=".cg")  # fmt: skip
        num += tl.sum(tl.exp2(m_g - m_max[:, None])[:, :, None] * a_g, 1)  # a_g (R, C, D)
    out = num / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], cast_as(out, out_ptr),
             mask=mask_r[:, None] & mask_d[None, :])  # fmt: skip


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 arrival count per (token, KV head), shared by every launch on the device
    (the launches of a step run one after another, and each leaves its counts at 0)."""
    key = (str(device), n)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros((MAX_TOKENS * n,), device=device, dtype=torch.int32)
    return _COUNTERS[key]


def pick_splits(q: torch.Tensor, n_kv: int, cap: int, block_n: int) -> int:
    """Splits of the scanned slots per (token, KV head): ~2 programs per SM for one token."""
    sms = num_sms(q)
    if sms == 0:  # interpreter: a few splits exercise the combine without many programs
        return min(4, triton.cdiv(cap, block_n))
    return max(1, min(triton.cdiv(2 * sms, n_kv), triton.cdiv(cap, block_n)))


def attention_blocks(group: int, hd: int) -> tuple[int, int, int]:
    """(BLOCK_G, BLOCK_N, BLOCK_D): the (G, BLOCK_N, BLOCK_D) products live in registers, so
    BLOCK_N shrinks as the group grows (4096 elements: ~32 registers a thread), floored at 16."""
    block_g = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(hd)
    return block_g, max(16, min(64, 4096 // (block_g * block_d))), block_d


def attention_config(q: torch.Tensor, cap: int, n_kv: int, group: int, hd: int,
                     num_splits: int | None = None,
                     block_n: int | None = None) -> tuple[dict, dict]:  # fmt: skip
    """(constexprs, launch options) for a cache of cap slots: the default, the GPU's table, or
    the forced splits / tile."""
    block_g, auto_n, block_d = attention_blocks(group, hd)
    default = {
        "BLOCK_N": auto_n,
        "NUM_SPLITS": pick_splits(q, n_kv, cap, auto_n),
        "BLOCK_C": 8,
        "PREFETCH": 0,
    }
    key = tuning.shape_key(C=cap, H=n_kv, G=group, D=hd)
    cfg = tuning.choose("attention", q, key, default)
    if block_n:
        cfg["BLOCK_N"] = block_n
    if num_splits:
        cfg["NUM_SPLITS"] = num_splits
    consts, opts = tuning.split(cfg)
    consts["SPLITS_P2"] = triton.next_power_of_2(consts["NUM_SPLITS"])
    consts["BLOCK_C"] = min(consts["BLOCK_C"], consts["SPLITS_P2"])
    return {**consts, "BLOCK_G": block_g, "BLOCK_D": block_d}, opts


def decode_attention(
    q: torch.Tensor,  # (Hq, hd) or (S, Hq, hd), RoPE applied
    k_cache: torch.Tensor,  # (cap, Hkv, hd)
    v_cache: torch.Tensor,  # (cap, Hkv, hd)
    pos_cache: torch.Tensor,  # (cap,) int64
    position: torch.Tensor,  # (1,) int64, position of token 0
    *,
    window: int | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(hd)) v over each token's valid slots, GQA head h -> KV head
    h // (Hq/Hkv); token s sees positions <= position + s."""
    cap, n_kv, hd = k_cache.shape
    axis = q.dim() == 3
    qs = q if axis else q.unsqueeze(0)
    assert qs.dim() == 3 and qs.shape[2] == hd and qs.is_contiguous(), (
        f"q: expected contiguous (Hq, {hd}) or (S, Hq, {hd}), got {tuple(q.shape)}"
    )
    S, n_q = qs.shape[:2]
    assert S <= MAX_TOKENS, f"q: {S} tokens, at most {MAX_TOKENS}"
    assert n_q % n_kv == 0, f"Hq={n_q} must be a multiple of Hkv={n_kv}"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.shape == (cap, n_kv, hd) and c.is_contiguous() and c.dtype == q.dtype, (
            f"{name}: expected contiguous {(cap, n_kv, hd)} {q.dtype}"
        )
    assert pos_cache.shape == (cap,) and pos_cache.dtype == torch.int64, "pos_cache: (cap,) int64"
    assert position.shape == (1,) and position.dtype == torch.int64, "position: (1,) int64"
    assert window is None or window >= 1, f"window={window}"

    group = n_q // n_kv
    consts, opts = attention_config(q, cap, n_kv, group, hd, num_splits, block_n)
    ns = consts["NUM_SPLITS"]
    m = torch.empty((S * n_q, ns), device=q.device, dtype=torch.float32)
    l_s = torch.empty_like(m)
    acc = torch.empty((S * n_q, ns, hd), device=q.device, dtype=torch.float32)
    out = torch.empty_like(qs)
    attention_kernel[(S, n_kv, ns)](
        qs, k_cache, v_cache, pos_cache, position, m, l_s, acc, _counters(q.device, n_kv), out,
        cap, n_kv, window or 0, hd**-0.5 * LOG2E,
        GROUP=group, HEAD_DIM=hd, HAS_WINDOW=window is not None, **consts, **opts,
        **launch_kwargs(q),
    )  # fmt: skip
    return out if axis else out[0]
