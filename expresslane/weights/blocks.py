"""GGUF's quantized blocks as the CPU kernels read them, and the values they stand for.

Each GGUF type keeps its own bits: `gguf_fields` only re-lays them at load (planar fields, 64-byte
groups for wide loads; csrc/cpu_nibble.c reads them), and `dequantize` is the fp32 reference, with
gguf-py's order of operations, so the two agree bit for bit (tests/test_gguf_blocks.py).

    q8_0   data (N, K) int8, scale (N, K/32) f16                     w = d q
    q4_0   data (N, K/2) nibbles, scale f16 per 32                   w = d (q - 8)
    q4_1   ... and mins f16 per 32                                   w = d q + m
    q5_0   nibbles, high (N, K/8) bit masks, scale f16 per 32        w = d (q - 16)
    q5_1   ... and mins f16 per 32                                   w = d q + m
    q4_k   nibbles, scale d and mins dmin f16 per 256, sub (N, K/16) uint8: per 256 eight
           6-bit scales s then eight mins m, one per 32 values       w = (d s) q - (dmin m)
    q5_k   as q4_k, and high (N, K/8)
    q6_k   nibbles, high (N, K/4) (two bits), scale d f16 per 256, sub (N, K/16) int8: a scale
           per 16 values                                             w = (d s) (q - 32)
    q3_k   crumbs, high (N, K/8), scale d f16 per 256, sub (N, K/16) int8 (GGUF's 6-bit scale
           minus 32) per 16 values                                   w = (d s) (q - 4)
    q2_k   crumbs, scale d and mins dmin f16 per 256, sub (N, K/16) uint8 as stored: per 16
           values a scale s (low 4 bits) and a min m (high 4)        w = (d s) q - (dmin m)
    iq4_nl nibbles (indices into IQ4_VALUES), scale f16 per 32       w = d IQ4_VALUES[q]
    iq4_xs nibbles, scale d f16 per 256, sub (N, K/32) int8 (6-bit scale minus 32) per 32
                                                                     w = (d s) IQ4_VALUES[q]
    iq3_s iq3_xxs iq2_xxs iq1_s   the codebook types of weights/grids.py with a scale per 32: as
           iq4_xs on their own grid, sub 2 s + 1, and a power of two f   w = (d s f) GRID[q]
    iq2_xs iq2_s iq1_m   ... with a scale per 16: sub (N, K/16) int8, quarters swapped as q6_k's

The codebook types' indices stand for 4 or 8 values each; they are re-laid as the nibbles of
their values (weights/grids.py says why), and TQ2_0 and TQ1_0 (ternary), which have no format of
their own here, as q2_k (d = dmin = the file's d, every scale and min 1, so w = d q - d). Both
keep the values bit for bit, in more bytes than the file.

Nibbles: in each block of 32 values, byte j holds value j in its low nibble and value j + 16 in
its high one (GGUF's Q4_0 / Q4_1 order; the K-quants are re-laid to it). Q6_K's block is stored
with its middle quarters swapped (values 0-7, 16-23, 8-15, 24-31: `swap_quarters`), so that a
byte's two nibbles share one of its two 16-value scales: the kernels then add them before
scaling, as for the other formats, rather than scale each apart. High bits: per group of
four blocks (n <= 4 in the last), the mask of the values in the low nibbles (2n bytes: block b's
value j is bit 16 b + j), then of those in the high nibbles (value 16 + j); Q6_K has bit 4's two
masks, then bit 5's.

Crumbs (q2_k, q3_k: values of 2 low bits): per group of four 32-value blocks, 32 bytes; with lo
the group's values 0-15 of each block (64, block by block) and hi its values 16-31, byte i holds
lo[i], lo[32 + i], hi[i], hi[32 + i] in bits 0-1, 2-3, 4-5, 6-7: one 32-byte load broadcast to
both halves of a register and shifted gives the nibble formats' two vectors (csrc/cpu_nibble.c).
Their 16-value scales take Q6_K's swapped quarters too; q3_k's third bit is a mask like q5's.
The grid formats' nibbles are indices into a grid of 16 values (IQ4_VALUES, -127..113, or
a codebook type's), which the kernels look up as the grid + 128 (unsigned) and offset by -128.
"""

from __future__ import annotations

import torch

from .grids import (
    CODEBOOK,
    IQ4_VALUES,
    MXFP4_VALUES,
    codebook_values,
    f16,
    nibble_pairs,
    tq1_0_values,
    unpack_bits,
)

QK = 256  # values of a K-quant superblock
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
}  # fmt: skip
CODEBOOKS = tuple(TYPES[t][0] for t in CODEBOOK)  # iq3_s ... iq1_m
# the formats of csrc/cpu_nibble.c's kernels (nibbles, or crumbs, in `data`)
NIBBLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_nl",
          "iq4_xs", "mxfp4", *CODEBOOKS)  # fmt: skip
K_QUANTS = ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs", *CODEBOOKS)  # superblocks of 256
CRUMB = ("q3_k", "q2_k")  # 2 low bits a value in `data`
GRID16 = tuple(TYPES[t][0] for t, (_, _, per) in CODEBOOK.items() if per == 16)
HALF16 = ("q6_k", "q3_k", "q2_k", *GRID16)  # a scale per 16 values: quarters swapped
# nibble -> value, and the power of two the scales take
GRID = {"iq4_nl": IQ4_VALUES, "iq4_xs": IQ4_VALUES, "mxfp4": MXFP4_VALUES}
GRID |= {TYPES[t][0]: v for t, (v, _, _) in CODEBOOK.items()}
FACTOR = {TYPES[t][0]: f for t, (_, f, _) in CODEBOOK.items()}
XS = ("iq4_xs", *(f for f in CODEBOOKS if f not in GRID16))  # a d per 256, an int8 scale per 32
BITS = {"q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q4_k": 4, "q5_k": 5, "q6_k": 6, "q3_k": 3,
        "q2_k": 2, "iq4_nl": 4, "iq4_xs": 4, "mxfp4": 4} | dict.fromkeys(CODEBOOKS, 4)  # fmt: skip


def block_values(fmt: str) -> int:
    """K must be a multiple of this for `fmt`."""
    return QK if fmt in K_QUANTS else 32


def values_per_byte(fmt: str) -> int:
    """Values a byte of `data` holds."""
    return 4 if fmt in CRUMB else 2 if fmt in NIBBLE else 1


# --- nibbles and bit masks ----------------------------------------------------------------------
def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q (..., K) values -> (..., K/2) uint8: their low 4 bits, two a byte (block order)."""
    b = (q & 0x0F).reshape(*q.shape[:-1], -1, 32)  # (..., K/32, 32)
    return (b[..., :16] | (b[..., 16:] << 4)).reshape(*q.shape[:-1], -1)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    b = data.reshape(*data.shape[:-1], -1, 16)  # (..., K/32, 16)
    return torch.cat((b & 0x0F, b >> 4), dim=-1).reshape(*data.shape[:-1], -1)


def pack_crumbs(q: torch.Tensor) -> torch.Tensor:
    """q (..., K) values 0..3, K % 128 == 0 -> (..., K/4) uint8 (the module docstring's order)."""
    g = q.to(torch.uint8).reshape(*q.shape[:-1], -1, 4, 32)  # (..., K/128, block, 32)
    lo, hi = g[..., :16].flatten(-2), g[..., 16:].flatten(-2)  # (..., K/128, 64) each
    b = lo[..., :32] | lo[..., 32:] << 2 | hi[..., :32] << 4 | hi[..., 32:] << 6
    return b.flatten(-2)


def unpack_crumbs(data: torch.Tensor) -> torch.Tensor:
    b = data.reshape(*data.shape[:-1], -1, 32)  # (..., K/128, 32)
    lo = torch.cat((b & 3, (b >> 2) & 3), -1).unflatten(-1, (4, 16))  # (..., K/128, block, 16)
    hi = torch.cat(((b >> 4) & 3, b >> 6), -1).unflatten(-1, (4, 16))
    return torch.cat((lo, hi), -1).reshape(*data.shape[:-1], -1)


_POW = 1 << torch.arange(8, dtype=torch.int32)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:  # (..., 8m) 0/1 -> (..., m), LSB first
    b = bits.reshape(*bits.shape[:-1], -1, 8).to(torch.int32)
    return (b * _POW).sum(-1).to(torch.uint8)


def _groups(K: int) -> list[tuple[int, int]]:
    """(first block, blocks) of each group of four blocks of 32."""
    nb = K // 32
    return [(b, min(4, nb - b)) for b in range(0, nb, 4)]


def pack_masks(bit: torch.Tensor) -> torch.Tensor:
    """bit (..., K) 0/1 -> (..., K/8) uint8 masks, per group: low nibbles' mask, high's."""
    b = bit.reshape(*bit.shape[:-1], -1, 32)  # (..., K/32, 32)
    out = []
    for b0, n in _groups(bit.shape[-1]):
        g = b[..., b0 : b0 + n, :]  # (..., n, 32)
        out += [_pack_bits(g[..., :16].flatten(-2)), _pack_bits(g[..., 16:].flatten(-2))]
    return torch.cat(out, dim=-1)


def unpack_masks(masks: torch.Tensor, K: int) -> torch.Tensor:
    """pack_masks' inverse: (..., K/8) -> (..., K) 0/1 (whole groups at once: a per-token
    embedding lookup goes through here)."""
    lead, nb = masks.shape[:-1], K // 32
    G, n = nb // 4, nb % 4
    out = []
    if G:
        bits = unpack_bits(masks[..., : 16 * G].reshape(*lead, G, 2, 8))  # (..., G, 2, 64)
        out.append(bits.reshape(*lead, G, 2, 4, 16).transpose(-3, -2).reshape(*lead, 128 * G))
    if n:
        tail = masks[..., 16 * G :]
        lo = unpack_bits(tail[..., : 2 * n]).reshape(*lead, n, 1, 16)
        hi = unpack_bits(tail[..., 2 * n :]).reshape(*lead, n, 1, 16)
        out.append(torch.cat((lo, hi), dim=-2).reshape(*lead, 32 * n))
    return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


def pack_high(q: torch.Tensor, fmt: str) -> torch.Tensor | None:
    """The bits above the nibble (crumb) of q (..., K) as masks: None, K/8 or K/4 bytes."""
    if BITS[fmt] in (2, 4):
        return None
    if BITS[fmt] == 3:
        return pack_masks((q >> 2) & 1)
    m4 = pack_masks((q >> 4) & 1)
    if BITS[fmt] == 5:
        return m4
    m5 = pack_masks((q >> 5) & 1)  # K % 256 == 0: whole groups of 16 bytes
    lead = q.shape[:-1]
    return torch.cat((m4.reshape(*lead, -1, 16), m5.reshape(*lead, -1, 16)), -1).flatten(-2)


def swap_quarters(q: torch.Tensor) -> torch.Tensor:
    """q (..., K) with the middle two 8-value quarters of each 32-value block swapped (its own
    inverse): Q6_K's stored order."""
    b = q.reshape(*q.shape[:-1], -1, 4, 8)  # (..., K/32, quarter, 8)
    return b[..., [0, 2, 1, 3], :].reshape(q.shape)


def values(fmt: str, data: torch.Tensor, high: torch.Tensor | None) -> torch.Tensor:
    """The unsigned values q (..., K) uint8 of a nibble format, in the matrix's order (the IQ4
    formats: indices into their GRID)."""
    q = unpack_crumbs(data) if fmt in CRUMB else unpack_nibbles(data)
    K = q.shape[-1]
    if BITS[fmt] == 3:
        q = q | (unpack_masks(high, K) << 2)
    elif BITS[fmt] == 5:
        q = q | (unpack_masks(high, K) << 4)
    elif BITS[fmt] == 6:
        h = high.reshape(*high.shape[:-1], -1, 2, 16)  # (..., K/128, bit, 16)
        q = q | (unpack_masks(h[..., 0, :].flatten(-2), K) << 4)
        q = q | (unpack_masks(h[..., 1, :].flatten(-2), K) << 5)
    return swap_quarters(q) if fmt in HALF16 else q


# --- the reference --------------------------------------------------------------------------------
def dequantize(fmt, data, scale, mins=None, high=None, sub=None) -> torch.Tensor:
    """The fp32 matrix (..., N, K) the fields of a GGUF block format stand for."""
    lead = data.shape[:-1]
    if fmt == "q8_0":
        return (data.reshape(*lead, -1, 32).float() * scale.float().unsqueeze(-1)).flatten(-2)
    q = values(fmt, data, high)
    q = _GRIDS[fmt][q.long()] if fmt in GRID else q.float()
    if fmt in ("iq4_nl", "mxfp4"):
        return (scale.float().unsqueeze(-1) * q.reshape(*lead, -1, 32)).reshape(*lead, -1)
    if fmt in K_QUANTS:
        d = scale.float().unsqueeze(-1)  # (..., K/256, 1)
        f = FACTOR.get(fmt, 1.0)  # exact: a power of two
        if fmt in XS:
            ds = (d * sub.view(torch.int8).reshape(*lead, -1, 8).float() * f).unsqueeze(-1)
            return (ds * q.reshape(*lead, -1, 8, 32)).reshape(*lead, -1)  # (..., K/256, 8, 32)
        s = sub.reshape(*lead, -1, 16)
        if fmt in GRID16:
            ds = (d * s.view(torch.int8).float() * f).unsqueeze(-1)  # (..., K/256, 16, 1)
            return (ds * q.reshape(*lead, -1, 16, 16)).reshape(*lead, -1)
        if fmt in ("q6_k", "q3_k"):
            ds = (d * s.view(torch.int8).float()).unsqueeze(-1)  # (..., K/256, 16, 1)
            off = 32.0 if fmt == "q6_k" else 4.0
            return (ds * (q.reshape(*lead, -1, 16, 16) - off)).reshape(*lead, -1)
        if fmt == "q2_k":
            ds = (d * (s & 0x0F).float()).unsqueeze(-1)  # (..., K/256, 16, 1)
            dm = (mins.float().unsqueeze(-1) * (s >> 4).float()).unsqueeze(-1)
            return (ds * q.reshape(*lead, -1, 16, 16) - dm).reshape(*lead, -1)
        ds = (d * s[..., :8].float()).unsqueeze(-1)  # (..., K/256, 8, 1)
        dm = (mins.float().unsqueeze(-1) * s[..., 8:].float()).unsqueeze(-1)
        return (ds * q.reshape(*lead, -1, 8, 32) - dm).reshape(*lead, -1)
    d = scale.float().unsqueeze(-1)  # (..., K/32, 1)
    qb = q.reshape(*lead, -1, 32)
    if fmt in ("q4_0", "q5_0"):
        return (d * (qb - (8.0 if fmt == "q4_0" else 16.0))).reshape(*lead, -1)
    return (d * qb + mins.float().unsqueeze(-1)).reshape(*lead, -1)


_GRIDS = {fmt: torch.tensor(v, dtype=torch.float32) for fmt, v in GRID.items()}


# --- from a GGUF file's bytes -------------------------------------------------------------------
def _k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (..., 12) -> (..., 16): 8 s, then 8 m."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), -1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), -1)
    return torch.cat((sc, mn), -1)


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
    sub = _k_scales(b[..., 4:16]).reshape(N, -1).contiguous()
    return fmt, dict(data=pack_nibbles(q), high=pack_high(q, fmt), scale=f16(b[..., 0:2]),
                     mins=f16(b[..., 2:4]), sub=sub)  # fmt: skip
