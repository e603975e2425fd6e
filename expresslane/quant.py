"""Weight formats of the packed decode step: a matrix stored in fp32, bf16, fp16 or int8.

A `QTensor` is a weight (..., N, K) (leading lane axes allowed) in one storage format:

    float32, bfloat16, float16   data (..., N, K) in that dtype
    int8                         data (..., N, K) int8, scale (..., N) fp32: w = data * scale
                                 (symmetric, one scale per output row: absmax / 127); rowsum
                                 (..., N) int32, sum_k data, for kernels with integer inputs

Whatever the format, products are computed in fp32: `matvec(w, x)` upcasts the weights on the
fly. Its body is written as a multiply and a sum over K, so that inductor (torch.compile on a
CPU) turns it into one vectorised loop that reads each weight once and converts it in
registers; run eagerly (tests, no compiler), the same call dequantizes and uses F.linear.
`dequantize()` is the reference every kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import ConfigError

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORMATS = (*FLOAT_FORMATS, "int8")


def check_format(fmt: str, what: str = "--quantization") -> str:
    if fmt not in FORMATS:
        raise ConfigError(f"{what} {fmt!r}: expected one of {', '.join(FORMATS)}")
    return fmt


@dataclass(frozen=True)
class QTensor:
    """A weight (..., N, K) in storage format `fmt`; `scale`, `rowsum` (..., N) for int8."""

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor | None = None
    rowsum: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: the stored values and their scales."""
        extra = [t for t in (self.scale, self.rowsum) if t is not None]
        return sum(t.numel() * t.element_size() for t in [self.data, *extra])

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix this format stands for (the reference of every kernel)."""
        w = self.data.float()
        return w if self.scale is None else w * self.scale.unsqueeze(-1)

    def rows(self, start: int, stop: int) -> QTensor:
        """Output rows [start, stop) as views of the same storage."""
        scale = None if self.scale is None else self.scale[..., start:stop]
        rowsum = None if self.rowsum is None else self.rowsum[..., start:stop]
        return QTensor(self.fmt, self.data[..., start:stop, :], scale, rowsum)

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` of a (N, K) matrix (an embedding table)."""
        w = self.data[index].float()
        return w if self.scale is None else w * self.scale[index].unsqueeze(-1)


def quantize(w: torch.Tensor, fmt: str) -> QTensor:
    """A float matrix (..., N, K) in format `fmt` (int8: round to nearest, per-row absmax)."""
    check_format(fmt)
    if fmt in FLOAT_FORMATS:
        return QTensor(fmt, w.detach().to(FLOAT_FORMATS[fmt]).contiguous())
    wf = w.detach().float()
    scale = wf.abs().amax(-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(wf / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).contiguous()
    return QTensor(fmt, q, scale.contiguous(), q.sum(-1, dtype=torch.int32))


def matvec(w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """y[..., n] = sum_k w[..., n, k] x[..., k] in fp32; x (..., K) fp32 -> (..., N) fp32.

    Leading axes of w (lanes) pair with those of x. Compiled: one fused multiply-reduce per
    call (the weights converted in registers, never materialised in fp32). Eager: dequantize
    and F.linear (or a batched matmul over lanes).
    """
    if torch.compiler.is_compiling():
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
    """Matrices (..., N_i, K) stacked along N: one product instead of several."""
    return torch.cat(parts, dim=-2)
