"""The AMX tile kernels on CPUs without AMX: EXPRESSLANE_AMX=emulate runs their tile instructions
in C (csrc/cpu_amx_emulate.h), so their tests run on any CPU with AVX512_BF16; and where the CPU
has tiles, the emulation's integer products are the hardware's bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from expresslane.step import native

HERE = os.path.dirname(__file__)
EMULATE = {**os.environ, "EXPRESSLANE_AMX": "emulate"}
AMX = bool(native.FEATURES & native.HAS_AMX)
BF16 = native.available("bfloat16")  # AVX512_BF16: HAS_BF16
needs_c = pytest.mark.skipif(not native.available("q8_0"), reason="needs the C kernels")


@needs_c
@pytest.mark.skipif(AMX, reason="this CPU runs the tile tests on its own tiles")
@pytest.mark.skipif(not BF16, reason="the tile kernels' other code needs AVX512_BF16")
def test_the_tile_kernels_tests_pass_emulated():
    """The tests that take the tile paths where HAS_AMX is set: the products against their
    references (bf16, int8, Q8_0 and every nibble format's prompt chunks), each row's bits
    whatever S (speculation's output plain greedy's), and the prompt crossings' tables."""
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
            os.path.join(HERE, "test_cpu_kernels.py"), os.path.join(HERE, "test_packed_verify.py"),
            os.path.join(HERE, "test_step_prefill.py"),
            os.path.join(HERE, "test_gguf_blocks.py") + "::test_a_prompts_products_are_x_rounded"
            "_times_the_weights",
            # the kernels without tiles: what this CPU's own run of the suite tests already
            "-k", "not still_pass_without_tiles and not environment_switch"]  # fmt: skip
    probe = "from expresslane.step import native as c; assert c.FEATURES & c.HAS_AMX"
    on = subprocess.run([sys.executable, "-c", probe], env=EMULATE, capture_output=True)
    if on.returncode:
        pytest.skip("the compiler that built the C kernels knows no AMX intrinsics")
    out = subprocess.run([sys.executable, *args], env=EMULATE, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@needs_c
@pytest.mark.skipif(not AMX, reason="this CPU (or Linux) gives no AMX tiles to compare with")
def test_the_emulation_gives_the_hardware_bits(tmp_path):
    """Integer tile products are exact, so the emulation's products of int8 rows and of a
    prompt's Q8_0, Q4_0, Q4_K, Q6_K and Q2_K blocks are the hardware's, bit for bit; bf16's
    fp32 sums to within their rounding (the emulation adds a pair's two products one after the
    other, as Intel's pseudo-code; the hardware's order inside a tile product is its own).
    Irregular shapes: 45 rows (a partial tile of rows), 17 and 37 tokens (the last token block
    padded)."""
    from test_cpu_kernels import products_elsewhere
    from test_gguf_blocks import random_blocks

    from expresslane.weights.quant import from_gguf, quantize

    g = torch.Generator().manual_seed(3)
    case = {f: quantize(torch.randn(45, 512, generator=g), f) for f in ("bfloat16", "int8", "q8_0")}
    for t in ("Q4_0", "Q4_K", "Q6_K", "Q2_K"):
        case[t] = from_gguf(t, random_blocks(t, 45, 512, 11), (45, 512))
    xs = [torch.randn(S, 512, generator=g) * 3 for S in (17, 37)]
    features, emu = products_elsewhere(case.values(), xs, tmp_path, EMULATE)
    assert features & native.HAS_AMX and set(emu) == {q.fmt for q in case.values()}
    for q in case.values():
        for x, theirs in zip(xs, emu[q.fmt], strict=True):
            mine = native.native_matmul(q, x, prompt=True)
            if q.fmt == "bfloat16":  # each within 2e-5 max|y| of the exact sum (test_cpu_kernels)
                assert (mine - theirs).abs().max() <= 4e-5 * theirs.abs().max(), q.fmt
            else:
                assert torch.equal(mine, theirs), q.fmt
