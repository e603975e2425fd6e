"""The C library's heap on a CPU: freed activation buffers kept for the next op, not unmapped.

A long prompt goes through the model's forward one op at a time (step/prefill.py), and each op
allocates its output afresh. A 4,000-token prompt's SwiGLU activations of SmolLM2's shape take
25 MB in fp32, 8,000 tokens' take 49 MB. glibc serves a buffer above its mmap threshold straight
from the kernel and unmaps it on free. The threshold moves with what was freed, up to 32 MB. It
also trims the heap's top past its trim threshold. So every op faults in and zeroes its output's
pages again, and in this forward that was 9% of a 4,000-token fp32 prefill on the VM (an Intel
Xeon, 2 threads): 6.49 s against 5.93 s with the heap kept. Against transformers' eager forward
on the same weights, in the same process and in turn, that was 1.086x its time before and
1.012x after (2026-12-07).

llama.cpp allocates its compute buffers once, at load. Here glibc is asked once per process
(`mallopt`) to serve every buffer under 1 GB from its heap, keep what is freed and not trim it,
so the next op reuses pages that are already mapped. A decode step allocates almost nothing and
is unchanged.

The price: after a long prompt the process keeps its peak working set (RSS does not shrink back)
until it exits. A server keeps it for its life, as llama.cpp keeps its buffers.
EXPRESSLANE_KEEP_HEAP=0 leaves glibc's defaults. Without glibc (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = (
    (M_MMAP_THRESHOLD, 1 << 30),  # buffers under 1 GB from the heap (and no dynamic threshold)
    (M_TRIM_THRESHOLD, (1 << 31) - 1),  # a freed top of the heap stays mapped (mallopt: int)
    (M_TOP_PAD, 64 << 20),  # the heap grows 64 MB at a time past what a request asks
)

_done: bool | None = None


def keep_freed_memory(libc=None) -> bool:
    """Ask the C library to keep freed buffers mapped (module docstring), once per process;
    True when it took the settings. `libc` is for tests (default: the process's glibc)."""
    global _done
    if _done is not None and libc is None:
        return _done
    ok = False
    if os.environ.get("EXPRESSLANE_KEEP_HEAP", "1") != "0":
        lib = libc or _glibc()
        if lib is not None:
            ok = all(lib.mallopt(param, value) == 1 for param, value in SETTINGS)
    if libc is None:
        _done = ok
    return ok


def _glibc():
    """The process's glibc, or None (another C library has no mallopt, or other meanings)."""
    try:
        lib = ctypes.CDLL(None)
        version = lib.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return lib if version() else None
