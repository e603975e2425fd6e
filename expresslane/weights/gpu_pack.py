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


def from_qtensor(q: QTensor) -> GPUQuant:
    """A packed CPU weight in GGUF Q8_0, Q4_1, Q1_0, IQ4_NL, IQ4_XS, MXFP4, NVFP4 blocks or a
    codebook type (IQ3_S ... IQ1_M), repacked for the GPU (same values). IQ4's grid is not
    linear, so its values go to int8 (the grid value itself, with the block's scale): 8 bits a
    value where the file has 4, half of bf16's bytes; a kernel that looks the grid up in
    registers would keep IQ4's (not done). So do the codebook types' (their scale times f),
    MXFP4's and NVFP4's, and Q1_0's (+-1), except IQ3_S's, whose re-laid nibbles are linear,
    w = (d s) (2 q - 15): int4 with a scale 2 d s and a min -15 d s per 32, both exact in fp32.
    The types with a scale per 16 values (IQ2_XS, IQ2_S, IQ1_M, NVFP4) take groups of 16."""
    lane = q.data.dim() == 2  # (N, K): one lane
    data, scale, mins, sub = [None if t is None else (t.unsqueeze(0) if lane else t)
                              for t in (q.data, q.scale, q.mins, q.sub)]  # fmt: skip
    k = q.shape[-1]
    kp = _padded(k, BLOCK)
    group = 16 if q.fmt in (*blocks.GRID16, "nvfp4") else BLOCK
    pad_groups = (kp - k) // group
    if q.fmt in blocks.XS or q.fmt in blocks.GRID16:  # d per 256 times an int8 scale per group
        d = scale.float().repeat_interleave(blocks.QK // group, dim=-1)  # (L, N, K/group)
        scale = d * sub.view(torch.int8).float() * blocks.FACTOR.get(q.fmt, 1.0)
    if q.fmt == "q1_0":  # values 0 or 2: w = d (q - 1), +-d
        values = blocks.values(q.fmt, data, None).to(torch.int8) - 1  # (L, N, K)
        scale = torch.nn.functional.pad(scale, (0, pad_groups))
        return GPUQuant("int8", BLOCK, k, _pad_k(values, kp).contiguous(), scale.contiguous())
    if q.fmt == "iq3_s":
        values = blocks.unpack_nibbles(data)
        pad = torch.nn.functional.pad
        scale, mins = pad(2 * scale, (0, pad_groups)), pad(-15 * scale, (0, pad_groups))
        return GPUQuant("int4", BLOCK, k, pack_nibbles(_pad_k(values, kp)), scale.contiguous(),
                        mins.contiguous())  # fmt: skip
    if q.fmt in blocks.GRID:
        index = blocks.values(q.fmt, data, None).long()  # (L, N, K)
        grid = torch.tensor(blocks.GRID[q.fmt], dtype=torch.int8)[index]
        scale = torch.nn.functional.pad(scale, (0, pad_groups))
        return GPUQuant("int8", group, k, _pad_k(grid, kp).contiguous(), scale.contiguous())
    if q.fmt == "q8_0":
        scale = torch.nn.functional.pad(scale, (0, pad_groups))
        return GPUQuant("int8", BLOCK, k, _pad_k(data, kp).contiguous(), scale.contiguous())
    if q.fmt == "q4_1":
        b = data.reshape(*data.shape[:-1], -1, BLOCK // 2)  # (L, N, K/32, 16)
        values = torch.cat((b & 0x0F, b >> 4), dim=-1).reshape(*data.shape[:-1], -1)
        scale = torch.nn.functional.pad(scale, (0, pad_groups))
        mins = torch.nn.functional.pad(mins, (0, pad_groups))
        return GPUQuant("int4", BLOCK, k, pack_nibbles(_pad_k(values, kp)), scale.contiguous(),
                        mins.contiguous())  # fmt: skip
    raise ValueError(
        f"no GPU layout for the {q.fmt} format (Q8_0, Q4_1, Q1_0, IQ4, MXFP4, NVFP4 "
        "and the codebook types repack)"
    )


Q4_K_BYTES = 144  # d f16, dmin f16, scales[12], qs[128] for 256 values


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 12) bytes -> 6-bit (scales, mins), each (..., 8) int32 (ggml's get_scale_min_k4)."""
    s = s.to(torch.int32)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat((lo_sc, hi_sc), -1), torch.cat((lo_mn, hi_mn), -1)


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
    sc, mn = _k_scales(b[..., 4:16])  # (N, K/256, 8)
    scale = (d * sc.float()).reshape(n, -1)
    mins = -(dmin * mn.float()).reshape(n, -1)
    qs = b[..., 16:].reshape(n, k // 2).contiguous()
    return GPUQuant("int4", 32, k, qs.unsqueeze(0), scale.unsqueeze(0).contiguous(),
                    mins.unsqueeze(0).contiguous())  # fmt: skip
