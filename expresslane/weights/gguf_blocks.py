"""GGUF's block types re-laid at load into the formats of weights/blocks.py, the bytes a
GGUF file stores in, the fields of a QTensor out (`gguf_fields`), every value kept bit for bit.

Most types only move their bits: fields made planar, nibbles into blocks.py's order, the K-quants'
packed scales unpacked. Some become a format of another type: the codebook types the nibbles of
their values (weights/grids.py), TQ2_0 and TQ1_0 Q2_K's crumbs. NVFP4 keeps its bytes: its
16-value halves are the order with swapped quarters that blocks.py's formats with a scale per 16
take. Q1_0 keeps its bits, as the masks the group loader reads for Q5's fifth bit.
"""

from __future__ import annotations

import torch

from .blocks import (
    CRUMB,
    GRID,
    HALF16,
    QK,
    pack_crumbs,
    pack_high,
    pack_masks,
    pack_nibbles,
    swap_quarters,
)
from .grids import (
    CODEBOOK,
    codebook_values,
    f16,
    nibble_pairs,
    tq1_0_values,
    ue4m3_half,
    unpack_bits,
)

# GGUF type -> (our format, values a block, bytes a block)
TYPES = {
    "Q8_0": ("q8_0", 32, 34), "Q4_0": ("q4_0", 32, 18), "Q4_1": ("q4_1", 32, 20),
    "Q5_0": ("q5_0", 32, 22), "Q5_1": ("q5_1", 32, 24), "Q4_K": ("q4_k", QK, 144),
    "Q5_K": ("q5_k", QK, 176), "Q6_K": ("q6_k", QK, 210), "Q3_K": ("q3_k", QK, 110),
    "Q2_K": ("q2_k", QK, 84), "IQ4_NL": ("iq4_nl", 32, 18), "IQ4_XS": ("iq4_xs", QK, 136),
    "MXFP4": ("mxfp4", 32, 17),
    "IQ3_S": ("iq3_s", QK, 110), "IQ3_XXS": ("iq3_xxs", QK, 98), "IQ2_XXS": ("iq2_xxs", QK, 66),
    "IQ2_XS": ("iq2_xs", QK, 74), "IQ2_S": ("iq2_s", QK, 82), "IQ1_S": ("iq1_s", QK, 50),
    "IQ1_M": ("iq1_m", QK, 56), "TQ2_0": ("q2_k", QK, 66), "TQ1_0": ("q2_k", QK, 54),
    "NVFP4": ("nvfp4", 64, 36), "Q1_0": ("q1_0", 128, 18),
}  # fmt: skip


def k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (..., 12) -> (scales, mins), each (..., 8)
    in s's dtype (ggml's get_scale_min_k4): entries 0-3 the low 6 bits of bytes 0-3 / 4-7,
    entries 4-7 4 bits from bytes 8-11 and their top 2 from the top of bytes 0-3 / 4-7."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), -1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), -1)
    return sc, mn


# GGUF's packed fields of the 2- and 3-bit and IQ4_XS blocks, unpacked in the matrix's order (also
# gguf/quants.py's dequantizers' way in)
def crumb_values(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K's qs (..., 64) bytes -> (..., 256) values 0..3: value 128 h + 32 j + l is
    bits 2j, 2j + 1 of byte 32 h + l."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts & 3  # (..., half, j, 32)
    return q.flatten(-3)


def q3_k_high(hmask: torch.Tensor) -> torch.Tensor:
    """Q3_K's hmask (..., 32) bytes -> (..., 256) bits: value 32 i + l is bit i of byte l."""
    return (hmask.unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8)[:, None] & 1).flatten(-2)


def q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 bytes of 6-bit scales (..., 12) -> (..., 16) int32, each minus 32: scale i
    takes 4 bits from byte i % 8 (low nibble for i < 8) and 2 from byte 8 + i % 4, bits 2 (i /
    4) on."""
    s = s.to(torch.int32)
    lo = torch.cat((s[..., 0:8] & 0x0F, s[..., 0:8] >> 4), -1)  # (..., 16)
    hi = (s[..., None, 8:12] >> torch.arange(0, 8, 2, dtype=torch.int32)[:, None]) & 3
    return (lo | hi.flatten(-2) << 4) - 32  # (..., 4, 4) -> scale 4 i + j


def iq4_xs_scales(s: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's bytes 2-7 of a block (..., 6): the u16 of high bits, then 4 bytes of low nibbles
    -> (..., 8) int32 6-bit scales, each minus 32."""
    s = s.to(torch.int32)
    low = nibble_pairs(s[..., 2:6])  # (..., 8)
    word = (s[..., :1] | s[..., 1:2] << 8) >> torch.arange(0, 16, 2, dtype=torch.int32)
    return (low | (word & 3) << 4) - 32


def _iq4_fields(fmt: str, b: torch.Tensor, N: int, K: int) -> dict:
    """IQ4_NL / IQ4_XS blocks (N, K/bv, bytes): their nibbles are in our order already."""
    at = 2 if fmt == "iq4_nl" else 8
    f = dict(data=b[..., at:].reshape(N, K // 2).contiguous(), scale=f16(b[..., :2]))
    if fmt == "iq4_xs":
        f["sub"] = iq4_xs_scales(b[..., 2:8]).to(torch.int8).reshape(N, -1).view(torch.uint8)
    return f


# MXFP4's scale byte e stands for 2^(e - 128) (ggml's e8m0_to_fp32_half from e = 2 on); an f16
# holds it exactly for e in 104..143, which covers weights' blocks (a block of largest |w| in
# 2^-20..2^17). A matrix with another e keeps floats (None): no format here holds its scales.
MXFP4_E = (104, 143)


def _mxfp4_fields(b: torch.Tensor, N: int, K: int) -> tuple[str, dict] | None:
    """MXFP4 blocks (N, K/32, 17): e, then 16 bytes of nibbles (our order already)."""
    e = b[..., 0].to(torch.int32)
    if bool(((e < MXFP4_E[0]) | (e > MXFP4_E[1])).any()):
        return None
    scale = torch.ldexp(torch.ones(e.shape), e - 128).half()  # (N, K/32) exact
    return "mxfp4", dict(data=b[..., 1:].reshape(N, K // 2).contiguous(), scale=scale)


def _nvfp4_fields(b: torch.Tensor, N: int, K: int) -> dict:
    """NVFP4 blocks (N, K/64, 36): 4 UE4M3 scales, then per 16 values 8 bytes holding values j
    and 8 + j: the nibble order with swapped quarters already. The scales, halved, are f16s."""
    scale = ue4m3_half(b[..., :4]).half().reshape(N, K // 16)  # exact
    return dict(data=b[..., 4:].reshape(N, K // 2).contiguous(), scale=scale)


def _binary_fields(b: torch.Tensor, N: int, K: int) -> dict:
    """Q1_0 blocks (N, K/128, 18): d, then a bit a value -> q1_0, the bits as masks."""
    return dict(data=pack_masks(unpack_bits(b[..., 2:]).reshape(N, K)), scale=f16(b[..., :2]))


def _codebook_fields(ggml_type: str, fmt: str, b: torch.Tensor, N: int, K: int) -> dict:
    """A codebook type's blocks (N, K/256, bytes) -> the nibbles of its values' places in GRID."""
    v, s, d = codebook_values(ggml_type, b)
    place = torch.zeros(256, dtype=torch.uint8)  # v + 128 -> its nibble
    for i, value in reversed(list(enumerate(GRID[fmt]))):  # the first of equal (0) entries
        place[value + 128] = i
    q = place[(v + 128).long()].reshape(N, K)
    q = swap_quarters(q) if fmt in HALF16 else q
    sub = s.to(torch.int8).reshape(N, -1).view(torch.uint8)
    return dict(data=pack_nibbles(q), scale=d.reshape(N, -1).contiguous(), sub=sub)


def _ternary_fields(ggml_type: str, b: torch.Tensor, N: int, K: int) -> dict:
    """TQ2_0 / TQ1_0 blocks (N, K/256, bytes) -> q2_k with d = dmin and a scale and min of 1."""
    q = (crumb_values(b[..., :64]) if ggml_type == "TQ2_0" else tq1_0_values(b)).reshape(N, K)
    d = f16(b[..., -2:])
    sub = torch.full((N, K // 16), 0x11, dtype=torch.uint8)
    return dict(data=pack_crumbs(swap_quarters(q)), scale=d, mins=d.clone(), sub=sub)


def _crumb_fields(fmt: str, b: torch.Tensor, N: int, K: int) -> dict:
    """Q2_K / Q3_K blocks (N, K/256, bytes): values re-laid, scales unpacked (Q3_K) or kept."""
    at = 16 if fmt == "q2_k" else 32  # qs: 64 bytes
    q = crumb_values(b[..., at : at + 64]).reshape(N, K)
    f = dict(scale=f16(b[..., 80:82] if fmt == "q2_k" else b[..., 108:110]))
    if fmt == "q2_k":
        f.update(mins=f16(b[..., 82:84]), sub=b[..., :16].reshape(N, -1).contiguous())
    else:
        q = q | q3_k_high(b[..., :32]).reshape(N, K) << 2
        sc = q3_k_scales(b[..., 96:108])
        f["sub"] = sc.to(torch.int8).reshape(N, -1).view(torch.uint8)
    q = swap_quarters(q)
    return dict(f, data=pack_crumbs(q & 3), high=pack_high(q, fmt))


def gguf_fields(ggml_type: str, data: torch.Tensor, N: int, K: int) -> tuple[str, dict] | None:
    """A GGUF block type's bytes (N rows) as (format, fields of a QTensor), or None."""
    if ggml_type not in TYPES:
        return None
    fmt, bv, bb = TYPES[ggml_type]
    b = data.reshape(N, K // bv, bb)
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).reshape(N, K)
        return fmt, dict(data=q, scale=f16(b[..., :2]))
    if fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):
        at = 4 if fmt.endswith("_1") else 2
        f = dict(scale=f16(b[..., :2]), mins=f16(b[..., 2:4]) if at == 4 else None)
        nib = b[..., -16:].reshape(N, K // 2).contiguous()  # already in our order
        if fmt.startswith("q4"):
            return fmt, dict(f, data=nib)
        qh = b[..., at : at + 4].contiguous().view(torch.int32)  # (N, K/32, 1) bit j: value j
        bit = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # (N, K/32, 32)
        return fmt, dict(f, data=nib, high=pack_masks(bit.reshape(N, K).to(torch.uint8)))
    if ggml_type == "MXFP4":
        return _mxfp4_fields(b, N, K)
    if ggml_type == "NVFP4":
        return fmt, _nvfp4_fields(b, N, K)
    if ggml_type == "Q1_0":
        return fmt, _binary_fields(b, N, K)
    if ggml_type in CODEBOOK:
        return fmt, _codebook_fields(ggml_type, fmt, b, N, K)
    if ggml_type.startswith("TQ"):
        return fmt, _ternary_fields(ggml_type, b, N, K)
    if fmt in ("iq4_nl", "iq4_xs"):
        return fmt, _iq4_fields(fmt, b, N, K)
    if fmt in CRUMB:
        return fmt, _crumb_fields(fmt, b, N, K)
    if fmt == "q6_k":
        ql = (
            b[..., :128].reshape(N, -1, 2, 1, 64)
            >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]
        )  # (N, K/256, half, shift, 64): value 128 half + 64 shift + i
        qh = (
            b[..., 128:192].reshape(N, -1, 2, 1, 32)
            >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        )  # (N, K/256, half, 4, 32): value 128 half + 32 j + i
        q = swap_quarters((ql & 0x0F).reshape(N, K) | ((qh & 0x03).reshape(N, K) << 4))
        sub = b[..., 192:208].reshape(N, -1).contiguous()  # int8 scales, as bytes
        return fmt, dict(data=pack_nibbles(q), high=pack_high(q, fmt), scale=f16(b[..., 208:]),
                         sub=sub)  # fmt: skip
    # q4_k, q5_k: d, dmin, 12 bytes of scales, (q5_k: 32 bytes of high bits,) 128 of nibbles
    qs = b[..., -128:].reshape(N, -1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]
    q = (qs & 0x0F).reshape(N, K)  # (N, K/256, pair, nibble, 32): value 64 pair + 32 nibble + i
    if fmt == "q5_k":
        qh = b[..., 16:48].reshape(N, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None]
        q = q | ((qh & 1).reshape(N, K) << 4)  # (N, K/256, 8, 32): bit c of byte i, value 32c+i
    sub = torch.cat(k_scales(b[..., 4:16]), -1).reshape(N, -1).contiguous()  # 8 s, then 8 m
    return fmt, dict(data=pack_nibbles(q), high=pack_high(q, fmt), scale=f16(b[..., 0:2]),
                     mins=f16(b[..., 2:4]), sub=sub)  # fmt: skip
