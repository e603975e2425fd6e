"""bench/hugepages.py: one buffer's bytes read on 4 KB and 2 MB pages by each reader; bad flags,
and a kernel without huge pages to ask for, exit 2 with a line saying why."""

from __future__ import annotations

import json

import pytest
import torch

from expresslane.bench import hugepages as bench
from expresslane.step.native import available
from expresslane.weights import hugepages

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: restores the thread count


@pytest.mark.skipif(hugepages.arena(1) is None, reason="no transparent huge pages here")
def test_every_reader_reads_both_buffers(capsys):
    assert bench.main(["--mb", "4", "--repeats", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    line = json.loads(out[-1])
    readers = 2 if available("float32") else 1
    assert len(line["rows"]) == 2 * readers and all(r["gb_s"] > 0 for r in line["rows"])
    assert {r["pages"] for r in line["rows"]} == {"4 KB (torch)", "2 MB (arena)"}
    assert out[0] == "| pages | reader | GB/s |" and len(out) == 3 + 2 * readers


def test_each_reader_computes_from_the_buffer():
    flat = torch.linspace(-1, 1, bench.K * 48)
    for name, fn in bench.readers(flat).items():
        got = fn().flatten()
        want = flat.sum() if name == "torch sum" else flat.view(-1, bench.K).sum(-1)
        assert torch.allclose(got, want.flatten(), atol=1e-3), name


def test_bad_flags_and_no_arena_exit_2(capsys, monkeypatch):
    assert bench.main(["--mb", "1"]) == 2
    assert "--mb" in capsys.readouterr().err
    monkeypatch.setattr(hugepages, "ENABLED", False)
    assert bench.main(["--mb", "4"]) == 2
    assert "no huge-page arena" in capsys.readouterr().err
