"""Weight formats: int8 rounding bounds, 16-bit rounding, and the compiled products against the
dequantized reference on irregular shapes (lanes, odd rows and columns)."""

from __future__ import annotations

import pytest
import torch

from expresslane.errors import ConfigError
from expresslane.weights.quant import FORMATS, QTensor, check_format, matvec, quantize


def _weights(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[:-1] + (1,), generator=g) * 3
    w[..., 5, :] = 0.0  # an all-zero row must stay exactly zero
    return w


def test_int8_rounds_each_row_to_its_own_grid():
    w = _weights((3, 37, 70))
    q = quantize(w, "int8")
    assert q.data.dtype == torch.int8 and q.scale.shape == (3, 37)
    err = (q.dequantize() - w).abs()
    assert (err <= q.scale.unsqueeze(-1) / 2 + 1e-6).all()  # round to nearest: half a step
    assert q.data.abs().amax(-1).eq(127).logical_or(w.abs().amax(-1).eq(0)).all()  # full range
    assert q.dequantize()[:, 5].eq(0).all()
    assert q.nbytes == 3 * 37 * 70 + 3 * 37 * 4 * 2  # values, scales, row sums


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16"])
def test_float_formats_are_plain_casts(fmt):
    w = _weights((37, 70))
    q = quantize(w, fmt)
    assert q.scale is None
    assert torch.equal(q.dequantize(), w.to(q.data.dtype).float())


def test_rows_and_lookup_are_views_of_the_same_storage():
    w = _weights((2, 37, 70))
    q = quantize(w, "int8")
    part = q.rows(4, 20)
    assert part.data.data_ptr() == q.data[..., 4:, :].data_ptr()
    assert torch.equal(part.dequantize(), q.dequantize()[..., 4:20, :])
    table = quantize(w[0], "int8")
    idx = torch.tensor([3, 0, 36])
    assert torch.equal(table.lookup(idx), table.dequantize()[idx])


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="--quantization 'int4'"):
        check_format("int4")


def _all_formats(parts, xs):
    """Every format's product: `parts` are (data, scale) of the quantized weights, in order."""
    fmts = [f for f in FORMATS for _ in range(2)]
    return [matvec(QTensor(f, d, s), x) for f, (d, s), x in zip(fmts, parts, xs, strict=True)]


def test_compiled_products_equal_the_dequantized_reference():
    """One compilation covers every format: inductor's fused multiply-reduce (weights
    converted in registers, activations materialised once) against dequantize + matmul, on a
    lane-major (L, N, K) and a plain (N, K) weight of odd sizes."""
    w3, x3 = _weights((3, 37, 70), 1), torch.randn(3, 70)
    w2, x2 = _weights((45, 33), 2), torch.randn(33)
    qs = [quantize(w, f) for f in FORMATS for w in (w3, w2)]
    xs = [x3, x2] * len(FORMATS)

    def run(parts, xs):  # a producer inductor would inline into the product, like an RMSNorm
        xs = [x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) for x in xs]
        return _all_formats(parts, xs)

    with torch.no_grad():
        got = torch.compile(run, dynamic=False)([(q.data, q.scale) for q in qs], xs)
    for q, x, y in zip(qs, xs, got, strict=True):
        xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
        ref = (q.dequantize().double() @ xn.double().unsqueeze(-1)).squeeze(-1)
        assert y.dtype == torch.float32 and y.shape == ref.shape
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4, msg=q.fmt)


def test_eager_product_is_the_reference():
    w, x = _weights((3, 37, 70)), torch.randn(3, 70)
    q = quantize(w, "int8")
    ref = torch.stack([q.dequantize()[i] @ x[i] for i in range(3)])
    torch.testing.assert_close(matvec(q, x), ref)
    assert isinstance(q, QTensor)


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1"])
def test_gguf_blocks_kept_planar_dequantize_as_the_reader_does(ggml_type):
    """from_gguf re-lays a GGUF tensor's blocks (values, scales, mins apart) without changing a
    bit; our quantizer rounds as gguf's (llama.cpp's reference) does."""
    gguf = pytest.importorskip("gguf")
    from expresslane.gguf.quants import dequantize
    from expresslane.weights.quant import from_gguf

    w = _weights((37, 96), 4)
    raw = torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[ggml_type]))
    q = from_gguf(ggml_type, raw, (37, 96))
    assert q.fmt == ggml_type.lower() and q.shape == (37, 96) and q.nbytes == raw.numel()
    assert torch.equal(q.dequantize(), dequantize(raw, ggml_type, (37, 96)))
    assert torch.equal(quantize(w, q.fmt).dequantize(), q.dequantize())
    assert torch.equal(q.rows(3, 9).dequantize(), q.dequantize()[3:9])
    assert from_gguf("Q8_K", raw, (37, 96)) is None  # no kernel: the caller keeps floats
