"""The AVX-512 C kernels (csrc/) against the dequantized reference on irregular shapes: the
products in every format, and whole one-lane layers against the Python layer they replace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from expresslane.step import native as cpu_kernels
from expresslane.weights.quant import FORMATS, quantize

GGUF_FORMATS = ("q8_0", "q4_1")  # those quantize() writes; the others: test_gguf_blocks.py
ALL = (*FORMATS, *GGUF_FORMATS)
needs = {
    fmt: pytest.mark.skipif(
        not cpu_kernels.available(fmt),
        reason=f"C kernels for {fmt}: not built, or this CPU lacks their instructions",
    )
    for fmt in ALL
}


def _case(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 3
    x = torch.randn(shape[:-2] + shape[-1:], generator=g)
    x[..., 0] = 25.0  # an outlier: int8's 16-bit fixed point scales to it
    return w, x


SHAPES = [(37, 70), (3, 45, 33), (130, 576), (9, 1), (64, 129), (5, 200)]
BLOCK_SHAPES = [(37, 96), (3, 5, 32), (130, 576), (6, 160), (7, 224), (2, 1536)]  # K % 32 == 0
CASES = [(f, s) for f in FORMATS for s in SHAPES] + [(f, s) for f in GGUF_FORMATS
                                                     for s in BLOCK_SHAPES]  # fmt: skip


@pytest.mark.parametrize(
    "fmt, shape", [pytest.param(f, s, marks=needs[f], id=f"{f}-{s}") for f, s in CASES]
)
def test_product_equals_the_dequantized_reference(fmt, shape):
    w, x = _case(shape, len(shape) * 100 + shape[-1])
    q = quantize(w, fmt)
    got = torch.ops.expresslane.cpu_matvec(*q.parts, x, fmt)
    ref = (q.dequantize().double() @ x.double().unsqueeze(-1)).squeeze(-1)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = (got.double() - ref).abs()
    if fmt in ("float32", "float16", "bfloat16"):  # summation order; bf16: x as two bf16 parts
        assert err.max().item() <= 2e-5 * (ref.abs().max().item() + 1e-6)
    else:  # x in 16-bit fixed point: each element off by at most half a step of max|x| / 32639
        step = x.abs().amax(-1, keepdim=True).double() / 32639
        bound = 0.5 * step * q.dequantize().double().abs().sum(-1) + 1e-5 * ref.abs() + 1e-6
        assert (err <= bound).all(), (err - bound).max().item()


@needs["bfloat16"]
@pytest.mark.parametrize("shape", [(37, 70), (130, 576), (5, 200), (9, 1)])
def test_bf16_products_with_lowp_take_x_rounded_to_bf16(shape):
    """lowp (--prefill-dtype bfloat16 or int8) on bf16 weights: x rounded to bf16 (its hi
    part alone, as llama.cpp's), to fp32's rounding; a row's bits the same for 1 token, 7 (one
    block) or 11 (three), by the one-block and the multi-block drivers alike; not the exact
    product."""
    g = torch.Generator().manual_seed(shape[-1])
    w, x = torch.randn(shape, generator=g), torch.randn(11, shape[-1], generator=g) * 3
    q = quantize(w, "bfloat16")
    got = cpu_kernels.native_matmul(q, x, lowp=True)  # 11 tokens: blocks of 4, 4 and 3
    ref = cpu_kernels.lowp_activations(x, "bfloat16").double() @ q.dequantize().double().T
    assert (got.double() - ref).abs().max() <= 2e-5 * (ref.abs().max() + 1e-6)
    one = torch.cat([cpu_kernels.native_matmul(q, x[s : s + 1], lowp=True) for s in range(11)])
    assert torch.equal(one, got)
    assert torch.equal(cpu_kernels.native_matmul(q, x[:7], lowp=True), got[:7])  # one block
    if shape[-1] > 1:
        assert not torch.equal(got, cpu_kernels.native_matmul(q, x))


@needs["int8"]
def test_threads_split_rows_and_change_nothing():
    w, x = _case((257, 300), 3)
    q = quantize(w, "int8")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.expresslane.cpu_matvec(*q.parts, x, "int8")
        torch.set_num_threads(2)
        two = torch.ops.expresslane.cpu_matvec(*q.parts, x, "int8")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each row is computed whole by one thread


@pytest.mark.parametrize(
    "fmt, head_dim, family",
    [pytest.param(f, 16, "mistral", marks=needs[f]) for f in ALL]
    + [pytest.param(f, hd, "mistral", marks=needs[f]) for f in ("float32", "int8")
       for hd in (64, 128)]
    + [pytest.param(f, 16, "qwen3", marks=needs[f]) for f in ("float32", "q8_0")],
)  # fmt: skip
def test_c_layers_equal_the_python_layers(fmt, head_dim, family):
    """NativeStep (one C call per layer) against the same packed weights run by the Python
    layer (packed.layer), token by token over a ring that wraps: logits and the cache. qwen3:
    each query and key head's RMSNorm before RoPE (no ring)."""
    from test_packed_step import PROMPT, llama

    from expresslane.cache import KVCache
    from expresslane.step.packed import PackedDecoder
    from expresslane.weights.packing import pack_model

    heads = {16: 4, 64: 2, 128: 2}[head_dim]  # head_dim 64 and 128 have their own paths in C
    ring = {"sliding_window": 6} if family == "mistral" else {}
    model = llama(seed=11, model_type=family, num_hidden_layers=3, hidden_size=heads * head_dim,
                  num_attention_heads=heads, num_key_value_heads={4: 2, 2: 1}[heads],
                  intermediate_size=96, **ring)  # fmt: skip
    pack_model(model, fmt)
    out = {}
    for native in (True, False):
        cache = KVCache(model.cfg, max_len=24)
        cache.static = True
        dec = PackedDecoder(model, cache, native=native)
        assert (dec.step is not None) == native
        with torch.no_grad():
            logits = [dec.forward(torch.tensor([t]), torch.tensor([i])) for i, t in
                      enumerate(PROMPT + PROMPT)]  # fmt: skip
        out[native] = torch.cat(logits), cache
    (a, ca), (b, cb) = out[True], out[False]
    # fp32 / fp16: summation order; bf16: x to 16 bits; integer formats: x to 16-bit fixed point
    scale = b.abs().max().item()
    tol = {"float32": 1e-4, "float16": 1e-4, "bfloat16": 1e-4 * scale}.get(fmt, 2e-3 * scale)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=tol)
    for i in range(len(ca.k)):
        assert torch.equal(ca.pos[i], cb.pos[i])
        torch.testing.assert_close(ca.k[i], cb.k[i], rtol=1e-4, atol=tol)


@pytest.mark.skipif(not cpu_kernels.native_step_built(), reason="the C kernels are not built here")
def test_environment_switch_turns_the_c_kernels_off():
    """EXPRESSLANE_CPU_KERNELS=0: the CLI's packed step falls back to the Python step."""
    probe = "import expresslane.step.native as c; print(c.native_step_built(), c.available('int8'))"
    env = {**os.environ, "EXPRESSLANE_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_cpu_products_bench_times_every_product_and_refuses_bad_counts(capsys):
    from pathlib import Path

    from expresslane.bench import cpu_products

    assert cpu_products.main(["--tokens", "0"]) == 2
    assert "cpu_products:" in capsys.readouterr().err
    assert cpu_products.main(["/no/such/model.gguf"]) == 2  # the message, not a traceback
    assert "no such folder or file" in capsys.readouterr().err
    model = Path(cpu_products.__file__).parents[1] / "assets" / "laneformer-py"
    assert cpu_products.main([str(model), "--tokens", "1", "3", "--repeats", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    names = {r["matrix"] for r in rows}
    assert {"wqkv", "wo", "w13", "w2", "head"} <= names and {r["tokens"] for r in rows} == {1, 3}
    assert all(r["ms"] > 0 and r["gops"] > 0 for r in rows)
    assert cpu_products.main([str(model), "--tokens", "1", "--repeats", "1", "--layer", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert {r["layer"] for r in rows} == {1} and not any(r["prompt"] for r in rows)
    assert cpu_products.main([str(model), "--tokens", "2", "--repeats", "1", "--prompt"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert rows and all(r["prompt"] for r in rows)
    assert cpu_products.main([str(model), "--layer", "99"]) == 2  # named, not a traceback
    assert "--layer 99" in capsys.readouterr().err


AMX = bool(cpu_kernels.FEATURES & cpu_kernels.HAS_AMX)
needs_amx = pytest.mark.skipif(not AMX, reason="this CPU (or Linux) gives no AMX-BF16 tiles")
NO_TILES = {**os.environ, "EXPRESSLANE_AMX": "0"}


def products_elsewhere(qs, xs, tmp_path, env) -> tuple[int, dict]:
    """A prompt's products (prompt=True) of each QTensor in qs on each x of xs, in a process with
    `env`: that process's feature bits and {fmt: [y, ...]}."""
    torch.save({"w": {q.fmt: q.parts for q in qs}, "xs": xs}, tmp_path / "case.pt")
    probe = (
        "import sys, torch; from expresslane.step import native as c; "
        "from expresslane.weights.quant import QTensor; d = torch.load(sys.argv[1]); "
        "torch.save((c.FEATURES, {f: [c.native_matmul(QTensor(f, *p), x, prompt=True) "
        "for x in d['xs']] for f, p in d['w'].items()}), sys.argv[2])"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "case.pt"),
                          str(tmp_path / "out.pt")], env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return torch.load(tmp_path / "out.pt")


@needs_amx
def test_tiles_and_dot_products_close_and_int8_the_same_bits(tmp_path):
    """Where AMX runs the bf16 and int8 products, and Q8_0's for a prompt's chunks (csrc/
    cpu_amx.c, cpu_amx_blocks.c), EXPRESSLANE_AMX=0 gives the dot-product kernels back. bf16 and a
    prompt's Q8_0: both near the reference, each in its own order of sums, so the bits differ
    somewhere (the switch is real). int8: integer sums, exact in any order, so the very same
    bits; and Q8_0 outside a prompt keeps the vpdpbusd kernel, bits and all. Irregular shapes: 3
    lanes of 45 rows (a partial tile of rows), K = 224 (bf16 and int8: a partial tile of
    values), 9 tokens and 37 (three tile widths, the last padded)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(3, 45, 224, generator=g)
    case = {f: quantize(w, f) for f in ("bfloat16", "int8", "q8_0")}
    xs = [torch.randn(S, 3, 224, generator=g) * 3 for S in (9, 37)]
    features, dot = products_elsewhere(case.values(), xs, tmp_path, NO_TILES)
    assert not features & cpu_kernels.HAS_AMX
    for fmt, q in case.items():
        for x, theirs in zip(xs, dot[fmt], strict=True):
            tiles = cpu_kernels.native_matmul(q, x, prompt=True)
            assert torch.equal(cpu_kernels.native_matmul(q, x), theirs) == (fmt != "bfloat16")
            wd = q.dequantize().double()
            ref = torch.einsum("lnk,slk->sln", wd, x.double())
            if fmt == "bfloat16":
                bound = 2e-5 * ref.abs().max()
            else:  # x in 16-bit fixed point: half a step of max|x| / 32639 an element
                step = x.abs().amax(-1, keepdim=True).double() / 32639
                bound = 0.5 * step * wd.abs().sum(-1) + 1e-5 * ref.abs() + 1e-6
            for got in (theirs, tiles):
                assert ((got.double() - ref).abs() <= bound).all(), fmt
            assert torch.equal(theirs, tiles) == (fmt == "int8"), fmt
    assert {"bfloat16", "int8", "q8_0"} <= set(dot)


@needs_amx
def test_the_dot_product_kernels_still_pass_without_tiles():
    """The vdpbf16ps and vpdpbusd kernels are what CPUs without AMX run (AMD's, older Xeons):
    their bf16, int8 and Q8_0 tests here and in test_packed_verify.py, in a process without
    tiles."""
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", os.path.join(here, "test_cpu_kernels.py"),
                          os.path.join(here, "test_packed_verify.py"), "-k",
                          "bf16 or bfloat16 or int8 or q8_0"], env=NO_TILES, capture_output=True,
                         text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
