"""Rotary position embeddings: frequencies (with llama3 scaling) and the two pairing conventions.

Laneformer rotates adjacent pairs (2i, 2i+1), the Meta/complex convention (laneformer.md 4.4);
Llama as transformers stores it rotates (i, i + head_dim/2), "rotate-half". Angles are computed
from the positions on the fly in fp32 (no table), so any position a cache allows is valid and a
captured graph only needs the position tensor.
"""

from __future__ import annotations

import math

import torch

from .config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """omega_i = theta^(-2i/head_dim), then the llama3 / linear band scaling if configured."""
    # always computed on the CPU in fp32 (also while a model is being built on "meta")
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / (theta ** (steps / head_dim))
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth band between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S,) positions -> cos, sin of shape (S, head_dim/2) in fp32."""
    angles = positions.float()[:, None] * inv_freq[None, :].float()  # (S, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate x (..., S, H, hd) by per-position angles; computed in fp32, cast back."""
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]  # (S, 1, hd/2), broadcast over heads
    if style == "interleaved":
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x0, x1 = xf[..., :half], xf[..., half:]
        out = torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return out.to(x.dtype)


def interleaved_to_half_permutation(head_dim: int) -> torch.Tensor:
    """Row order that turns an interleaved-RoPE head into a rotate-half one (Meta -> HF)."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
