"""Weight formats of the packed decode step: a matrix in fp32, bf16, fp16, int8 or GGUF blocks.

A `QTensor` is a weight (..., N, K) (leading lane axes allowed) in one storage format:

    float32, bfloat16, float16   data (..., N, K) in that dtype
    int8                         data (..., N, K) int8, scale (..., N) fp32: w = data * scale
                                 (symmetric, one scale per output row: absmax / 127); rowsum
                                 (..., N) int32, sum_k data, for kernels with integer inputs
    q8_0                         GGUF Q8_0 kept as it was stored, planar: data (..., N, K) int8,
                                 scale (..., N, K/32) f16: w = d_block * q
    q4_0 q4_1 q5_0 q5_1 q1_0     GGUF's 1- to 6-bit blocks kept as stored, re-laid planar
    q4_k q5_k q6_k q3_k q2_k     (nibbles, 2-bit crumbs or q1_0's bits in `data`, higher bits
    iq4_nl iq4_xs mxfp4 nvfp4    in `high`, block scales in `scale` / `mins`, K-quant sub-block
    iq3_s ... iq1_m              scales in `sub`): see blocks.py, which owns their layout and
                                 reference values, and gguf_blocks.py, which re-lays a file's blocks

A GGUF file may store the parts of one fused matrix in different formats (llama.cpp's Q4_K_M: Q
and K in Q5_0, V in Q8_0); their stack is a QTensor of format "mixed" whose `stack` holds the
parts, each a QTensor of its own rows (`stack_rows`), one product per part.

The GGUF formats come from a GGUF file's blocks (`from_gguf`, the same bits re-laid per field)
or, for q8_0 and q4_1, from `quantize` (llama.cpp's reference rounding, for tests). Whatever
the format, products are computed in fp32: `matvec(w, x)` upcasts the weights on the fly;
compiled by inductor it is one multiply-reduce that converts each weight in registers, eagerly
it dequantizes and uses F.linear. `dequantize()` is the reference every kernel is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from . import blocks, gguf_blocks

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_FORMATS = ("q8_0", *blocks.NIBBLE)
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
    high: torch.Tensor | None = None
    sub: torch.Tensor | None = None
    stack: tuple[QTensor, ...] | None = None  # "mixed": the parts, row ranges in order

    @property
    def shape(self) -> torch.Size:
        """The logical (..., N, K)."""
        if self.stack is not None:
            first = self.stack[0].shape
            return torch.Size((*first[:-2], sum(p.shape[-2] for p in self.stack), first[-1]))
        if self.fmt in blocks.NIBBLE:
            per = blocks.values_per_byte(self.fmt)
            return torch.Size((*self.data.shape[:-1], per * self.data.shape[-1]))
        return self.data.shape

    @property
    def parts(self) -> tuple[torch.Tensor | None, ...]:
        """Every field in order, None where the format has none (what the C side takes)."""
        return (self.data, self.scale, self.rowsum, self.mins, self.high, self.sub)

    @property
    def flat(self) -> tuple:
        """(fmt, every field, stack): QTensor(*flat) is this tensor again."""
        return (self.fmt, *self.parts, self.stack)

    @property
    def pieces(self) -> tuple[QTensor, ...]:
        """The QTensors one product reads in turn: the parts of a stack, else itself."""
        return self.stack if self.stack is not None else (self,)

    @property
    def fields(self) -> list[torch.Tensor]:
        if self.stack is not None:
            return [t for p in self.stack for t in p.fields]
        return [t for t in self.parts if t is not None]

    def map(self, fn) -> QTensor:
        """Every tensor field (of every part) through fn."""
        if self.stack is not None:
            return QTensor(self.fmt, None, stack=tuple(p.map(fn) for p in self.stack))
        return QTensor(self.fmt, *(None if t is None else fn(t) for t in self.parts))

    @property
    def nbytes(self) -> int:
        """Bytes a product streams: the stored values and their scales."""
        return sum(t.numel() * t.element_size() for t in self.fields)

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix this format stands for (the reference of every kernel)."""
        if self.stack is not None:
            return torch.cat([p.dequantize() for p in self.stack], dim=-2)
        if self.fmt in GGUF_FORMATS:
            return blocks.dequantize(self.fmt, self.data, self.scale, self.mins, self.high,
                                     self.sub)  # fmt: skip
        w = self.data.float()
        return w if self.scale is None else w * self.scale.unsqueeze(-1)

    def rows(self, start: int, stop: int) -> QTensor:
        """Output rows [start, stop) as views of the same storage."""
        if self.stack is not None:
            got, at = [], 0
            for p in self.stack:
                n = p.shape[-2]
                lo, hi = max(start, at) - at, min(stop, at + n) - at
                if lo < hi:
                    got.append(p.rows(lo, hi))
                at += n
            return got[0] if len(got) == 1 else QTensor(self.fmt, None, stack=tuple(got))

        def cut(t):
            if t is None:
                return None
            return t[..., start:stop] if t.dim() == self.data.dim() - 1 else t[..., start:stop, :]

        return QTensor(self.fmt, *(cut(t) for t in self.parts))

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 rows `index` of a (N, K) matrix (an embedding table)."""
        if self.fmt in GGUF_FORMATS:
            return self.select(index).dequantize()
        w = self.data[index].float()
        return w if self.scale is None else w * self.scale[index].unsqueeze(-1)

    def select(self, index: torch.Tensor) -> QTensor:
        return QTensor(self.fmt, *(None if t is None else t[index] for t in self.parts))


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


def kernel_reads(ggml_type: str) -> bool:
    """Whether from_gguf takes this GGUF type as stored (a float type or a kernel's blocks)."""
    return ggml_type in ("F32", "F16", "BF16") or ggml_type in gguf_blocks.TYPES


def from_gguf(ggml_type: str, data: torch.Tensor, shape: tuple[int, ...]) -> QTensor | None:
    """GGUF blocks (rows, bytes per row) of a (N, K) matrix as a planar QTensor: F32/F16/BF16
    and the block types of gguf_blocks.TYPES (the formats with kernels); None for any other type."""
    N, K = shape[0], shape[-1]
    if ggml_type in ("F32", "F16", "BF16"):
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[ggml_type]
        fmt = next(k for k, v in FLOAT_FORMATS.items() if v == dt)
        return QTensor(fmt, data.contiguous().view(dt).reshape(N, K))
    found = gguf_blocks.gguf_fields(ggml_type, data, N, K)
    return None if found is None else QTensor(found[0], **found[1])


def matvec(w: QTensor, x: torch.Tensor) -> torch.Tensor:
    """y[..., n] = sum_k w[..., n, k] x[..., k] in fp32; x (..., K) fp32 -> (..., N) fp32.

    Leading axes of w (lanes) pair with those of x. Compiled: one fused multiply-reduce per
    call (the weights converted in registers, never materialised in fp32). Eager, and for the
    GGUF block formats: dequantize and F.linear (or a batched matmul over lanes).
    """
    if w.stack is not None:
        return torch.cat([matvec(p, x) for p in w.stack], dim=-1)
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
    """QTensors (..., N_i, K) stacked along N: one format, every field with its rows; else a
    "mixed" stack of the parts (runs of one format merged)."""
    parts = [q for p in parts for q in p.pieces]
    if len({p.fmt for p in parts}) != 1:
        runs: list[list[QTensor]] = []
        for p in parts:
            if runs and runs[-1][0].fmt == p.fmt:
                runs[-1].append(p)
            else:
                runs.append([p])
        return QTensor("mixed", None, stack=tuple(stack_rows(r) for r in runs))
    rank = parts[0].data.dim()

    def cat(ts):  # per-value / per-block fields stack on -2, per-row ones on -1
        return None if ts[0] is None else torch.cat(ts, dim=-2 if ts[0].dim() == rank else -1)

    return QTensor(parts[0].fmt, *(cat([p.parts[i] for p in parts]) for i in range(6)))
