"""GGUF's quantized blocks as the CPU kernels read them, and the values they stand for.

Each GGUF type keeps its own bits: weights/gguf_blocks.py only re-lays them at load (planar
fields, 64-byte groups for wide loads; csrc/cpu_nibble.c reads them), and `dequantize` here is the
fp32 reference, with gguf-py's order of operations, so the two agree bit for bit
(tests/test_gguf_blocks.py).

    q8_0   data (N, K) int8, scale (N, K/32) f16                     w = d q
    q4_0   data (N, K/2) nibbles, scale f16 per 32                   w = d (q - 8)
    q4_1   ... and mins f16 per 32                                   w = d q + m
    q5_0   nibbles, high (N, K/8) bit masks, scale f16 per 32        w = d (q - 16)
    q5_1   ... and mins f16 per 32                                   w = d q + m
    q1_0   data (N, K/8): the bits as q5_0's masks, scale f16 per 128
                                                                     w = d (q - 1), q = 2 bit
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
    mxfp4  nibbles (indices into MXFP4_VALUES), scale f16 per 32   w = d MXFP4_VALUES[q]
    nvfp4  as mxfp4 with a scale f16 per 16 values, quarters swapped as q6_k's (NVFP4's own
           order)                                                  w = d MXFP4_VALUES[q]

The codebook types' indices stand for 4 or 8 values each; they are re-laid as the nibbles of
their values (weights/grids.py says why), and TQ2_0 and TQ1_0 (ternary), which have no format of
their own here, as q2_k (d = dmin = the file's d, every scale and min 1, so w = d q - d). Both
keep the values bit for bit, in more bytes than the file. Q1_0 keeps its bits (+-d) and its d
per 128 values: the file's 1.125 bits a value.

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

from .grids import CODEBOOK, IQ4_VALUES, MXFP4_VALUES, unpack_bits

QK = 256  # values of a K-quant superblock
CODEBOOKS = tuple(t.lower() for t in CODEBOOK)  # iq3_s ... iq1_m
# the formats of csrc/cpu_nibble.c's kernels (nibbles, or crumbs, in `data`)
NIBBLE = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_nl",
          "iq4_xs", "mxfp4", "nvfp4", "q1_0", *CODEBOOKS)  # fmt: skip
K_QUANTS = ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k", "iq4_xs", *CODEBOOKS)  # superblocks of 256
CRUMB = ("q3_k", "q2_k")  # 2 low bits a value in `data`
GRID16 = tuple(t.lower() for t, (_, _, per) in CODEBOOK.items() if per == 16)
HALF16 = ("q6_k", "q3_k", "q2_k", *GRID16)  # an int8 scale per 16 values: quarters swapped
SWAPPED = (*HALF16, "nvfp4")  # a scale per 16 values: quarters swapped
# nibble -> value, and the power of two the scales take
GRID = {"iq4_nl": IQ4_VALUES, "iq4_xs": IQ4_VALUES, "mxfp4": MXFP4_VALUES, "nvfp4": MXFP4_VALUES}
GRID |= {t.lower(): v for t, (v, _, _) in CODEBOOK.items()}
FACTOR = {t.lower(): f for t, (_, f, _) in CODEBOOK.items()}
XS = ("iq4_xs", *(f for f in CODEBOOKS if f not in GRID16))  # a d per 256, an int8 scale per 32
BITS = {
    "q4_0": 4,
    "q4_1": 4,
    "q5_0": 5,
    "q5_1": 5,
    "q4_k": 4,
    "q5_k": 5,
    "q6_k": 6,
    "q3_k": 3,
    "q2_k": 2,
} | dict.fromkeys(("iq4_nl", "iq4_xs", "mxfp4", "nvfp4", *CODEBOOKS), 4)


def block_values(fmt: str) -> int:
    """K must be a multiple of this for `fmt`."""
    return QK if fmt in K_QUANTS else 128 if fmt == "q1_0" else 32


def values_per_byte(fmt: str) -> int:
    """Values a byte of `data` holds."""
    return 8 if fmt == "q1_0" else 4 if fmt in CRUMB else 2 if fmt in NIBBLE else 1


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
    formats: indices into their GRID; q1_0: 0 or 2)."""
    if fmt == "q1_0":
        return 2 * unpack_masks(data, 8 * data.shape[-1])
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
    return swap_quarters(q) if fmt in SWAPPED else q


# --- the reference --------------------------------------------------------------------------------
def dequantize(fmt, data, scale, mins=None, high=None, sub=None) -> torch.Tensor:
    """The fp32 matrix (..., N, K) the fields of a GGUF block format stand for."""
    lead = data.shape[:-1]
    if fmt == "q8_0":
        return (data.reshape(*lead, -1, 32).float() * scale.float().unsqueeze(-1)).flatten(-2)
    q = values(fmt, data, high)
    q = _GRIDS[fmt][q.long()] if fmt in GRID else q.float()
    if fmt in ("iq4_nl", "mxfp4", "nvfp4"):
        per = 16 if fmt == "nvfp4" else 32
        return (scale.float().unsqueeze(-1) * q.reshape(*lead, -1, per)).reshape(*lead, -1)
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
    if fmt == "q1_0":  # a d per 128 values
        return (d * (q.reshape(*lead, -1, 128) - 1.0)).reshape(*lead, -1)
    if fmt in ("q4_0", "q5_0"):
        return (d * (qb - (8.0 if fmt == "q4_0" else 16.0))).reshape(*lead, -1)
    return (d * qb + mins.float().unsqueeze(-1)).reshape(*lead, -1)


_GRIDS = {fmt: torch.tensor(v, dtype=torch.float32) for fmt, v in GRID.items()}
