"""Weight formats of the packed decode step: a matrix in fp32, bf16, fp16, int8 or GGUF blocks.

A `QTensor` is a weight (..., N, K) (leading lane axes allowed) in one storage format:

    float32, bfloat16, float16   data (..., N, K) in that dtype
    int8                         data (..., N, K) int8, scale (..., N) fp32: w = data * scale
                                 (symmetric, one scale per output row: absmax / 127); rowsum
                                 (..., N) int32, sum_k data, for kernels with integer inputs
    q8_0                         GGUF Q8_0 kept as it was stored, planar: data (..., N, K) int8,
                                 scale (..., N, K/32) f16: w = d_block * q
    q4_1                         GGUF Q4_1, planar: data (..., N, K/2) uint8, two values a byte
                                 in GGUF's order (in each block of 32, byte j holds value j in
                                 its low nibble and value j + 16 in its high one), scale and
                                 mins (..., N, K/32) f16: w = d_block * q + m_block

The GGUF formats come from a GGUF file's blocks (`from_gguf`, the same bits re-laid per field)
or from `quantize` (llama.cpp's reference rounding, for tests). Whatever the format, products
are computed in fp32: `matvec(w, x)` upcasts the weights on the fly; compiled by inductor it is
one multiply-reduce that converts each weight in registers, eagerly it dequantizes and uses
F.linear. `dequantize()` is the reference every kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_FORMATS = ("q8_0", "q4_1")
FORMATS = (*FLOAT_FORMATS, "int8")  # what a float matrix may be quantized to on the CLI
BLOCK = 32  # values per GGUF block


def check_format(fmt: str, what: str = "--quantization") -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"{what} {fmt!r}: expected one of {', '.join(FORMATS)}")
    return fmt


@dataclass(frozen=True)
class QTensor:
    """A weight (..., N, K) in storage format `fmt` (fields as the module docstring says)."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    rowsum: torch.Tensor | None = None
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        """The logical (..., N, K)."""
        if self.fmt == "q4_1":
            return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))
        return self.data.shape

    @property
    def fields(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.rowsum, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: the stored values and their scales."""
        return sum(t.numel() * t.element_size() for t in self.fields)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix this format stands for (the reference of every kernel)."""
        if self.fmt == "q4_1":
            lead = self.data.shape[:-1]
            b = self.data.reshape(*lead, -1, BLOCK // 2)  # (..., N, K/32, 16)
            q = torch.cat((b & 0x0F, b >> 4), dim=-1).float()  # values 0-15, then 16-31
            w = q * self.scale.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
            return w.reshape(*lead, -1)
        if self.fmt == "q8_0":
            lead = self.data.shape[:-1]
            q = self.data.reshape(*lead, -1, BLOCK).float()
            return (q * self.scale.float().unsqueeze(-1)).reshape(*lead, -1)
        w = self.data.float()
        return w if self.scale is None else w * self.scale.unsqueeze(-1)

    def rows(self, start: int, stop: int) -> QTensor:
        """Output rows [start, stop) as views of the same storage."""

        def cut(t):
            if t is None:
                return None
            return t[..., start:stop] if t.dim() == self.data.dim() - 1 else t[..., start:stop, :]

        return QTensor(self.fmt, cut(self.data), cut(self.scale), cut(self.rowsum), cut(self.mins))

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` of a (N, K) matrix (an embedding table)."""
        if self.fmt in GGUF_FORMATS:
            return self.select(index).dequantize()
        w = self.data[index].float()
        return w if self.scale is None else w * self.scale[index].unsqueeze(-1)

    def select(self, index: torch.Tensor) -> QTensor:
        pick = [None if t is None else t[index] for t in (self.scale, self.rowsum, self.mins)]
        return QTensor(self.fmt, self.data[index], *pick)


def quantize(w: torch.Tensor, fmt: str) -> QTensor:
    """A float matrix (..., N, K) in format `fmt`: int8 rounds to nearest with a per-row absmax
    scale; q8_0 / q4_1 round as llama.cpp's reference quantizers (K a multiple of 32)."""
    if fmt in FLOAT_FORMATS:
        return QTensor(fmt, w.detach().to(FLOAT_FORMATS[fmt]).contiguous())
    wf = w.detach().float()
    if fmt == "q8_0":
        return _q8_0(wf)
    if fmt == "q4_1":
        return _q4_1(wf)
    check_format(fmt)
    scale = wf.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(wf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).contiguous()
    return QTensor(fmt, q, scale.contiguous(), q.sum(-1, dtype=torch.int32))


def _blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % BLOCK:
        raise ValueError(f"GGUF blocks need K a multiple of {BLOCK}, not {w.shape[-1]}")
    return w.reshape(*w.shape[:-1], -1, BLOCK)  # (..., N, K/32, 32)


def _q8_0(w: torch.Tensor) -> QTensor:
    b = _blocks(w)
    d = b.abs().amax(-1) / 127.0  # ggml: d = amax / 127, q = round(x / d)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return QTensor("q8_0", q.reshape(w.shape).contiguous(), d.half().contiguous())


def _q4_1(w: torch.Tensor) -> QTensor:
    b = _blocks(w)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15.0  # ggml: d = (max - min) / 15, q = (x - min) / d + 0.5 truncated
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = ((b - lo.unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).floor().clamp(0, 15).to(torch.uint8)
    packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # (..., N, K/32, 16)
    data = packed.reshape(*w.shape[:-1], -1).contiguous()
    return QTensor("q4_1", data, d.half().contiguous(), None, lo.half().contiguous())


def from_gguf(ggml_type: str, data: torch.Tensor, shape: tuple[int, ...]) -> QTensor | None:
    """GGUF blocks (rows, bytes per row) of a (N, K) matrix as a planar QTensor: F32/F16/BF16,
    Q8_0 and Q4_1 (the formats with kernels); None for any other type."""
    N, K = shape[0], shape[-1]
    if ggml_type in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[ggml_type]
        fmt = next(k for k, v in FLOAT_FORMATS.items() if v == dt)
        return QTensor(fmt, data.contiguous().view(dt).reshape(N, K))
    if ggml_type == "Q8_0":  # block: d f16, 32 int8
        b = data.reshape(N, K // BLOCK, 34)
        d = b[..., :2].contiguous().view(torch.float16)[..., 0]
        q = b[..., 2:].contiguous().view(torch.int8).reshape(N, K)
        return QTensor("q8_0", q, d.contiguous())
    if ggml_type == "Q4_1":  # block: d f16, m f16, 16 bytes of nibbles
        b = data.reshape(N, K // BLOCK, 20)
        d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
        m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
        q = b[..., 4:].reshape(N, K // 2).contiguous()
        return QTensor("q4_1", q, d.contiguous(), None, m.contiguous())
    return None


def matvec(w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """y[..., n] = sum_k w[..., n, k] x[..., k] in fp32; x (..., K) fp32 -> (..., N) fp32.

    Leading axes of w (lanes) pair with those of x. Compiled: one fused multiply-reduce per
    call (the weights converted in registers, never materialised in fp32). Eager, and for the
    GGUF block formats: dequantize and F.linear (or a batched matmul over lanes).
    """
    if torch.compiler.is_compiling() and w.fmt not in GGUF_FORMATS:
        x = materialize(x)
        y = (w.data.float() * x.unsqueeze(-2)).sum(-1)  # (..., N): inductor's reduction loop
        return y if w.scale is None else y * w.scale
    wf = w.dequantize()
    if wf.dim() == 2:
        return F.linear(x, wf)
    return torch.matmul(wf, x.unsqueeze(-1)).squeeze(-1)


def materialize(x: torch.Tensor) -> torch.Tensor:
    """x computed once into a buffer. Inductor would otherwise inline the producer of a
    product's input (an RMSNorm: a load, a scalar sqrt and two multiplies per element) into the
    inner loop over the weights, redoing it for every output row."""
    strides, step = [], 1
    for n in reversed(x.shape):
        strides.append(step)
        step *= n
    return torch.ops.prims.inductor_force_stride_order(x, strides[::-1])


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Float matrices (..., N_i, K) stacked along N: one product instead of several."""
    return torch.cat(parts, dim=-2)


def stack_rows(parts: list[QTensor]) -> QTensor:
    """QTensors (..., N_i, K) of one format stacked along N, every field with its rows."""
    if len({p.fmt for p in parts}) != 1:
        raise ValueError(f"cannot stack formats {sorted({p.fmt for p in parts})}")
    rank = parts[0].data.dim()

    def cat(ts):  # per-value / per-block fields stack on -2, per-row ones on -1
        return None if ts[0] is None else torch.cat(ts, dim=-2 if ts[0].dim() == rank else -1)

    return QTensor(parts[0].fmt, cat([p.data for p in parts]), cat([p.scale for p in parts]),
                   cat([p.rowsum for p in parts]), cat([p.mins for p in parts]))  # fmt: skip
