"""The C library's heap on a CPU (step/heap.py): freed buffers kept mapped for the next op."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from expresslane.step import heap

# A 25 MB activation (a 4,000-token prompt's SwiGLU, SmolLM2's shape in fp32), alive then freed:
# where glibc put it (mallinfo2: `hblkhd` the bytes it mapped apart, `arena` its heap's bytes).
WHERE = """
import ctypes, json, sys
import torch
from expresslane.step.heap import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
kept = keep_freed_memory() if sys.argv[1] == "1" else False
x = torch.ones(4000, 1536)
alive = libc.mallinfo2()
del x
freed = libc.mallinfo2()
print(json.dumps({"kept": kept, "mapped_alive": alive.hblkhd, "heap_freed": freed.arena}))
"""


def _where(keep: str) -> dict:
    out = subprocess.run([sys.executable, "-c", WHERE, keep], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_kept_heap_holds_a_freed_activation():
    """By default glibc maps a 25 MB buffer apart and unmaps it on free (the next op faults its
    pages in again); with the settings it comes from the heap, which keeps it once freed."""
    if heap._glibc() is None or not hasattr(heap._glibc(), "mallinfo2"):
        pytest.skip("not glibc >= 2.33: no settings, or no mallinfo2 to read them by")
    size = 4000 * 1536 * 4
    default, kept = _where("0"), _where("1")
    assert kept["kept"] and not default["kept"]
    assert default["mapped_alive"] >= size, default  # mapped apart: gone at its free
    assert kept["mapped_alive"] < size and kept["heap_freed"] >= size, kept


class FakeLibc:
    def __init__(self, answer=1):
        self.calls, self.answer = [], answer

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.answer


def test_settings_and_the_switch(monkeypatch):
    lib = FakeLibc()
    assert heap.keep_freed_memory(lib) and lib.calls == list(heap.SETTINGS)
    assert not heap.keep_freed_memory(FakeLibc(answer=0))  # a setting refused: said so
    monkeypatch.setenv("EXPRESSLANE_KEEP_HEAP", "0")
    off = FakeLibc()
    assert not heap.keep_freed_memory(off) and off.calls == []  # the user's switch: untouched
