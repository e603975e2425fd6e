"""Dependencies between the programs of one launch, through counters in global memory.

The persistent decode kernel (docs/persistent-kernel.md) replaces kernel boundaries by counts:
a program that finished its part of a phase `arrive`s at the phase's counter, and a program
that needs the whole phase `wait_count`s until every producer has arrived. This is the grid
barrier of CUDA's cooperative groups, written in Triton:

- `arrive`: `debug_barrier` (bar.sync: every thread of the program has issued its stores), then
  one `atomic_add(sem="release", scope="gpu")` (Triton performs a scalar atomic from one
  thread). PTX's release is cumulative: it orders the stores the barrier made visible to that
  thread before the count, for any program that acquires the count.
- `wait_count`: polls the counter with volatile loads until it reaches the target, reads it
  once more with an acquiring atomic, then `debug_barrier` so every thread of the program is
  ordered after the acquire. Inputs written by other programs may be read with
  `cache_modifier=".cg"` (L2, not a stale L1) besides. The poll gives up after `max_spin`
  reads (or once another program gave up), flags the launch's error count and returns False:
  a program spinning on producers that never got an SM (the prototype's static split on a grid
  larger than the resident blocks) would otherwise hang the GPU, so the prototype sizes its grid
  to the resident blocks (`aot_read.blocks_per_sm` from the compiled kernel's registers); the
  persistent decode kernel takes its tasks from a queue in dependency order and needs no such
  bound (kernels/persistent.py).

Under the Triton interpreter programs run one after the other, so a wait on a later program
never ends: CPU tests run these kernels with one program (tests/test_grid_sync.py).

The prototype below measures the mechanism before the persistent kernel is built on it
(bench/barrier.py): a chain of GEMVs y_p = W_p x_p, x_(p+1) = the front of y_p, in fp32
activations. `chain_persistent` runs P phases in one launch, its programs looping over each
phase's row tiles and waiting on the previous phase's count (BARRIER), optionally loading their
first weight tile of a phase before the wait (PREFETCH). With P = 1 a launch a phase, it is
today's structure: kernel boundaries (with PDL or not) instead of counts, the same programs and
tiles, each tile computed in the same order, so the outputs agree bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .interpreter import quicken

# every kernel module imports this one (directly or through tiles.py): the interpreter's repeated
# patches are skipped before any kernel runs under it
quicken()


@triton.jit
def arrive(counter_ptr, count):
    """Count `count` parts of this program's stores so far as done, for every program that waits
    on the count."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, count, sem="release", scope="gpu")


@triton.jit
def wait_count(counter_ptr, target, max_spin, err_ptr):
    """Wait until *counter_ptr >= target; on a wait of max_spin polls, or once any program of
    the launch flagged *err_ptr, give up: flag it and return False.

    The polls are volatile loads (L2, no read-modify-write: hundreds of programs polling one
    count would otherwise queue their atomics behind the producers' adds); the one acquiring
    read-modify-write after the count is reached orders this program after every add it saw
    (an RMW continues each add's release sequence). The error flag is read every 1024 polls, so
    that one failed wait ends the launch in one wait's time, not one per waiting task."""
    seen = tl.load(counter_ptr, volatile=True)
    spins = 0
    while (seen < target) & (spins < max_spin):
        seen = tl.load(counter_ptr, volatile=True)
        spins += 1
        if spins % 1024 == 0:
            if tl.load(err_ptr, volatile=True) != 0:
                spins = max_spin
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    if seen < target:
        tl.atomic_max(err_ptr, 1)
    return seen >= target


# --- the prototype: a chain of GEMVs, kernel by kernel or in one launch (bench/barrier.py) ---
@triton.jit
def _row_tile(w_ptr, act_ptr, w_off, N, K, x_off, y_off, t, first,
              HAS_FIRST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    mask_n = rows < N
    ptrs = w_ptr + w_off + rows[:, None] * K + cols[None, :]
    if HAS_FIRST:
        w = first
    else:
        w = tl.load(ptrs, mask=mask_n[:, None] & (cols[None, :] < K), other=0.0)
    x = tl.load(act_ptr + x_off + cols, mask=cols < K, other=0.0, cache_modifier=".cg")
    acc = w.to(tl.float32) * x[None, :]  # (BLOCK_N, BLOCK_K)
    for k in range(BLOCK_K, K, BLOCK_K):
        mask_k = (k + cols) < K
        w = tl.load(ptrs + k, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(act_ptr + x_off + k + cols, mask=mask_k, other=0.0, cache_modifier=".cg")
        acc += w.to(tl.float32) * x[None, :]
    tl.store(act_ptr + y_off + rows, tl.sum(acc, axis=1), mask=mask_n)


@triton.jit
def chain_persistent(w_ptr, act_ptr, meta_ptr, cnt_ptr, err_ptr, P, max_spin,
                     BARRIER: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_K)
    for p in range(P):
        w_off = tl.load(meta_ptr + 5 * p)
        N = tl.load(meta_ptr + 5 * p + 1).to(tl.int32)
        K = tl.load(meta_ptr + 5 * p + 2).to(tl.int32)
        x_off = tl.load(meta_ptr + 5 * p + 3)
        y_off = tl.load(meta_ptr + 5 * p + 4)
        first = tl.zeros((BLOCK_N, BLOCK_K), dtype=w_ptr.dtype.element_ty)
        if PREFETCH:  # the weight stream does not wait for the previous phase
            rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = (rows[:, None] < N) & (cols[None, :] < K)
            first = tl.load(w_ptr + w_off + rows[:, None] * K + cols[None, :], mask=mask,
                            other=0.0)  # fmt: skip
        if BARRIER:
            if p > 0:
                wait_count(cnt_ptr + p - 1, G, max_spin, err_ptr)
        for t in range(pid, tl.cdiv(N, BLOCK_N), G):
            if PREFETCH:
                if t == pid:  # the tile whose first weights are already in registers
                    _row_tile(w_ptr, act_ptr, w_off, N, K, x_off, y_off, t, first, True,
                              BLOCK_N, BLOCK_K)  # fmt: skip
                else:
                    _row_tile(w_ptr, act_ptr, w_off, N, K, x_off, y_off, t, first, False,
                              BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                _row_tile(w_ptr, act_ptr, w_off, N, K, x_off, y_off, t, first, False,
                          BLOCK_N, BLOCK_K)  # fmt: skip
        if BARRIER:
            if p < P - 1:
                arrive(cnt_ptr + p, 1)
    if BARRIER:  # the last program through resets the counts for the next launch
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + P - 1, 1, sem="acq_rel", scope="gpu") == G - 1:
            for q in range(P):
                tl.store(cnt_ptr + q, 0)
