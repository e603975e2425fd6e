"""CPU threads for decode: from the bytes a step streams and the cores that are free right now.

Batch-1 decode on a CPU is a chain of GEMVs, each an OpenMP parallel region: a second thread
doubles the bandwidth and the conversion throughput a product gets, but every region ends in a
barrier, and a thread descheduled by another process stalls all the others there (2 threads on
a busy 2-core machine decoded 10x slower than 1). So the default is:

    threads = min(cores we may run on, cores idle over a short sample, 1 per 32 MB streamed)

measured once, at load (the compiled kernels are built for that count). `--threads` overrides.
Idle cores come from /proc/stat (Linux); elsewhere every core counts as idle.
"""

from __future__ import annotations

import os
import time

import torch

from ..errors import ConfigError

BYTES_PER_THREAD = 32 << 20  # below this a product is too short to pay for a fork/join


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs, or None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def idle_cores(sample_s: float = 0.2) -> float:
    """How many cores were idle over a `sample_s` sample (all of them when unknown)."""
    a = _cpu_times()
    time.sleep(sample_s)
    b = _cpu_times()
    n = os.cpu_count() or 1
    if a is None or b is None or b[1] <= a[1]:
        return float(n)
    return n * (b[0] - a[0]) / (b[1] - a[1])


def choose_threads(step_bytes: int, requested: int | None = None, idle: float | None = None) -> int:
    """The thread count for a decode step streaming `step_bytes` (see the module docstring)."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads {requested}: must be at least 1")
        return requested
    free = idle_cores() if idle is None else idle
    by_size = max(1, step_bytes // BYTES_PER_THREAD)
    return max(1, min(usable_cores(), int(free + 0.5), by_size))


def set_threads(step_bytes: int, requested: int | None = None) -> int:
    """Choose and apply the thread count (before anything is compiled); returns it."""
    n = choose_threads(step_bytes, requested)
    torch.set_num_threads(n)
    return n
