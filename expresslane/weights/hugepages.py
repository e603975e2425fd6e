"""Packed CPU weights in transparent huge pages: one 2 MB-aligned arena the decode step streams.

A batch-1 decode step on a CPU reads every weight once per token, front to back. On 4 KB pages
that stream crosses a page every 4 KB: a TLB miss each time, and the hardware prefetchers stop
at every page boundary. Linux backs a mapping with 2 MB pages where the program asks for them
(`madvise(MADV_HUGEPAGE)`; the kernel's default, `transparent_hugepage/enabled` = "madvise", does
nothing for memory that does not ask, which is what torch and malloc hand out).

Measured on the 2-vCPU VM (an Intel Xeon, 2026-12-06, `python -m expresslane.bench.hugepages`):
the C fp32 product of a 1 GB matrix read 13.7 GB/s on 4 KB pages and 16.4 on 2 MB pages with one
thread, 25.8 and 32.1 with two. The decode step's figures are in BENCHMARKS.md.

- `thp_mode()`: the kernel's setting ("always", "madvise", "never"), or "" where there is none.
- `arena(nbytes)`: a zeroed uint8 tensor on a 2 MB boundary, advised for huge pages, or None.
- `tensors(specs)`: zeroed tensors of given shapes and dtypes in one arena (the KV cache's).
- `Placer()`: a packer's matrices copied into arenas one by one, as it makes them (values and
  shapes unchanged; a tied head is placed once, as the embedding: packing.py).

`EXPRESSLANE_HUGE_PAGES=0` keeps the weights where torch allocated them (to compare).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import torch

from .quant import QTensor

HUGE_PAGE = 2 << 20
ALIGN = 64  # each field's start: a cache line (the C kernels' vector loads)
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ENABLED = os.environ.get("EXPRESSLANE_HUGE_PAGES", "1") != "0"


def thp_mode() -> str:
    """The bracketed word of the kernel's THP setting ("always [madvise] never"), or ""."""
    try:
        with open(THP_SETTING) as f:
            words = f.read().split()
    except OSError:
        return ""
    return next((w[1:-1] for w in words if w.startswith("[")), "")


def available_bytes() -> int | None:
    """The kernel's MemAvailable, or None where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def arena(nbytes: int) -> torch.Tensor | None:
    """nbytes of zeroed memory starting on a 2 MB boundary, advised for huge pages, as a uint8
    tensor (which keeps its mapping alive); None where huge pages cannot be asked for, or where
    the memory left could not hold it (placing weights holds two copies for a moment)."""
    if not ENABLED or not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() not in ("always", "madvise"):
        return None
    free = available_bytes()
    if free is not None and nbytes + HUGE_PAGE > free * 0.9:
        return None
    # private: a shared anonymous map is shmem, which the anonymous THP setting does not cover;
    # one spare huge page to align the start
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start)


def tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """Zeroed contiguous tensors of these (shape, dtype)s, one after another in one arena, each
    on a cache line (a KV cache's layers, a model's weights); None where no arena can be had."""
    nbytes = [math.prod(shape) * torch.empty(0, dtype=dt).element_size() for shape, dt in specs]
    sizes = [-(-n // ALIGN) * ALIGN for n in nbytes]
    room = arena(sum(sizes)) if specs else None
    if room is None:
        return None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [room[a : a + n].view(dt).view(shape)
            for a, n, (shape, dt) in zip(starts, nbytes, specs, strict=True)]  # fmt: skip


def _movable(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0


def _fields(matrices: list[QTensor]) -> list[torch.Tensor]:
    """Every movable field once (by identity), in the order the step streams them."""
    seen, out = set(), []
    for m in matrices:
        for t in m.fields:
            if _movable(t) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


class Placer:
    """Matrices copied into huge-page arenas one at a time, as a packer makes them: the matrix it
    made last (a file's mapped pages, re-laid blocks) can go before it makes the next, so loading
    peaks at the placed weights and one matrix, not the weights twice. Arenas come in segments
    of at least `segment` bytes, each on a 2 MB boundary (a segment's untouched tail is address
    space, never memory); a matrix stays where it is once no arena can be had."""

    def __init__(self, segment: int = 64 << 20):
        self.segment = segment
        self.room: torch.Tensor | None = None
        self.used = 0
        self.full = False

    def _slots(self, fields: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Zeroed tensors shaped as `fields`, next in the current segment (or a new one)."""
        nbytes = [t.numel() * t.element_size() for t in fields]
        sizes = [-(-n // ALIGN) * ALIGN for n in nbytes]
        if self.room is None or self.used + sum(sizes) > self.room.numel():
            self.room, self.used = arena(max(sum(sizes), self.segment)), 0
            self.full = self.room is None
            if self.full:
                return None
        starts = [self.used + sum(sizes[:i]) for i in range(len(sizes))]
        self.used += sum(sizes)
        return [self.room[a : a + n].view(t.dtype).view(t.shape)
                for a, n, t in zip(starts, nbytes, fields, strict=True)]  # fmt: skip

    def __call__(self, m: QTensor) -> QTensor:
        """`m` with its CPU fields copied into the arena (values and shapes unchanged)."""
        fields = _fields([m])
        slots = None if self.full or not fields else self._slots(fields)
        if slots is None:
            return m
        moved = {id(t): new.copy_(t) for t, new in zip(fields, slots, strict=True)}
        return m.map(lambda t: moved.get(id(t), t))
