"""GGUF's codebook ("IQ") and ternary types unpacked to plain values: what weights/blocks.py
re-lays for the kernels and gguf/quants.py dequantizes, with the value grids they land on (and
those of the 4-bit grid types IQ4_NL / IQ4_XS, MXFP4 and NVFP4, whose nibbles are kept as stored,
with NVFP4's UE4M3 scales).

A block of 256 values has an f16 d and a scale s per 32 or per 16 values; each value is
d (2 s + 1) f v, v a signed integer of a small set (CODEBOOK) and f a power of two:

    type     bytes  grid indices (each for 4 or 8 magnitudes g)   signs          s per  v      f
    IQ3_S     110   9 bits, 512 x 4, g odd 1..15                  a bit a value  32     g      1
    IQ3_XXS    98   8 bits, 256 x 4, g in 4, 12, ... 52, 62       7 bits per 8   32     g      1/4
    IQ2_XXS    66   8 bits, 256 x 8, g in 8, 25, 43               7 bits per 8   32     g      1/8
    IQ2_XS     74   9 bits, 512 x 8                               7 bits per 8   16     g      1/8
    IQ2_S      82   10 bits, 1024 x 8                             a bit a value  16     g      1/8
    IQ1_S      50   11 bits, 2048 x 8, g in -1, 0, 1              none           32     8g+-1  1/8
    IQ1_M      56   as IQ1_S (d spread over the scales' top bits) none           16     8g+-1  1/8

(ggml writes 0.5 + s and folds the 2 into f; IQ1's +-1 is ggml's delta of +-1/8, whose sign is a
bit per 32 values (IQ1_S) or per 8 (IQ1_M).) The 7 sign
bits of 8 values come with an 8th that makes their count even (ggml's ksigns).

Every type's values then take 16 values or fewer, so blocks.py keeps them as nibbles indexing
their grid, as IQ4's: 138 bytes per 256 values (4.31 bits a value). That is more than the files
(1.56-3.44 bits) and less than Q8_0's 8.5; the values stay the file's, bit for bit. Reading
the indices as stored instead was built for IQ2_XXS and measured (commit a458bf2, reverted):
its grid rows gathered by index (two 8-entry gathers per 128 values) and signed by masks, 2.31
bits a value, its products took 1.5x the nibbles' time at one token and 1.3x at 40
(`cpu_products --layer 3` on its file, one thread), where nibbles cost one load and two masks.
Speed is this engine's product, so the nibbles stay; memory is what they cost. TQ2_0 and TQ1_0
(-1, 0, 1 times d) go to Q2_K's layout: 84 bytes per 256 values against 66 and 54. BENCHMARKS.md
has their speed against llama.cpp's on the same files.

The codebooks are gguf-py's (imported when a file of these types loads; reading a GGUF file needs
gguf-py anyway).
"""

from __future__ import annotations

import functools

import torch

# ggml-common.h's kvalues_iq4nl
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's e2m1 values, doubled (ggml's kvalues_mxfp4): its nibbles (and NVFP4's) index them
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# the values v of each codebook type (a nibble indexes them; unused entries 0)
ODD = tuple(range(-15, 16, 2))  # IQ3_S: sign g, odd
IQ3_XXS_V = (-62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62)
IQ2_V = (-43, -25, -8, 8, 25, 43, *(0,) * 10)
IQ1_V = (-9, -7, -1, 1, 7, 9, *(0,) * 10)
# GGUF type -> (its grid, f, values per scale)
CODEBOOK = {"IQ3_S": (ODD, 1.0, 32), "IQ3_XXS": (IQ3_XXS_V, 0.25, 32),
            "IQ2_XXS": (IQ2_V, 0.125, 32), "IQ2_XS": (IQ2_V, 0.125, 16),
            "IQ2_S": (IQ2_V, 0.125, 16), "IQ1_S": (IQ1_V, 0.125, 32),
            "IQ1_M": (IQ1_V, 0.125, 16)}  # fmt: skip


@functools.cache
def _grid(name: str) -> torch.Tensor:
    """gguf-py's codebook of type `name`: (entries, 4 or 8) int16 magnitudes (IQ1: -1, 0, 1)."""
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(cls.grid.reshape(cls.grid_shape)).to(torch.int16)


@functools.cache
def _ksigns() -> torch.Tensor:
    from gguf import quants

    return torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)


def unpack_bits(b: torch.Tensor) -> torch.Tensor:
    """bytes (..., m) -> (..., 8 m) bits, LSB first."""
    return (b.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1).flatten(-2)


def ue4m3_half(s: torch.Tensor) -> torch.Tensor:
    """NVFP4's scale bytes (...) -> fp32 half their unsigned E4M3 value (ggml's ue4m3_to_fp32,
    halved for MXFP4_VALUES' doubling): with e bits 3-6 and m bits 0-2, m 2^-10 where e is 0,
    (8 + m) 2^(e - 11) else, and 0 for 0x7F (E4M3's NaN); bit 7 is not read, as in ggml. Every
    value (2^-10 .. 240, 4 significant bits) is exact in fp32 and in f16."""
    s = s.to(torch.int32)
    e, m = s >> 3 & 15, s & 7
    v = torch.where(e == 0, m, 8 + m).float() * torch.exp2((e.clamp(min=1) - 11).float())
    return torch.where(s == 0x7F, 0.0, v)


def _u(b: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned words of `width` bytes: (..., m width) -> (..., m) int64."""
    w = b.to(torch.int64).unflatten(-1, (-1, width))
    return (w << (8 * torch.arange(width))).sum(-1)


def _look(name: str, index: torch.Tensor) -> torch.Tensor:
    """Grid rows of `index` (..., n) -> (..., n * per) magnitudes."""
    return _grid(name)[index].flatten(-2)


def _signed(g: torch.Tensor, sign_bits: torch.Tensor) -> torch.Tensor:
    return torch.where(sign_bits.bool(), -g, g)


def _ksign_bits(index7: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (..., n) -> (..., 8 n) sign bits."""
    return unpack_bits(_ksigns()[index7])


def nibble_pairs(b: torch.Tensor) -> torch.Tensor:
    """(..., m) bytes of two 4-bit fields (low first) -> (..., 2 m) int32."""
    s = b.to(torch.int32)
    return torch.stack((s & 0x0F, s >> 4), -1).flatten(-2)


def codebook_values(name: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks (..., bytes) of codebook type `name` -> (v (..., 256) int16, 2 s + 1 (..., 8 or
    16) int32, d (...) f16), the value of each being d (2 s + 1) f v (CODEBOOK's f)."""
    return _DECODERS[name](b)


def f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) bytes -> (...) f16."""
    return b.contiguous().view(torch.float16)[..., 0].contiguous()


def _iq3_s(b):  # d, qs[64], qh[8], signs[32], scales[4]
    index = b[..., 2:66].to(torch.int64) | unpack_bits(b[..., 66:74]).to(torch.int64) << 8
    v = _signed(_look("IQ3_S", index), unpack_bits(b[..., 74:106]))
    return v, 2 * nibble_pairs(b[..., 106:110]) + 1, f16(b[..., :2])


def _iq3_xxs(b):  # d, qs[64], then per 32 values a u32: four 7-bit sign indices, scale on top
    aux = _u(b[..., 66:98], 4)  # (..., 8)
    signs = _ksign_bits((aux.unsqueeze(-1) >> torch.arange(0, 28, 7) & 127).flatten(-2))
    v = _signed(_look("IQ3_XXS", b[..., 2:66].to(torch.int64)), signs)
    return v, (2 * (aux >> 28) + 1).to(torch.int32), f16(b[..., :2])


def _iq2_xxs(b):  # d, then per 32 values 4 grid indices (bytes) and a u32 as IQ3_XXS's
    q = b[..., 2:66].unflatten(-1, (8, 8))  # (..., 8, 8)
    aux = _u(q[..., 4:].flatten(-2), 4)  # (..., 8)
    signs = _ksign_bits((aux.unsqueeze(-1) >> torch.arange(0, 28, 7) & 127).flatten(-2))
    v = _signed(_look("IQ2_XXS", q[..., :4].flatten(-2).to(torch.int64)), signs)
    return v, (2 * (aux >> 28) + 1).to(torch.int32), f16(b[..., :2])


def _iq2_xs(b):  # d, u16[32]: a 9-bit index and a 7-bit sign index, scales[8]
    qs = _u(b[..., 2:66], 2)  # (..., 32)
    v = _signed(_look("IQ2_XS", qs & 511), _ksign_bits(qs >> 9))
    return v, 2 * nibble_pairs(b[..., 66:74]) + 1, f16(b[..., :2])


def _iq2_s(b):  # d, qs[32], signs[32], qh[8] (2 high bits per index), scales[8]
    high = (b[..., 66:74].to(torch.int64).unsqueeze(-1) >> torch.arange(0, 8, 2) & 3).flatten(-2)
    index = b[..., 2:34].to(torch.int64) | high << 8
    v = _signed(_look("IQ2_S", index), unpack_bits(b[..., 34:66]))
    return v, 2 * nibble_pairs(b[..., 74:82]) + 1, f16(b[..., :2])


def _iq1(g: torch.Tensor, minus: torch.Tensor) -> torch.Tensor:
    """8 g + 1, or - 1 where ggml's delta is negative: (..., n 8) and (..., n)."""
    per = g.shape[-1] // minus.shape[-1]
    return 8 * g + 1 - 2 * minus.repeat_interleave(per, -1).to(torch.int16)


def _iq1_s(b):  # d, qs[32], qh u16[8]: 4 x 3 high index bits, a 3-bit scale, the delta's sign
    qh = _u(b[..., 34:50], 2)  # (..., 8)
    high = (qh.unsqueeze(-1) >> torch.arange(0, 12, 3) & 7).flatten(-2)  # (..., 32)
    g = _look("IQ1_S", b[..., 2:34].to(torch.int64) | high << 8)
    return _iq1(g, qh >> 15), (2 * (qh >> 12 & 7) + 1).to(torch.int32), f16(b[..., :2])


def _iq1_m(b):  # qs[32], qh[16] (per index a nibble: 3 high bits, the delta's sign), scales u16[4]
    sc = _u(b[..., 48:56], 2)  # (..., 4): four 3-bit scales, and 4 bits of d on top
    d = (sc >> 12 << torch.arange(0, 16, 4)).sum(-1).to(torch.int16).view(torch.float16)
    nib = nibble_pairs(b[..., 32:48]).to(torch.int64)  # (..., 32)
    g = _look("IQ1_M", b[..., :32].to(torch.int64) | (nib & 7) << 8)
    s = (sc.unsqueeze(-1) >> torch.arange(0, 12, 3) & 7).flatten(-2)  # (..., 16)
    return _iq1(g, nib >> 3), (2 * s + 1).to(torch.int32), d


_DECODERS = {"IQ3_S": _iq3_s, "IQ3_XXS": _iq3_xxs, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs,
             "IQ2_S": _iq2_s, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m}  # fmt: skip


_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32)


def _trits(q: torch.Tensor, n: int) -> torch.Tensor:
    """bytes (..., m) holding n trits each (fixed point, ggml's) -> (..., n m), trit i of byte j
    at i m + j: the top of (q 3^i mod 256) times 3."""
    t = (q.to(torch.int32).unsqueeze(-2) * _POW3[:n, None]) & 0xFF  # (..., n, m)
    return ((t * 3) >> 8).flatten(-2)


def tq1_0_values(b: torch.Tensor) -> torch.Tensor:
    """TQ1_0 blocks (..., 54) -> (..., 256) trits 0..2: 160 from qs[0:32], 80 from qs[32:48], 16
    from qh (ggml's order)."""
    parts = (_trits(b[..., :32], 5), _trits(b[..., 32:48], 5), _trits(b[..., 48:52], 4))
    return torch.cat(parts, -1).to(torch.uint8)
