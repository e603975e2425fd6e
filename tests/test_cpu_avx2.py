"""The C kernels built for AVX2 (csrc/simd_avx2.h: AVX-512's operations on two 256-bit halves),
which run where AVX-512 does not. On such a CPU every test of the kernels runs on them anyway;
on an AVX-512 CPU `EXPRESSLANE_CPU_KERNELS=avx2` picks them, and the kernels' own tests and
the packed step's run again on them here, against the same references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from expresslane.step import native

TESTS = Path(__file__).parent
try:
    from expresslane import _cpu_kernels_avx2 as avx2
except ImportError:  # not built (no compiler at install time)
    avx2 = None

pytestmark = pytest.mark.skipif(
    avx2 is None or not avx2.features(), reason="the AVX2 build is not here, or no AVX2"
)


def _python(code: str, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_avx2_build_runs_every_format():
    """Every format's bit (AVX-512F, BF16, VNNI sets) where AVX2, FMA and F16C are; never AMX."""
    assert avx2.features() == 7


def test_the_flag_picks_the_avx2_build_and_the_default_the_avx512_one_where_it_runs_all():
    pick = (
        "from expresslane.step import native; print(native._native.__name__, native.FEATURES & 7)"
    )
    assert _python(pick, EXPRESSLANE_CPU_KERNELS="avx2") == "expresslane._cpu_kernels_avx2 7"
    try:
        from expresslane import _cpu_kernels as wide
    except ImportError:
        wide = None
    every = wide is not None and wide.features() & 7 == 7
    want = "_cpu_kernels" if every else "_cpu_kernels_avx2"
    assert _python(pick, EXPRESSLANE_CPU_KERNELS="1") == f"expresslane.{want} 7"


@pytest.mark.skipif(
    native._native is None or native._native.__name__.endswith("_avx2"),
    reason="the AVX2 build is the one every test here runs on already",
)
def test_the_kernels_tests_pass_on_the_avx2_build():
    """tests/test_cpu_kernels.py and the packed step's (every format against the dequantized
    reference, S tokens against one) in a process that runs the AVX2 build."""
    files = [str(TESTS / "test_cpu_kernels.py"), str(TESTS / "test_packed_step.py")]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o",
           "addopts=", *files]  # fmt: skip
    env = {**os.environ, "EXPRESSLANE_CPU_KERNELS": "avx2"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=TESTS.parent,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout
