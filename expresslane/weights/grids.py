"""The value grids of GGUF's codebook types, and the fields of IQ3_S, TQ2_0 and TQ1_0 unpacked to
plain values: what weights/blocks.py re-lays for the kernels and gguf/quants.py dequantizes.

    IQ4_NL, IQ4_XS  a 4-bit index into IQ4_VALUES (16 non-linear values, -127..113)
    IQ3_S  (256, 110) d f16, qs[64] (the low 8 bits of 64 grid indices), qh[8] (their 9th bits),
           signs[32] (a bit a value), scales[4] (a 4-bit s per 32 values)
                             x = d (1 + 2 s) sign g,  g: value j of IQ3S_GRID[index], odd 1..15
    TQ2_0  (256, 66)  qs[64] 2-bit q (Q2_K's order), d f16              x = d (q - 1)
    TQ1_0  (256, 54)  qs[48] five trits a byte, qh[4] four, d f16        x = d (t - 1)

A grid index of IQ3_S stands for 4 values, each one of 8 odd magnitudes: 512 of the 4096
combinations. With its sign a value v = sign g is odd in -15..15, so (v + 15) / 2 is a nibble:
blocks.py keeps IQ3_S as those nibbles (a grid of 16 linear values, ODD_VALUES), 138 bytes per
256 values (4.31 bits a value) where the file has 110 (3.44). That is a decision, not a
measurement: reading the file's indices would take a gather from the 512-entry table per 4
values, plus index and sign work, in the group loader that every nibble format shares, while the
nibbles cost it one load and two masks; the values stay the file's, bit for bit. The ternary
types go to Q2_K's layout for the same reason: 84 bytes per 256 values (2.63 bits) where TQ2_0
has 66 and TQ1_0 54. BENCHMARKS.md has their speed against llama.cpp's on the same files.
"""

from __future__ import annotations

import torch

# ggml-common.h's kvalues_iq4nl
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# IQ3_S's values once re-laid as nibbles: v = 2 q - 15
ODD_VALUES = tuple(range(-15, 16, 2))

# ggml-common.h's iq3s_grid: 512 entries of 4 magnitudes 2 k + 1, each entry written here as 3 hex
# digits holding k0 | k1 << 3 | k2 << 6 | k3 << 9
_IQ3S_HEX = (
    "00000100200500700800900a00c00e01001101501b02002202502702902b03003203903c03f040041042044048"
    "04904d05005305705905d06407107507a08008108508708808b08e09109509809c0a20a50a70a90ab0b80bb0c3"
    "0c90cd0d00d20d90db0de0e40e80ea0f70f90fd10010b10f11111411a12012312913814214415015215615b161"
    "16516717617b18618918b1991aa1b91c01c21c41d01d21d61db1e81ec20020120220420820920b20d20f210212"
    "21921c21e22c22e23123a24024124324624824c25125825b26126826a27827e28028a28d28f29029429a2a02a3"
    "2ad2b02ba2c12c42c72c82cb2d12d72d82dc2e12f22f830330530a30c31931b32232632832c34134834b351358"
    "35a3693903943973a43a63c13c33c83ca3d13dd3e13f23f840040140340540740840a40c40e41141341741841a"
    "42142342542842a43743843b43d44044244844b44f45245545945c46246948148448749149349849f4a14ab4af"
    "4b94bc4c04c24c54c94d24d44d94db4e24e84f650150751051351a51d52153a53d54454955255f56056b578580"
    "5825875915ad5b15c55c95d65d85e35e860260960b60d60f61261961b61d62262462762963363964164364564c"
    "65165366067067a67e68068a69069a69c6a86c16c86cc6d16d36d76d86e16e36e76ed6fb70370970e71271972a"
    "73073474174874a75575a76476e77b78e7a17c17c37d07d27dd80080480a81081481781a821828838842847849"
    "84b85285885d86386986d88188388888d89189b8a08af8b28b88c48c98cb8d08d28d98dd90090291491f920939"
    "94594795197298b99c9b09c89cd9d89e39e9a02a08a0ca12a20a24a27a2aa36a3ca41a43a45a4aa51a5aa7aa80"
    "a89a93a98a9eaabac2ac7ac8ad7ae4ae9af5afbb01b04b10b1ab26b4ab56b69b6bba2bc2bc4bd2c09c0bc0dc19"
    "c1bc30c40c50c57c74c8ac9cca2cadcb2cb8cc0ccccd1ce0d15d23d32d40d43d5cd70d85da0dc9dcbe00e04e07"
    "e10e12e1ee20e2ce32e42e49e54e63e65e81e84e88e8ee91e98ea9ec2edaeddeebf01f05f0bf10f28f52f62f82"
    "f99fc0"
)


def _iq3s_grid() -> torch.Tensor:
    codes = torch.tensor([int(_IQ3S_HEX[i : i + 3], 16) for i in range(0, len(_IQ3S_HEX), 3)])
    k = (codes[:, None] >> torch.arange(0, 12, 3)) & 7  # (512, 4)
    return (2 * k + 1).to(torch.int8)


IQ3S_GRID = _iq3s_grid()  # (512, 4) magnitudes, odd 1..15


def iq3_s_signed(b: torch.Tensor) -> torch.Tensor:
    """IQ3_S blocks (..., 110) bytes -> (..., 256) int8 signed values v = sign g (odd, -15..15)."""
    qs = b[..., 2:66].to(torch.int64)
    qh = b[..., 66:74].to(torch.int64)  # bit i of byte j: index 8 j + i's 9th bit
    high = (qh.unsqueeze(-1) >> torch.arange(8) & 1).flatten(-2)  # (..., 64)
    g = IQ3S_GRID[qs | high << 8].flatten(-2)  # (..., 256)
    signs = b[..., 74:106].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
    return torch.where(signs.flatten(-2).bool(), -g, g)


def iq3_s_scales(b: torch.Tensor) -> torch.Tensor:
    """IQ3_S blocks (..., 110) -> (..., 8) int32: 1 + 2 s per 32 values (byte i: blocks 2i, 2i+1
    in its low and high nibbles)."""
    s = b[..., 106:110].to(torch.int32)
    return 1 + 2 * torch.stack((s & 0x0F, s >> 4), -1).flatten(-2)


def tq2_0_values(b: torch.Tensor) -> torch.Tensor:
    """TQ2_0 blocks (..., 66) -> (..., 256) values 0..3 (Q2_K's crumb order: value 128 h + 32 j +
    l is bits 2 j, 2 j + 1 of byte 32 h + l)."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
    return (b[..., :64].reshape(*b.shape[:-1], 2, 1, 32) >> shifts & 3).flatten(-3)


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
