"""Counters between the programs of one launch (kernels/grid_sync.py) and the boundary bench.

In the interpreter (one program: programs run one after another there) the chain of GEMVs
gives fp32 torch's answer in every form, the persistent ones equal to the launch-per-phase one
bit for bit, and the counters are back at zero after a launch. Compiled for sm_90 (no GPU
needed), the barrier forms carry gpu-scope acquire / release atomics and the others none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton_interp  # noqa: F401  (before triton: the interpreter without a GPU)
from triton_interp import GPU

from expresslane.bench import barrier

pytestmark = pytest.mark.skipif(GPU, reason="one-program interpreter checks; a GPU runs the bench")
SHAPES = [(40, 24), (24, 40), (70, 24), (24, 50)]  # irregular: partial row and column tiles


@pytest.mark.parametrize("tile", [(16, 16, 1), (8, 32, 1)])
def test_every_form_is_the_chain(tile):
    chain = barrier.Chain(SHAPES, torch.float32, torch.device("cpu"))
    want = chain.reference()
    outs = {}
    for kind in ("launches", "persistent", "persistent+prefetch", "stream"):
        got = barrier.check(chain, barrier.launcher(kind, chain, tile, 1), None)
        outs[kind] = got["output"]
        assert got["spin_error"] == 0
        torch.testing.assert_close(got["output"], want, rtol=1e-5, atol=1e-5)
        assert int(chain.counters.abs().sum()) == 0  # the last program reset them
    assert torch.equal(outs["persistent"], outs["launches"])
    assert torch.equal(outs["persistent+prefetch"], outs["launches"])


def test_chain_refuses_a_phase_reading_past_its_input():
    with pytest.raises(ValueError, match="phase 1 reads 48 of 40"):
        barrier.Chain([(40, 24), (8, 48)], torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("args", [["--layers", "0"], ["--model", "no-such-model"],
                                  ["--blocks", "0"]])  # fmt: skip
def test_bad_arguments_exit_2(args, capsys):
    assert barrier.main(["--dry-run", *args]) == 2
    assert "barrier:" in capsys.readouterr().err


def test_shapes_chain_for_the_presets():
    for name in ("laneformer-2b", "llama-3.2-1b"):
        shapes = barrier.model_shapes(name, 2)
        assert len(shapes) == 8
        barrier.Chain(shapes[:5], torch.bfloat16, torch.device("meta"))  # reads fit


BIN = Path(triton_interp.triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
                    reason="this triton build has no bundled ptxas / cuobjdump")  # fmt: skip
def test_barrier_forms_compile_for_sm90_with_ordered_atomics():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # one tile shape: every form once (the others compile the same forms at other tiles)
    cmd = [sys.executable, "-m", "expresslane.bench.barrier", "--aot", "--tiles", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])["kernels"]
    with_atomics = [k for k in kernels if k["atomics"]]
    assert with_atomics and len(with_atomics) < len(kernels)  # stream and launches: none
    for k in with_atomics:  # a plain (relaxed) atomic would let a wait pass before the stores
        adds = [a for a in k["atomics"] if ".add." in a]
        assert adds and all(".gpu." in a and ("acq_rel" in a or "release" in a or "acquire" in a)
                            for a in adds), k["atomics"]  # fmt: skip
    assert all(k["blocks_per_sm"] >= 1 for k in kernels)
