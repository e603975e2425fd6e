"""Lane-major GEMV for batch-1 decode, and the launch side every decode kernel shares.

At batch 1 every projection is a matrix-vector product: y[l] = W[l] @ x[l] with W (L, O, K)
row-major. The time is the time to stream W once, so the kernels here are shaped for HBM:
- each program owns BLOCK_O output rows of one lane and walks K in BLOCK_K-wide chunks; a warp
  reads contiguous row segments, so loads vectorise to 16 bytes;
- block sizes come from the shape (`tile_sizes`): enough programs to keep every SM streaming
  (~4 per SM), shrinking BLOCK_O first and splitting K only when the output is too narrow;
- split-K programs write fp32 partials (SPLIT_K, L, O) that a consumer sums (no atomics, so the
  result is deterministic and bitwise repeatable, which greedy decoding relies on).

Shared helpers (imported by the other kernel files): the launch side. `pdl_enabled(t)`:
Programmatic Dependent Launch. Launched with `launch_pdl=True`, a kernel may be scheduled while
the previous kernel in the stream drains; it must then wait (kernels/tiles.py's `pdl_wait`, after
its first weight tile) before touching anything a predecessor wrote, and it lets the next
kernel's CTAs launch early. Only on CUDA with compute capability >= 9 (Hopper) and a triton that
has both `tl.extra.cuda.gdc_*` and the `launch_pdl` launch option; EXPRESSLANE_PDL=0 turns it
off. Never in the interpreter. Also: the SM count, tile sizes and their fitting to the register
budget (`fit_rows`, `fit_warps`), weight checks, `tokens_of`. The jit pieces every kernel is built
from (rounding, the fused norm, streamed tiles, the wait) are kernels/tiles.py.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import MAX_TOKENS, tuning
from .tiles import await_inputs, cast_as, first_tile, rms_rstd_rows, stream_rows
from .tuning import PLANNED_GPU  # the GPU kernels/aot.py plans for (empty: ask the device)

# --- launch configuration --------------------------------------------------------------------


@functools.cache
def _pdl_device_ok(device_index: int) -> bool:
    if torch.version.hip is not None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        has_option = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except ImportError:
        return False
    has_ops = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
    return has_option and has_ops and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """True when kernels on t's device launch with PDL (CUDA, sm90+, supporting triton)."""
    if "pdl" in PLANNED_GPU:
        return PLANNED_GPU["pdl"]
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("EXPRESSLANE_PDL", "1") == "0":
        return False
    return _pdl_device_ok(t.device.index if t.device.index is not None else 0)


def launch_kwargs(t: torch.Tensor) -> dict:
    """Extra launch options and the USE_PDL constexpr for a kernel running on t's device."""
    if pdl_enabled(t):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU; 0 off CUDA (the interpreter wants few programs)."""
    if "sms" in PLANNED_GPU:
        return PLANNED_GPU["sms"]
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    return _num_sms(t.device.index if t.device.index is not None else 0)


def tile_sizes(
    t: torch.Tensor, rows: int, k: int, programs: int, min_rows: int = 4, max_rows: int = 16
) -> tuple[int, int, int]:
    """(BLOCK_O, BLOCK_K, SPLIT_K) for `programs` independent GEMVs of `rows` x `k` each.

    On a GPU: BLOCK_K = 256 (a warp reads 512 contiguous bytes of bf16 per row), BLOCK_O from
    `max_rows` down to `min_rows` until there are ~4 programs per SM, then split K by powers of 2
    while each split keeps >= 2 chunks. The (BLOCK_O, BLOCK_K) fp32 accumulator stays <= 4096
    elements (32 registers a thread at 4 warps): an sm_90 build of gemv_reduce with 32 x 256
    tiles needs 128 (past) to 168 (present) registers instead of 40-72, which caps occupancy at
    3-4 CTAs per SM (triton 3.6 and 3.9 with the JIT's specialisation, kernels/aot.py). In the
    interpreter: the largest tiles, to keep the program count low.
    """
    sms = num_sms(t)
    if sms == 0:
        return min(triton.next_power_of_2(rows), 64), min(triton.next_power_of_2(k), 512), 1
    block_k = min(triton.next_power_of_2(k), 256)
    target = 4 * sms
    block_o = min(max_rows, triton.next_power_of_2(rows))
    while block_o > min_rows and programs * triton.cdiv(rows, block_o) < target:
        block_o //= 2
    split_k = 1
    while programs * triton.cdiv(rows, block_o) * split_k < target and k // (2 * split_k) >= (
        2 * block_k
    ):
        split_k *= 2
    return block_o, block_k, split_k


def assert_lane_weight(w: torch.Tensor, lanes: int, k: int, dtype: torch.dtype, name: str) -> None:
    """A lane-major weight (L, O, K): contiguous, matching lanes, K and dtype."""
    assert w.dim() == 3 and w.shape[0] == lanes and w.shape[2] == k, (
        f"{name}: expected (L={lanes}, O, K={k}), got {tuple(w.shape)}"
    )
    assert w.is_contiguous(), f"{name} must be contiguous, strides {w.stride()}"
    assert w.dtype == dtype, f"{name}: dtype {w.dtype}, activations are {dtype}"


def assert_norm_weight(nw: torch.Tensor, lanes: int, d: int, name: str) -> int:
    """A shared (D,) or per-lane (L, D) norm weight; returns its lane stride (0 when shared)."""
    assert nw.is_contiguous(), f"{name} must be contiguous"
    if nw.dim() == 1:
        assert nw.shape[0] == d, f"{name}: expected ({d},), got {tuple(nw.shape)}"
        return 0
    assert nw.shape == (lanes, d), f"{name}: expected ({d},) or ({lanes}, {d}), got {nw.shape}"
    return d


# --- shared device helpers ---------------------------------------------------------------------
def tokens_of(x: torch.Tensor, name: str = "x") -> tuple[torch.Tensor, bool]:
    """x (S, L, K) as is, or (L, K) as one token: (x (S, L, K), whether a token axis was given)."""
    assert x.dim() in (2, 3) and x.is_contiguous(), (
        f"{name}: expected contiguous (L, K) or (S, L, K), got {tuple(x.shape)}"
    )
    if x.dim() == 2:
        return x.unsqueeze(0), False
    assert 1 <= x.shape[0] <= MAX_TOKENS, f"{name}: {x.shape[0]} tokens, at most {MAX_TOKENS}"
    return x, True


def block_s(n_tokens: int) -> int:
    """The token rows a launch lays out: 1, else a power of 2 of at least 4.

    Two rows are too few. A (2, 1, BLOCK_K) chunk of the token rows holds 512 values for 128
    threads, so triton's coalescing gives it 4 values a thread and 2 warps along K, and the
    accumulator takes that layout: the sm_90 builds of norm_qkv, norm_swiglu and gemv_reduce then
    summed each row along K in another order than one token's (8 values a thread, 1 warp), and
    a verify of one draft was not a decode step bit for bit (found reading the builds,
    2026-12-06: aot.invariance_report with tokens (1, 2)). Padded to 4 rows (masked, no memory
    traffic), the layout is the one 3 to 8 tokens get, whose sums follow the 1-token order."""
    return 1 if n_tokens == 1 else max(4, triton.next_power_of_2(n_tokens))


# --- the lane-major GEMV kernel ----------------------------------------------------------------
@triton.jit
def lane_gemv_task(
    w_ptr,  # (L, O, K) weights, contiguous
    x_ptr,  # (S, L, K) inputs, contiguous
    nw_ptr,  # (K,) or (L, K) norm weight (unused without HAS_NORM)
    y_ptr,  # (S, L, O) output, or (SPLIT_K, S, L, O) fp32 partials when SPLIT_K > 1
    S,
    L,
    O,
    K,
    eps,
    stride_nwl,  # 0 for a shared norm weight
    lane,  # the program's coordinates: (lane, row block, K split)
    pid_o,
    pid_k,
    dep_ptr,  # what the inputs wait for (tiles.await_inputs)
    dep_target,
    max_spin,
    err_ptr,
    HAS_NORM: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
    SYNC: tl.constexpr,
):
    """The work of program (lane, pid_o, pid_k): a kernel's, or (a split-K projection's first
    half: gemv_reduce.split_reduce_task) a task of the persistent kernel's."""
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < O
    w_rows = w_ptr + lane * O * K + offs_o[:, None] * K  # (BLOCK_O, 1) row starts
    # This split's K range, a whole number of chunks so that only the last split is ragged.
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_len
    k_hi = tl.minimum(k_lo + k_len, K)
    w_first = first_tile(w_rows, mask_o, k_lo, k_hi, BLOCK_K)
    await_inputs(USE_PDL, SYNC, dep_ptr, dep_target, max_spin, err_ptr)
    x_row = x_ptr + lane * K  # token s's row is x_row + s * L * K
    rstd = tl.full([BLOCK_S], 1.0, dtype=tl.float32)
    if HAS_NORM:
        rstd = rms_rstd_rows(x_row, L * K, S, K, eps, BLOCK_S, BLOCK_K)
    y = stream_rows(w_rows, mask_o, w_first, x_row, L * K, S, nw_ptr + lane * stride_nwl, rstd,
                    k_lo, k_hi, HAS_NORM, BLOCK_S, BLOCK_O, BLOCK_K, PREFETCH)  # fmt: skip
    offs_s = tl.arange(0, BLOCK_S)
    m = (offs_s[:, None] < S) & mask_o[None, :]
    if SPLIT_K == 1:
        dst = y_ptr + (offs_s[:, None] * L + lane) * O + offs_o[None, :]
        tl.store(dst, cast_as(y, y_ptr), mask=m)
    else:
        dst = y_ptr + ((pid_k * S + offs_s[:, None]) * L + lane) * O + offs_o[None, :]
        tl.store(dst, y, mask=m)


@triton.jit
def lane_gemv_kernel(w_ptr, x_ptr, nw_ptr, y_ptr, S, L, O, K, eps, stride_nwl,
                     HAS_NORM: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                     USE_PDL: tl.constexpr):  # fmt: skip
    lane_gemv_task(w_ptr, x_ptr, nw_ptr, y_ptr, S, L, O, K, eps, stride_nwl, tl.program_id(0),
                   tl.program_id(1), tl.program_id(2), None, 0, 0, None, HAS_NORM, SPLIT_K,
                   BLOCK_S, BLOCK_O, BLOCK_K, PREFETCH, USE_PDL, False)  # fmt: skip


# fp32 accumulator elements a program may hold (all its accumulators, all its tokens): 64
# registers a thread at 4 warps. The S = 1 defaults hold 4096; wider launches take fewer rows.
ACC_BUDGET = 8192


def fit_rows(t: torch.Tensor, block_rows: int, block_k: int, n_tokens: int,
             accumulators: int = 1) -> int:  # fmt: skip
    """block_rows halved until the (BLOCK_S, rows, BLOCK_K) accumulators fit ACC_BUDGET, on a
    GPU (the interpreter has no registers to spill, and wants few programs).

    Only the rows per program shrink, never BLOCK_K: a row's chunks, their order and the
    reduction over K stay those of a one-token launch (rows are independent), so the launch
    keeps every token's bits. An sm_90 build of S = 8 with the S = 1 tiles spilled 272-480
    bytes at 255 registers (kernels/aot.py --tokens 8)."""
    if num_sms(t) == 0:
        return block_rows
    while block_s(n_tokens) * block_rows * block_k * accumulators > ACC_BUDGET and block_rows > 1:
        block_rows //= 2
    return block_rows


def fit_warps(t: torch.Tensor, cfg: dict, block_rows: int, block_k: int) -> dict:
    """cfg with num_warps (default 4) halved until the weight tile gives every thread one
    16-byte vector (block_rows * block_k >= 256 * warps; 8 bf16), on a GPU.

    The tile's layout fixes each row's reduction order along K: 8 values a thread, then the 32
    lanes of one warp, when the tile is large enough for warps to take whole rows. The tile's
    load fixes the accumulator's layout (first_tile), and a smaller tile (fit_rows shrinks the
    rows as the tokens grow) is laid out 4 values a thread with 2 warps along K (triton 3.6
    and 3.9, the 8-token sm_90 builds of norm_swiglu and norm_qkv, 2 rows a program): other
    sums than the one-token build's, so a verify row would leave the plain step's bits. Fewer
    warps keep the 1-token layout along K (kernels/aot.py checks it). Never below 2
    (rms_rstd); fit_rows leaves >= 2 rows of 256 or 4 of 128, which 2 warps cover."""
    if num_sms(t) == 0:
        return cfg
    warps = cfg.get("num_warps", 4)
    while warps > 2 and block_rows * block_k < 256 * warps:  # >= 2: rms_rstd's layout
        warps //= 2
    return {**cfg, "num_warps": warps} if warps != cfg.get("num_warps", 4) else cfg


def gemv_config(t: torch.Tensor, kernel: str, rows: int, k: int, programs: int, lanes: int,
                n_tokens: int, accumulators: int = 1, **limits) -> dict:  # fmt: skip
    """The launch configuration of a lane-major GEMV family kernel (tuning.choose): BLOCK_O,
    BLOCK_K, SPLIT_K from tile_sizes, PREFETCH 0, overridden by the GPU's table or a forced
    variant; then BLOCK_O fitted to the token count (fit_rows) and the warps to the tile
    (fit_warps)."""
    block_o, block_k, split_k = tile_sizes(t, rows, k, programs, **limits)
    default = {"BLOCK_O": block_o, "BLOCK_K": block_k, "SPLIT_K": split_k, "PREFETCH": 0}
    cfg = tuning.choose(kernel, t, tuning.shape_key(L=lanes, O=rows, K=k), default)
    cfg["BLOCK_O"] = fit_rows(t, cfg["BLOCK_O"], cfg["BLOCK_K"], n_tokens, accumulators)
    return fit_warps(t, cfg, cfg["BLOCK_O"], cfg["BLOCK_K"])


def launch_lane_gemv(w, x, nw, stride_nwl, eps, out, cfg: dict):
    """Launch lane_gemv_kernel on x (S, L, K) with configuration cfg (gemv_config); `out` is
    (S, L, O) or the (SPLIT_K, S, L, O) fp32 workspace."""
    consts, opts = tuning.split(cfg)
    S = x.shape[0]
    L, O, K = w.shape
    grid = (L, triton.cdiv(O, consts["BLOCK_O"]), consts["SPLIT_K"])
    lane_gemv_kernel[grid](
        w, x, nw if nw is not None else x, out, S, L, O, K, eps, stride_nwl,
        HAS_NORM=nw is not None, BLOCK_S=block_s(S), **consts, **opts, **launch_kwargs(x),
    )  # fmt: skip


def lane_gemv(
    w: torch.Tensor,  # (L, O, K)
    x: torch.Tensor,  # (L, K) or (S, L, K)
    *,
    norm_weight: torch.Tensor | None = None,  # (K,) or (L, K): RMSNorm x first
    eps: float = 1e-5,
    split_k: int | None = None,
) -> torch.Tensor:
    """(L, O) or (S, L, O) = w[l] @ (norm(x[s, l]) or x[s, l]), fp32 accumulation, rounded once."""
    xs, axis = tokens_of(x)
    S, L, K = xs.shape
    assert_lane_weight(w, L, K, x.dtype, "w")
    stride_nwl = 0
    if norm_weight is not None:
        stride_nwl = assert_norm_weight(norm_weight, L, K, "norm_weight")
    O = w.shape[1]
    cfg = gemv_config(x, "lane_gemv", O, K, L, L, S)
    if split_k:
        cfg["SPLIT_K"] = split_k
    if cfg["SPLIT_K"] == 1:
        y = torch.empty((S, L, O), device=x.device, dtype=x.dtype)
        launch_lane_gemv(w, xs, norm_weight, stride_nwl, eps, y, cfg)
    else:
        ws = torch.empty((cfg["SPLIT_K"], S, L, O), device=x.device, dtype=torch.float32)
        launch_lane_gemv(w, xs, norm_weight, stride_nwl, eps, ws, cfg)
        y = ws.sum(0).to(x.dtype)  # fixed order over splits: deterministic
    return y if axis else y[0]
