"""The AVX-512 and AVX2 builds of the C kernels give the same bits: every format's products (S
tokens, x exact or at llama.cpp's precision, a prompt's chunk), the block formats' dequantization,
and whole layers of three Llama-family shapes, the one build against the other in one process on
the same inputs. csrc/simd_avx2.h promises it (each AVX-512 operation done on two halves, the
reductions in GCC's order); this holds it to that promise where a CPU runs both builds.

AMX tiles are not compared: the AVX2 build has none, and the tile products' bits are their own
(test_cpu_kernels.py). On a CPU with AMX this file runs again in a process without them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_gguf_blocks import random_blocks
from test_packed_step import PROMPT, llama

from expresslane.cache import KVCache
from expresslane.step import native
from expresslane.step.packed import PackedDecoder
from expresslane.weights.gguf_blocks import TYPES
from expresslane.weights.packing import pack_model
from expresslane.weights.quant import FORMATS, from_gguf, quantize

try:
    from expresslane import _cpu_kernels as wide
    from expresslane import _cpu_kernels_avx2 as avx2
except ImportError:  # a build missing (no compiler at install time)
    wide = avx2 = None

pytestmark = pytest.mark.skipif(
    wide is None or wide.features() & 7 != 7 or avx2.features() & 7 != 7,
    reason="both builds must run here: a CPU with AVX-512F, BF16 and VNNI",
)
TILES = wide is not None and bool(wide.features() & native.HAS_AMX)
# (N, K): partial tiles of 16 rows, K with a partial last group of the formats' blocks
SHAPES = {32: [(37, 96), (19, 352)], 64: [(37, 192)], 128: [(19, 384)], 256: [(37, 512)]}
DENSE_SHAPES = [(37, 70), (3, 45, 33), (19, 352)]


def _both(fn, *args, **kwargs):
    """fn(*args, **kwargs) with the AVX-512 build, then with the AVX2 build."""
    kept = native._native
    try:
        out = []
        for build in (wide, avx2):
            native._native = build
            out.append(fn(*args, **kwargs))
        return out
    finally:
        native._native = kept


def _matrices():
    """(name, QTensor) of every format on irregular shapes."""
    for fmt in (*FORMATS, "q8_0", "q4_1"):
        for shape in DENSE_SHAPES if fmt in FORMATS else SHAPES[32]:
            g = torch.Generator().manual_seed(shape[-1])
            yield f"{fmt}-{shape}", quantize(torch.randn(shape, generator=g), fmt)
    for t, (_, block, _) in TYPES.items():
        for N, K in SHAPES[block]:
            yield f"{t}-{(N, K)}", from_gguf(t, random_blocks(t, N, K, N + K), (N, K))


def _rerun_without_tiles():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           __file__]  # fmt: skip
    env = {**os.environ, "EXPRESSLANE_AMX": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout


def test_products_and_dequantization_have_the_same_bits():
    if TILES:
        return _rerun_without_tiles()
    seen = 0
    for name, q in _matrices():
        K = q.shape[-1]
        x = torch.randn(9, *q.shape[:-2], K, generator=torch.Generator().manual_seed(K)) * 3
        x[..., 0] = 25.0  # an outlier: the fixed points scale to it
        for S in (1, 4, 9):
            for lowp, prompt in ((False, False), (True, False), (False, True)):
                if lowp and q.fmt not in native.LOWP_FORMATS:
                    continue
                a, b = _both(native.native_matmul, q, x[:S], lowp=lowp, prompt=prompt)
                assert torch.equal(a, b), (name, S, lowp, prompt, (a - b).abs().max().item())
        for dtype in native.DEQUANT_DTYPES:
            a, b = _both(native.native_dequantize, q, dtype)
            assert torch.equal(a, b), (name, dtype)
        seen += 1
    assert seen >= len(TYPES) + len(FORMATS)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "q8_0"])
@pytest.mark.parametrize("over", [{}, {"model_type": "qwen3", "head_dim": 12},
                                  {"model_type": "mistral", "sliding_window": 5}])  # fmt: skip
def test_layers_and_head_have_the_same_bits(fmt, over):
    """The C step (csrc/cpu_layer.c: norms, rope, attention, the MLP, the head) token by token and
    as one 9-token verify, in the KV cache's three types."""
    if TILES:
        pytest.skip("run by the first test's process without tiles")
    model = llama(**over)
    pack_model(model, fmt)
    tokens = torch.tensor(PROMPT)

    def run(kv_dtype):
        cache = KVCache(model.cfg, max_len=32, dtype=kv_dtype)
        cache.static = True
        dec = PackedDecoder(model, cache)
        assert dec.step is not None  # the C step runs, not the Python one
        steps = [dec.forward(tokens[i : i + 1], torch.tensor([i])).clone() for i in range(9)]
        cache2 = KVCache(model.cfg, max_len=32, dtype=kv_dtype)
        cache2.static = True
        whole = PackedDecoder(model, cache2).forward(tokens, torch.tensor([0])).clone()
        return torch.cat(steps), whole

    with torch.no_grad():
        for kv_dtype in native.KV_DTYPES:
            (sa, wa), (sb, wb) = _both(run, kv_dtype)
            assert torch.equal(sa, sb) and torch.equal(wa, wb), kv_dtype
