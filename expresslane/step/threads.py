"""CPU threads for decode: from the bytes a step streams and the cores that are free right now.

Batch-1 decode on a CPU is a chain of GEMVs, each an OpenMP parallel region: a second thread
doubles the bandwidth and the conversion throughput a product gets, but every region ends in a
barrier, and a thread descheduled by another process stalls all the others there (2 threads on
a busy 2-core machine decoded 10x slower than 1). So the default is:

    threads = min(cores we may run on, cores idle over a short sample, 1 per 32 MB streamed)

where the cores we may run on are the affinity mask capped by the cgroup's CPU quota.
measured at load (a compiled step is built for that count). `--threads` overrides. Idle
cores come from /proc/stat (Linux); elsewhere every core counts as idle. Cores this process
kept busy over the sample count as free: its own work does not compete with its decode.

A server lives for days, and the machine's load changes under it: a process spinning on one of
the 2-vCPU VM's cores took a server fixed at 2 threads from 187-208 tok/s to 52 on SmolLM2,
where 1 thread decodes at 126-135 (`python -m expresslane.bench.serve_decode`), and a sample at
load cannot know what comes later (one server during this work decoded at under half its speed
until restarted; the cause went uncaught). So `ThreadGovernor` revises the count before each
request, from the cores other processes left free over the last second (snapshots a thread of
its own takes): no sample on the request's path, and a neighbour that comes or goes is followed
at the next request. The C step's rows have the same bits on any thread count
(tests/test_packed_verify.py), so a request's tokens do not depend on it.

Only the engine's thread may run parallel torch ops in a server. One OpenMP runtime serves the
process and counts the threads of every team: a thread that runs one vocabulary-sized torch op
(a grammar's compile did, structured/closing.py) keeps a team of its own for its life, the
process then holds more OpenMP threads than cores, and libgomp stops spinning between regions,
so the decode step's 31 short regions a token each sleep and wake. A server decoded SmolLM2 at
65 tok/s after its first structured-output request, against 205-226 before it; one such op on a
side thread took `run`'s own loop from 242 to 72 (the VM, 2026-12-06). `torch.set_num_threads(1)`
on the side thread is no cure: torch applies its last count, process-wide, to a thread's first
parallel op, and the engine's thread would take the 1.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import deque

import torch

from ..errors import ConfigError

BYTES_PER_THREAD = 32 << 20  # below this a product is too short to pay for a fork/join


CGROUP, OWN_CGROUP = "/sys/fs/cgroup", "/proc/self/cgroup"


def usable_cores() -> int:
    """The cores we may run on: the affinity mask, capped by the cgroup's CPU quota (a container
    started with `--cpus 2` on a 16-core host sees 16 cores, and 16 threads there stall at every
    barrier while the quota throttles them)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, int(quota)))


def cpu_quota(root: str = CGROUP, own: str = OWN_CGROUP) -> float | None:
    """The cores' worth of CPU time our cgroups allow (the tightest quota from our cgroup up to
    the root, cgroup v2's cpu.max or v1's cfs_quota_us / cfs_period_us); None when unlimited or
    unknown. A cgroup path that does not exist under `root` (a container without its own cgroup
    namespace sees the host's path) still has the mount's own files checked."""
    try:
        with open(own) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    quotas = []
    for _, controllers, path in (p for p in lines if len(p) == 3):
        if controllers == "":
            quotas += [_v2_quota(d) for d in _up(root, path)]
        elif "cpu" in controllers.split(","):
            mounts = {os.path.join(root, controllers), os.path.join(root, "cpu")}
            quotas += [_v1_quota(d) for m in sorted(mounts) for d in _up(m, path)]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _up(base: str, path: str):
    """`base`/`path` and each of its parents down to `base` itself."""
    parts = [p for p in path.split("/") if p]
    for n in range(len(parts), -1, -1):
        yield os.path.join(base, *parts[:n])


@functools.cache
def cpu_info(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("vendor_id": "GenuineIntel"; "flags": the
    instruction sets, space-separated), "" where there is none (not Linux, no such field)."""
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return ""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_quota(d: str) -> float | None:
    fields = (_read(os.path.join(d, "cpu.max")) or "max").split()
    if fields[0] == "max" or len(fields) < 2 or not all(f.isdigit() for f in fields[:2]):
        return None
    return int(fields[0]) / max(1, int(fields[1]))


def _v1_quota(d: str) -> float | None:
    quota, period = (
        _read(os.path.join(d, "cpu.cfs_quota_us")),
        _read(os.path.join(d, "cpu.cfs_period_us")),
    )
    if quota is None or period is None or not quota.isdigit() or not period.isdigit():
        return None  # "-1" is unlimited
    return int(quota) / max(1, int(period))


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs, or None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def _snapshot() -> tuple[tuple[int, int] | None, float]:
    return _cpu_times(), time.process_time()  # process_time: every thread of this process


def _free_between(a, b) -> float | None:
    """Cores free of other processes between two snapshots: the idle ones, plus those this
    process kept busy (the server's event loop starting beside the load, OpenMP threads
    spinning after a product); None where /proc/stat says nothing."""
    (ta, own_a), (tb, own_b) = a, b
    if ta is None or tb is None or tb[1] <= ta[1]:
        return None
    n = os.cpu_count() or 1
    per_core = (tb[1] - ta[1]) / n  # jiffies of one core over the interval
    ours = (own_b - own_a) * os.sysconf("SC_CLK_TCK") / per_core
    return min(float(n), n * (tb[0] - ta[0]) / (tb[1] - ta[1]) + ours)


def idle_cores(sample_s: float = 0.2) -> float:
    """How many cores were free of other processes over a `sample_s` sample (all of them when
    unknown)."""
    a = _snapshot()
    time.sleep(sample_s)
    free = _free_between(a, _snapshot())
    return float(os.cpu_count() or 1) if free is None else free


def choose_threads(step_bytes: int, requested: int | None = None, idle: float | None = None) -> int:
    """The thread count for a decode step streaming `step_bytes` (see the module docstring)."""
    if requested is not None:
        if requested < 1:
            raise ConfigError(f"--threads {requested}: must be at least 1")
        return requested
    free = idle_cores() if idle is None else idle
    by_size = max(1, step_bytes // BYTES_PER_THREAD)
    return max(1, min(usable_cores(), int(free + 0.5), by_size))


def threads_on(device) -> int | None:
    """The threads a step on `device` runs on: torch's count on a CPU, None elsewhere."""
    return torch.get_num_threads() if str(device) == "cpu" else None


def set_threads(step_bytes: int, requested: int | None = None) -> int:
    """Choose and apply the thread count (before anything is compiled); returns it."""
    n = choose_threads(step_bytes, requested)
    torch.set_num_threads(n)
    return n


PERIOD_S, KEEP = 0.25, 5  # snapshots a governor keeps: the last second of the machine
MIN_SAMPLE_S = 0.5  # a shorter look (just started) keeps the count: too noisy


class ThreadGovernor:
    """A server's CPU thread count, revised before each request (the module docstring), from
    the last second: a thread snapshots /proc/stat and this process's CPU time every PERIOD_S
    (`watch=False`: the caller ticks, as the tests do)."""

    def __init__(self, step_bytes: int, watch: bool = True):
        self.step_bytes = step_bytes
        self.threads = torch.get_num_threads()
        self._seen: deque[tuple[float, tuple]] = deque(maxlen=KEEP)
        self.tick()
        self._stop = threading.Event()
        if watch:
            threading.Thread(target=self._watch, name="expresslane-threads", daemon=True).start()

    def tick(self) -> None:
        self._seen.append((time.monotonic(), _snapshot()))

    def _watch(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self.tick()

    def close(self) -> None:
        self._stop.set()

    def revise(self) -> int:
        """The count for the next request, applied: call it on the thread that runs the step
        (torch keeps the count per thread)."""
        (since, first), now = self._seen[0], _snapshot()
        if time.monotonic() - since >= MIN_SAMPLE_S:
            free = _free_between(first, now)
            if free is not None:
                self.threads = choose_threads(self.step_bytes, idle=free)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads
