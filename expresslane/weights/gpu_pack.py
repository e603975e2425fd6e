"""Quantized weights for the GPU products: the layout, the quantizers and the GGUF repacks.

A `GPUQuant` is a lane-major weight (L, N, K) stored as small integers with one scale (and for
int4 one offset) per group of `group` values along K, in the layout kernels/qgemv.py reads:

    int8   data (L, N, Kp) int8;  scale (L, N, Kp/group):             w = q * scale
    int4   data (L, N, Kp/2) uint8; scale, mins (L, N, Kp/group):     w = q * scale + mins

Kp is K rounded up to a multiple of 64 and of the group (the tail is zeros, never read into a
sum: the kernel masks x at K). Scales and mins keep the dtype they came in (f16 from a GGUF Q8_0
or Q4_1 block, f16 from `quantize`, fp32 for Q4_K's two-level scales, which f16 cannot hold
exactly), and the kernel converts them in registers.

The int4 nibble order is Q4_K's: each 64 values of a row are 32 bytes, byte i holding value i in
its low nibble and value 32 + i in its high one. A row is then one contiguous run of bytes that
a warp reads 16 bytes a thread, and unpacking needs no shuffle: the low nibbles of a 32-byte
chunk are 32 consecutive values and the high nibbles the next 32, each inside one group for
groups of 32 or 128. GGUF Q4_K's `qs` bytes are already in this order (copied as they are);
Q4_1's blocks (byte j: values j and j + 16) are re-nibbled.

`quantize(w, fmt, group)` is the load-time quantizer of `--quantization int8|int4`: int8 is
symmetric (absmax / 127, Q8_0's rule), int4 asymmetric with a min (Q4_1 / Q4_K's form; GPTQ's
zero point is the same thing, mins = -zero * scale). `dequantize()` is the reference every
kernel is compared with: the fp32 matrix, computed as q * scale + mins in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from . import blocks
from .gguf_blocks import k_scales
from .quant import BLOCK, QTensor

CHUNK = 64  # int4 values per 32-byte nibble chunk (Q4_K's order)
GROUPS = (32, 128)
# --quantization NAME on a GPU -> (format, group size): int8 in Q8_0's groups of 32, int4 in
# GPTQ's groups of 128; the other group size by suffix.
GPU_QUANTIZATIONS = {
    "int8": ("int8", 32),
    "int8-g128": ("int8", 128),
    "int4": ("int4", 128),
    "int4-g32": ("int4", 32),
}


def gpu_format(name: str) -> tuple[str, int]:
    """(format, group) of a --quantization name for the GPU products."""
    if name not in GPU_QUANTIZATIONS:
        raise ConfigError(
            f"--quantization {name!r}: expected one of {', '.join(GPU_QUANTIZATIONS)} on a GPU"
        )
    return GPU_QUANTIZATIONS[name]


@dataclass(frozen=True)
class GPUQuant:
    """A weight (L, N, K) in the GPU layout (module docstring); `k` is the logical K."""

    fmt: str  # "int8" or "int4"
    group: int
    k: int
    data: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.k))

    @property
    def padded_k(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt == "int4" else 1)

    @property
    def fields(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.mins) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes one product streams: the integers and their scales (and mins)."""
        return sum(t.numel() * t.element_size() for t in self.fields)

    def to(self, device) -> GPUQuant:
        moved = [None if t is None else t.to(device) for t in (self.data, self.scale, self.mins)]
        return GPUQuant(self.fmt, self.group, self.k, *moved)

    def values(self) -> torch.Tensor:
        """The integers as (L, N, Kp) int32, in value order (int4 unpacked)."""
        if self.fmt == "int8":
            return self.data.to(torch.int32)
        b = self.data.reshape(*self.data.shape[:-1], -1, CHUNK // 2).to(torch.int32)
        q = torch.cat((b & 0x0F, b >> 4), dim=-1)  # (L, N, Kp/64, 64)
        return q.reshape(*self.data.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        """The fp32 (L, N, K) this stands for: q * scale (+ mins), in fp32."""
        q = self.values().float()
        lead = q.shape[:-1]
        q = q.reshape(*lead, -1, self.group)  # (L, N, Kp/group, group)
        w = q * self.scale.float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.float().unsqueeze(-1)
        return w.reshape(*lead, -1)[..., : self.k]


def _padded(k: int, group: int) -> int:
    step = max(CHUNK, group)
    return -(-k // step) * step


def _pad_k(w: torch.Tensor, kp: int) -> torch.Tensor:
    return torch.nn.functional.pad(w, (0, kp - w.shape[-1])) if kp != w.shape[-1] else w


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in fp32, 0 where the scale is 0 (an all-equal group quantizes to 0)."""
    s = scale.float()
    return torch.where(s > 0, 1.0 / s, torch.zeros_like(s))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values 0-15 (..., Kp) -> (..., Kp/2) uint8 in the chunk order of the module docstring."""
    c = q.to(torch.uint8).reshape(*q.shape[:-1], -1, CHUNK)  # (..., Kp/64, 64)
    packed = c[..., : CHUNK // 2] | (c[..., CHUNK // 2 :] << 4)  # (..., Kp/64, 32)
    return packed.reshape(*q.shape[:-1], -1).contiguous()


def quantize(w: torch.Tensor, fmt: str, group: int, scale_dtype=torch.float16) -> GPUQuant:
    """A float (L, N, K) (or (N, K), given one lane) as int8 or int4 in groups of `group`."""
    if fmt not in ("int8", "int4") or group not in GROUPS:
        raise ConfigError(f"GPU quantization {fmt} / group {group}: expected int8 or int4, "
                          f"group {' or '.join(map(str, GROUPS))}")  # fmt: skip
    w = w.detach().float()
    if w.dim() == 2:
        w = w.unsqueeze(0)
    k = w.shape[-1]
    g = _pad_k(w, _padded(k, group)).reshape(*w.shape[:-1], -1, group)  # (L, N, Kp/g, g)
    if fmt == "int8":
        scale = (g.abs().amax(-1) / 127.0).to(scale_dtype)
        inv = _inverse(scale)
        q = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return GPUQuant("int8", group, k, q.reshape(*w.shape[:-1], -1).contiguous(),
                        scale.contiguous())  # fmt: skip
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).to(scale_dtype)
    mins = lo.to(scale_dtype)
    # q from the stored (rounded) scale and min, so the rounding error is the format's alone
    inv = _inverse(scale)
    q = torch.round((g - mins.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
    q = q.reshape(*w.shape[:-1], -1)
    return GPUQuant("int4", group, k, pack_nibbles(q), scale.contiguous(), mins.contiguous())


# GGUF formats whose values go to int8 less an offset, times their (per-16 or per-32) scale
_OFFSET = {"q1_0": 1, "q5_0": 16, "q6_k": 32, "q3_k": 4}
_PER_16 = (*blocks.GRID16, "nvfp4", "q6_k", "q3_k")  # a scale per 16 values: groups of 16
_TWO_LEVEL = (*blocks.XS, *blocks.GRID16, "q6_k", "q3_k")  # d per 256 times an int8 scale


def from_qtensor(q: QTensor) -> GPUQuant:
    """A packed CPU weight in GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q6_K, Q3_K, Q1_0, IQ4_NL,
    IQ4_XS, MXFP4, NVFP4, the codebook types IQ3_S ... IQ1_M), repacked for the GPU with the same
    values, all exact in fp32 (an f16 d times an int8 scale and a power of two).
    - Linear nibbles go to int4 with a scale and a min per 32: Q4_1's, Q4_0's (min -8 d), and
      IQ3_S's re-laid ones, w = (d s) (2 q - 15) (scale 2 d s, min -15 d s).
    - The rest go to int8, the value itself with its block's scale: Q8_0; Q5_0, Q6_K, Q3_K and
      Q1_0 less their offset; the grids' values (IQ4's, MXFP4's, the codebook types', which are
      not linear): 8 bits a value where the file has 1.5-6, half of bf16's bytes. A kernel that
      looks a grid up in registers would keep the file's bits (not done).
    The types with a scale per 16 values take groups of 16. Q5_1, Q5_K and Q2_K (a min per
    block, which int8 has not) have no layout here; Q4_K repacks from its bytes (from_q4_k)."""
    lane = q.data.dim() == 2  # (N, K): one lane
    data, scale, mins, high, sub = [None if t is None else (t.unsqueeze(0) if lane else t)
                                    for t in (q.data, q.scale, q.mins, q.high, q.sub)]  # fmt: skip
    k, kp = q.shape[-1], _padded(q.shape[-1], BLOCK)
    group = 16 if q.fmt in _PER_16 else BLOCK
    if q.fmt in _TWO_LEVEL:  # d per 256 times an int8 scale per group, fp32 as the reference
        d = scale.float().repeat_interleave(blocks.QK // group, dim=-1)  # (L, N, K/group)
        scale = d * sub.view(torch.int8).float() * blocks.FACTOR.get(q.fmt, 1.0)
    if q.fmt == "q8_0":
        return _int8(data, scale, group, k, kp)
    if q.fmt == "q1_0":  # a d per 128 values, per 32 here
        scale = scale.repeat_interleave(4, dim=-1)
    if q.fmt in _OFFSET:
        values = blocks.values(q.fmt, data, high).to(torch.int16) - _OFFSET[q.fmt]  # (L, N, K)
        return _int8(values.to(torch.int8), scale, group, k, kp)
    if q.fmt in ("q4_0", "q4_1", "iq3_s"):
        values = blocks.unpack_nibbles(data)  # (L, N, K) 0..15, in value order
        if q.fmt == "q4_0":  # both fp32, as the kernel's other int4 repacks keep one dtype
            scale = scale.float()
            mins = -8 * scale
        elif q.fmt == "iq3_s":
            scale, mins = 2 * scale, -15 * scale
        return _int4(values, scale, mins, k, kp)
    if q.fmt in blocks.GRID:
        index = blocks.values(q.fmt, data, None).long()  # (L, N, K)
        grid = torch.tensor(blocks.GRID[q.fmt], dtype=torch.int8)[index]
        return _int8(grid, scale, group, k, kp)
    raise ValueError(f"no GPU layout for the {q.fmt} format (a min per block: int8 has none)")


def _int8(values: torch.Tensor, scale: torch.Tensor, group: int, k: int, kp: int) -> GPUQuant:
    scale = torch.nn.functional.pad(scale, (0, (kp - k) // group))
    return GPUQuant("int8", group, k, _pad_k(values, kp).contiguous(), scale.contiguous())


def _int4(values, scale, mins, k: int, kp: int) -> GPUQuant:
    pad = (0, (kp - k) // BLOCK)
    scale, mins = torch.nn.functional.pad(scale, pad), torch.nn.functional.pad(mins, pad)
    return GPUQuant("int4", BLOCK, k, pack_nibbles(_pad_k(values, kp)), scale.contiguous(),
                    mins.contiguous())  # fmt: skip


Q4_K_BYTES = 144  # d f16, dmin f16, scales[12], qs[128] for 256 values


def from_q4_k(raw: torch.Tensor, n: int, k: int) -> GPUQuant:
    """GGUF Q4_K bytes of an (N, K) matrix (K % 256 == 0) as int4 in groups of 32, one lane.

    The nibbles are copied as stored; the two-level scales become one fp32 scale and min per
    32 values, d * sc and -(dmin * m), the products the dequantization computes (exact in fp32,
    not in f16). That costs 2 bits a value more than Q4_K's 4.5; a two-level variant of the
    kernel would keep Q4_K's bytes (not done)."""
    if k % 256:
        raise ValueError(f"Q4_K needs K a multiple of 256, not {k}")
    b = raw.reshape(n, k // 256, Q4_K_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (N, K/256, 1)
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    sc, mn = k_scales(b[..., 4:16])  # (N, K/256, 8)
    scale = (d * sc.float()).reshape(n, -1)
    mins = -(dmin * mn.float()).reshape(n, -1)
    qs = b[..., 16:].reshape(n, k // 2).contiguous()
    return GPUQuant("int4", 32, k, qs.unsqueeze(0), scale.unsqueeze(0).contiguous(),
                    mins.unsqueeze(0).contiguous())  # fmt: skip
