"""The Triton pieces every decode kernel is built from: rounding, the fused RMSNorm prologue,
weight tiles streamed for S tokens, and the wait for a kernel's inputs.

- `round_as` / `cast_as`: round an fp32 value to a pointer's element type (and back), to
  reproduce the reference's rounding points exactly.
- `rms_rstd` / `rms_rstd_rows` / `normed_chunk` / `normed_rows` / `normed_tile`: the fused
  RMSNorm prologue (fp32 statistics, one rounding), a token's statistics always from its own
  row, so that they do not depend on how many tokens share the launch.
- `first_tile` / `stream_rows` / `stream_pair`: a program's weight rows streamed once for all
  S tokens, the first tile loaded before the wait (weights never depend on the previous kernel).
- `pdl_prologue` / `pdl_wait` / `await_inputs`: Programmatic Dependent Launch (gemv.pdl_enabled
  says when), or, as a task of the persistent kernel, the count of the phase a task reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .grid_sync import wait_count


@triton.jit
def round_as(x, like_ptr):
    """fp32 x rounded (to nearest even) to like_ptr's element type, back in fp32.

    bf16 is rounded with integer ops rather than `.to(tl.bfloat16)`: identical on a GPU, but the
    interpreter's bf16 cast truncates, which would bias every rounding point of a CPU test.
    """
    if like_ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # RTNE on the low 16 bits
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def cast_as(x, like_ptr):
    """fp32 x converted to like_ptr's element type for a store (exact RTNE, see round_as)."""
    # round_as's body, not a call: the interpreter pays ~1 ms per nested jit call.
    if like_ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(like_ptr.dtype.element_ty)


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel start its prologue."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def rms_rstd_rows(x_ptr, row_stride, n_rows, K, eps, BLOCK_S: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """(BLOCK_S,) rsqrt(mean(x_s^2) + eps) of the rows x_ptr + s * row_stride, s < n_rows.

    One row at a time, each through rms_rstd's 1-D reduction: a 2-D (BLOCK_S, BLOCK_K) sum
    would be laid out by BLOCK_S (an sm_90 build put 4 warps along K for one row and 1 for 8),
    so a token's statistics would depend on how many tokens share the launch."""
    offs_s = tl.arange(0, BLOCK_S)
    out = tl.full([BLOCK_S], 1.0, dtype=tl.float32)
    for s in tl.static_range(BLOCK_S):
        if s < n_rows:
            r = rms_rstd(x_ptr + s * row_stride, K, eps, BLOCK_K)
            out = tl.where(offs_s == s, r, out)
    return out


@triton.jit
def normed_rows(x_ptr, row_stride, n_rows, nw_ptr, offs_k, mask_k, rstd, HAS_NORM: tl.constexpr,
                BLOCK_S: tl.constexpr):  # fmt: skip
    """(BLOCK_S, BLOCK_K) chunk of the token rows (or their RMSNorm), fp32, rounded like the
    reference; rstd (BLOCK_S,) from rms_rstd_rows."""
    offs_s = tl.arange(0, BLOCK_S)
    m = (offs_s[:, None] < n_rows) & mask_k[None, :]
    x = tl.load(x_ptr + offs_s[:, None] * row_stride + offs_k[None, :], mask=m, other=0.0)
    x = x.to(tl.float32)
    if HAS_NORM:
        w = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = round_as(x * rstd[:, None] * w[None, :], x_ptr)
    return x


@triton.jit
def normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, mask_k, rstd,
                HAS_NORM: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """normed_rows as a (BLOCK_S, 1, BLOCK_K) operand of the (BLOCK_S, rows, BLOCK_K) product.

    With several tokens the chunk is loaded with the rows' axis in place (size 1, broadcast over
    the tile's rows), as first_tile loads the weights with the tokens' axis: the 8-token sm_90
    builds of norm_qkv and norm_swiglu then convert nothing through shared memory on each trip
    (the 2-D chunk expanded with [:, None, :] was converted every trip). One token keeps the
    2-D load: loaded 3-D, the 1-token builds gained two conversions a trip instead (tried
    2026-11-27); those builds are the decode step, and stay as they were, bit for bit."""
    if BLOCK_S == 1:
        x = normed_rows(x_ptr, row_stride, n_rows, nw_ptr, offs_k, mask_k, rstd, HAS_NORM,
                        BLOCK_S)[:, None, :]  # fmt: skip
    else:
        offs_s = tl.arange(0, BLOCK_S)
        m = (offs_s[:, None, None] < n_rows) & mask_k[None, None, :]
        x = tl.load(x_ptr + offs_s[:, None, None] * row_stride + offs_k[None, None, :], mask=m,
                    other=0.0).to(tl.float32)  # fmt: skip
        if HAS_NORM:
            w = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            x = round_as(x * rstd[:, None, None] * w[None, None, :], x_ptr)
    return x


@triton.jit
def rms_rstd(x_ptr, K, eps, BLOCK_K: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the K-vector at x_ptr, in fp32.

    Summed 64 wide: element i adds x[i], x[i + 64], ... in order, then one 64-wide reduction.
    64 fp32 values lie on 2 warps whatever num_warps is (>= 2; the other warps hold copies), so
    the order is the same for 2, 4 or 8 warps. A BLOCK_K-wide sum is laid out over every warp,
    and a launch with fewer warps (fit_warps) summed in another order. BLOCK_K // 64
    independent loads a trip keep the loop as short as one BLOCK_K-wide load a trip; 64 wide,
    not 32, because the sm_90 build of norm_swiglu then keeps 72 registers (7 blocks per SM)
    instead of 79."""
    offs = tl.arange(0, 64)
    acc = tl.zeros([64], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(0, BLOCK_K, 64):
            at = k0 + j + offs
            x = tl.load(x_ptr + at, mask=at < K, other=0.0).to(tl.float32)
            acc += x * x
    return 1.0 / tl.sqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def normed_chunk(x_ptr, nw_ptr, offs_k, mask_k, rstd, HAS_NORM: tl.constexpr):
    """x[offs_k] (or its RMSNorm with weight nw) as fp32, rounded like the reference."""
    x = tl.load(x_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        x = round_as(x * rstd * w, x_ptr)
    return x


@triton.jit
def first_tile(w_rows, mask_o, k_lo, k_hi, BLOCK_K: tl.constexpr):
    """The (1, BLOCK_O, BLOCK_K) weight tile at k_lo: loaded before the PDL wait, since weights
    never depend on the previous kernel (the stream starts while that kernel drains).

    Loaded with the token axis already in place (size 1, broadcast over the tokens): triton then
    lays the (BLOCK_S, BLOCK_O, BLOCK_K) accumulator out as the load (16-byte vectors along K,
    warps along the rows). A 2-D tile expanded with [None, :, :] kept the 2-D load's layout and
    was converted to the accumulator's through shared memory on every tile: the sm_90 builds of
    norm_swiglu, gemv_reduce and the head took 4 KB of shared memory and 8-10 more registers
    than the one-token kernels of 9227b48 (one block fewer per SM), and every kernel got slower
    when the token axis came (kernels/aot.py shows both)."""
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    m = mask_o[:, None] & (offs_k < k_hi)[None, :]
    return tl.load(w_rows[None, :, :] + offs_k[None, None, :], mask=m[None, :, :], other=0.0)


@triton.jit
def stream_rows(w_rows, mask_o, w_first, x_ptr, row_stride, n_rows, nw_ptr, rstd, k_lo, k_hi,
                HAS_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr,
                BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """(BLOCK_S, BLOCK_O) fp32: rows w_rows (BLOCK_O, 1) of W times the n_rows token rows of x
    (normed when HAS_NORM) over K in [k_lo, k_hi), one weight read for every token; w_first is
    the tile at k_lo (loaded before the PDL wait).

    PREFETCH: the next tile is loaded before the current one is used (two tiles in registers);
    else each tile is loaded where it is used and triton's pipeliner (num_stages) may stage it.
    Both add the same chunks in the same order, so they give the same bits: a tuning choice.
    Every token row is reduced once at the end, whatever BLOCK_S is: a token's result does not
    depend on how many tokens share the launch (batch invariance)."""
    acc = tl.zeros([BLOCK_S, BLOCK_O, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        w = w_first
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w_next = first_tile(w_rows, mask_o, k0 + BLOCK_K, k_hi, BLOCK_K)
            x = normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, offs_k < k_hi, rstd,
                            HAS_NORM, BLOCK_S)  # fmt: skip
            acc += w.to(tl.float32) * x
            w = w_next
    else:
        offs_k = k_lo + tl.arange(0, BLOCK_K)
        x = normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, offs_k < k_hi, rstd,
                        HAS_NORM, BLOCK_S)  # fmt: skip
        acc += w_first.to(tl.float32) * x
        for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = first_tile(w_rows, mask_o, k0, k_hi, BLOCK_K)
            x = normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, offs_k < k_hi, rstd,
                            HAS_NORM, BLOCK_S)  # fmt: skip
            acc += w.to(tl.float32) * x
    return tl.sum(acc, 2)


@triton.jit
def stream_pair(a_rows, b_rows, mask_o, a_first, b_first, x_ptr, row_stride, n_rows, nw_ptr,
                rstd, K, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                PREFETCH: tl.constexpr):  # fmt: skip
    """stream_rows for two row sets sharing the normed input (gate/up, the two rows of a RoPE
    pair): ((BLOCK_S, BLOCK_O), (BLOCK_S, BLOCK_O)) fp32, K from 0, HAS_NORM."""
    acc_a = tl.zeros([BLOCK_S, BLOCK_O, BLOCK_K], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_S, BLOCK_O, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        wa = a_first
        wb = b_first
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            na = first_tile(a_rows, mask_o, k0 + BLOCK_K, K, BLOCK_K)
            nb = first_tile(b_rows, mask_o, k0 + BLOCK_K, K, BLOCK_K)
            x = normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, offs_k < K, rstd, True,
                            BLOCK_S)  # fmt: skip
            acc_a += wa.to(tl.float32) * x
            acc_b += wb.to(tl.float32) * x
            wa = na
            wb = nb
    else:
        offs_k = tl.arange(0, BLOCK_K)
        x = normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, offs_k < K, rstd, True,
                        BLOCK_S)  # fmt: skip
        acc_a += a_first.to(tl.float32) * x
        acc_b += b_first.to(tl.float32) * x
        for k0 in range(BLOCK_K, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            wa = first_tile(a_rows, mask_o, k0, K, BLOCK_K)
            wb = first_tile(b_rows, mask_o, k0, K, BLOCK_K)
            x = normed_tile(x_ptr, row_stride, n_rows, nw_ptr, offs_k, offs_k < K, rstd, True,
                            BLOCK_S)  # fmt: skip
            acc_a += wa.to(tl.float32) * x
            acc_b += wb.to(tl.float32) * x
    return tl.sum(acc_a, 2), tl.sum(acc_b, 2)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel's writes (after the weight prefetch), then let the next
    kernel launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def await_inputs(USE_PDL: tl.constexpr, SYNC: tl.constexpr, dep_ptr, dep_target, max_spin,
                 err_ptr):  # fmt: skip
    """Where a kernel body waits for its inputs (after its weight prefetch): the previous
    kernel's writes (pdl_wait) when it runs as a kernel of its own, or, as a task of the
    persistent decode kernel (SYNC), the count of the phase it reads (grid_sync.wait_count); a
    wait that gave up is flagged in err_ptr. A kernel passes SYNC=False and None for the rest."""
    if SYNC:
        wait_count(dep_ptr, dep_target, max_spin, err_ptr)
    else:
        pdl_wait(USE_PDL)
