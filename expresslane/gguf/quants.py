"""GGML tensor types -> float32: vectorized dequantizers for the types ExpressLane loads.

Each takes the raw bytes of a tensor (uint8, as stored: blocks back to back) and returns its
values in fp32, computed as llama.cpp's ggml-quants.c does (scale times quant, minus the minimum;
the same operation order, so results match `gguf.quants.dequantize` bit for bit). Block layouts,
per block of `values` weights and `bytes` bytes:

    Q8_0  (32, 34):  d:f16, q:int8[32]                        x = d*q
    Q4_0  (32, 18):  d:f16, nibbles[16]                       x = d*(q-8)
    Q4_1  (32, 20):  d:f16, m:f16, nibbles[16]                x = d*q + m
    Q5_0  (32, 22):  d:f16, high bits:u32, nibbles[16]        x = d*(q-16)
    Q5_1  (32, 24):  d:f16, m:f16, high bits:u32, nibbles[16] x = d*q + m
    Q4_K (256, 144): d, dmin:f16, 8 x (6-bit scale, 6-bit min), nibbles[128]
    Q5_K (256, 176): as Q4_K, plus one high bit per value in qh[32]
    Q6_K (256, 210): low nibbles ql[128], 2 high bits qh[64], int8 scales[16], d:f16
    Q3_K (256, 110): high bits hmask[32], 2 low bits qs[64], 16 6-bit scales[12], d:f16
                     x = (d (s - 32)) (q - 4), q = low + 4 high
    Q2_K  (256, 84): per 16 a 4-bit scale and min scales[16], 2 bits qs[64], d, dmin:f16
                     x = (d s) q - (dmin m)
    IQ4_NL (32, 18): d:f16, nibbles[16]                       x = d IQ4_VALUES[q]
    IQ4_XS (256, 136): d:f16, 8 6-bit scales (high 2 bits u16, low 4 bits [4]), nibbles[128]
                     x = (d (s - 32)) IQ4_VALUES[q], a scale per 32 values
    IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M: the codebook types, indices into
                     grids of 4 or 8 values (weights/grids.py)   x = (d (2 s + 1) f) v
    MXFP4   (32, 17): e:u8, nibbles[16]          x = 2^(e-128) MXFP4_VALUES[q] (e8m0, halved)
    NVFP4   (64, 36): 4 UE4M3 scales, 4 x 8 bytes: per 16 values, byte j holds value j low and
                     value 8 + j high               x = (ue4m3(s) / 2) MXFP4_VALUES[q]
    Q1_0   (128, 18): d:f16, a bit a value (LSB first)             x = d where set, -d where not
    TQ2_0  (256, 66): 2 bits qs[64], d:f16                      x = d*(q-1)
    TQ1_0  (256, 54): 5 trits a byte qs[48], 4 trits a byte qh[4], d:f16    x = d*(t-1)

In the 32-value blocks (IQ4_XS's too, 16 bytes each) the low nibbles are values 0-15 and the
high nibbles 16-31; Q4_K and Q5_K pack each 64 values of a super-block as 32 bytes, low nibbles
first; Q2_K and Q3_K each 128 as 32 bytes of 2-bit fields, value 32 j + l in bits 2j of byte l.
"""

from __future__ import annotations

import torch

from ..errors import CheckpointError
from ..weights.gguf_blocks import (
    TYPES,
    crumb_values,
    iq4_xs_scales,
    k_scales,
    q3_k_high,
    q3_k_scales,
)
from ..weights.grids import (
    CODEBOOK,
    IQ4_VALUES,
    MXFP4_VALUES,
    codebook_values,
    tq1_0_values,
    ue4m3_half,
    unpack_bits,
)
from .reader import GGUFHeader

# every block type's bytes a block: gguf_blocks.TYPES's, the one table of them
BLOCK_BYTES = {name: size for name, (_, _, size) in TYPES.items()}
SUPPORTED = ("F32", "F16", "BF16", *BLOCK_BYTES)


def dequantize(raw: torch.Tensor, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes (uint8, any shape) of a tensor of GGML type `type_name` -> fp32 of `shape`."""
    raw = raw.reshape(-1)
    if type_name == "F32":
        out = raw.view(torch.float32)
    elif type_name == "F16":
        out = raw.view(torch.float16).float()
    elif type_name == "BF16":
        out = raw.view(torch.bfloat16).float()
    else:
        blocks = raw.view(-1, BLOCK_BYTES[type_name])  # (n_blocks, bytes per block)
        out = _BLOCK_FNS[type_name](blocks)
    return out.reshape(shape)


def raw_to_float(header: GGUFHeader, name: str) -> torch.Tensor:
    """One tensor of a GGUF file (by its GGUF name) in fp32, in the file's row order."""
    info = check_supported(header, name)
    return dequantize(torch.from_numpy(header.raw_bytes(name)), info.type_name, info.shape)


def check_supported(header: GGUFHeader, name: str):
    """The tensor's info, or a CheckpointError naming its type when it is not one we read."""
    info = header.tensors[name]
    if info.type_name not in SUPPORTED:
        raise CheckpointError(
            f"{header.path}: tensor {name} has GGML type {info.type_name}; ExpressLane reads "
            f"{', '.join(SUPPORTED)}"
        )
    return info


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of every block, as (n, 1) fp32."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 2k) values: the k low nibbles, then the k high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits32(b: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) bits 0..31, as 0 or 16."""
    word = b.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24  # (n,)
    return ((word[:, None] >> torch.arange(32)) & 1) << 4


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return (_f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:18]).to(torch.int16) - 8
    return (_f16(b, 0) * q.float()).reshape(-1)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:20]).float()
    return (_f16(b, 0) * q + _f16(b, 2)).reshape(-1)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(b[:, 6:22]).to(torch.int64) | _high_bits32(b[:, 2:6])) - 16
    return (_f16(b, 0) * q.float()).reshape(-1)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:24]).to(torch.int64) | _high_bits32(b[:, 4:8])
    return (_f16(b, 0) * q.float() + _f16(b, 2)).reshape(-1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) bytes -> (n, 8, 32): sub-block 2i = low nibbles of bytes 32i.., 2i+1 = high."""
    qs = qs.reshape(-1, 4, 32)
    return torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(-1, 8, 32)  # (n, 4, 2, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = (t.float() for t in k_scales(b[:, 4:16]))
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn  # (n, 8)
    q = _k_nibbles(b[:, 16:144]).float()
    return (d[..., None] * q - dmin[..., None]).reshape(-1)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    sc, mn = (t.float() for t in k_scales(b[:, 4:16]))
    d, dmin = _f16(b, 0) * sc, _f16(b, 2) * mn  # (n, 8)
    qh = b[:, 16:48].to(torch.int32)  # (n, 32): bit k of byte l is value l of sub-block k
    high = ((qh[:, None, :] >> torch.arange(8, dtype=torch.int32)[None, :, None]) & 1) << 4
    q = (_k_nibbles(b[:, 48:176]).to(torch.int32) + high).float()  # (n, 8, 32)
    return (d[..., None] * q - dmin[..., None]).reshape(-1)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # Two halves of 128 values; in each, value group k (of 32) takes low or high nibbles of
    # ql[0:32] or ql[32:64] (k = 0..3: lo/first, lo/second, hi/first, hi/second) and bits
    # 2k, 2k+1 of qh[0:32]; each 16 values share one int8 scale.
    ql = b[:, 0:128].reshape(-1, 2, 2, 32).to(torch.int32)  # (n, half, first/second, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32).to(torch.int32)  # (n, half, 1, 32)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # (n, 2, 4, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.int32)[None, None, :, None]
    q = (low | (((qh >> shifts) & 3) << 4)) - 32  # (n, 2, 4, 32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 4, 2, 1)
    d = _f16(b, 208).reshape(-1, 1, 1, 1, 1) * scales  # (n, 2, 4, 2, 1)
    return (d * q.reshape(-1, 2, 4, 2, 16).float()).reshape(-1)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    sc = b[:, 0:16].to(torch.int32)  # (n, 16): scale low, min high, per 16 values
    dl = (_f16(b, 80) * (sc & 0x0F).float()).unsqueeze(-1)  # (n, 16, 1)
    ml = (_f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = crumb_values(b[:, 16:80]).reshape(-1, 16, 16).float()
    return (dl * q - ml).reshape(-1)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    dl = (_f16(b, 108) * q3_k_scales(b[:, 96:108]).float()).unsqueeze(-1)  # (n, 16, 1)
    h = q3_k_high(b[:, 0:32]).to(torch.int32)
    q = crumb_values(b[:, 32:96]).to(torch.int32) - ((h ^ 1) << 2)  # the offset 4 where unset
    return (dl * q.reshape(-1, 16, 16).float()).reshape(-1)


def _iq4(q: torch.Tensor) -> torch.Tensor:
    """Indices 0..15 -> IQ4_VALUES, fp32."""
    return torch.tensor(IQ4_VALUES, dtype=torch.float32)[q.long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return (_f16(b, 0) * _iq4(_nibbles(b[:, 2:18]))).reshape(-1)


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    dl = (_f16(b, 0) * iq4_xs_scales(b[:, 2:8]).float()).unsqueeze(-1)  # (n, 8, 1)
    q = _nibbles(b[:, 8:136].reshape(-1, 16)).reshape(-1, 8, 32)  # 32 values per 16 bytes
    return (dl * _iq4(q)).reshape(-1)


def _codebook(name: str):
    """gguf-py's d (0.5 + s) f' g sign, or IQ1's d (2 s + 1) (g + delta): each step exact in
    fp32 (11 + 5 + 6 bits at most), so (d (2 s + 1) f) v gives its bits."""
    _, f, per = CODEBOOK[name]

    def dequantize(b: torch.Tensor) -> torch.Tensor:
        v, s, d = codebook_values(name, b)
        ds = (d.float().unsqueeze(-1) * s.float() * f).unsqueeze(-1)  # (n, 256 / per, 1)
        return (ds * v.float().reshape(len(b), -1, per)).reshape(-1)

    return dequantize


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    e = b[:, :1].to(torch.int32)  # ggml_e8m0_to_fp32_half: 2^(e - 128), from bits
    d = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)  # (n, 1)
    grid = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    return (d * grid[_nibbles(b[:, 1:17]).long()]).reshape(-1)


def _nvfp4(b: torch.Tensor) -> torch.Tensor:
    d = ue4m3_half(b[:, :4]).unsqueeze(-1)  # (n, 4, 1)
    qs = b[:, 4:36].reshape(-1, 4, 8)  # (n, sub-block, 8)
    grid = torch.tensor(MXFP4_VALUES, dtype=torch.float32)
    return (d * grid[_nibbles(qs).long()]).reshape(-1)


def _q1_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)  # (n, 1)
    return torch.where(unpack_bits(b[:, 2:18]).bool(), d, -d).reshape(-1)


def _tq2_0(b: torch.Tensor) -> torch.Tensor:
    return (_f16(b, 64) * (crumb_values(b[:, :64]).float() - 1)).reshape(-1)  # Q2_K's order


def _tq1_0(b: torch.Tensor) -> torch.Tensor:
    return (_f16(b, 52) * (tq1_0_values(b).float() - 1)).reshape(-1)


_BLOCK_FNS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
              "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
              "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "TQ2_0": _tq2_0, "TQ1_0": _tq1_0,
              "MXFP4": _mxfp4, "NVFP4": _nvfp4, "Q1_0": _q1_0}  # fmt: skip
_BLOCK_FNS |= {name: _codebook(name) for name in CODEBOOK}
