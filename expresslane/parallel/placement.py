"""Placement: which part of every tensor a rank holds (shard.py reads only that part).

A Laneformer is split by lanes (laneformer.md 8.1): with G ranks and L lanes, rank r holds lanes
[r*L/G, (r+1)*L/G) of every per-lane tensor (wq/wk/wv/wo/w1/w2/w3, per-lane norm scales, the
vocab-parallel head), a full replica of the embedding and of shared norms, and its lanes' KV.
A Llama-family checkpoint (one lane) gets ordinary tensor parallelism: rank r holds a contiguous
block of query heads, KV heads and FFN units (rows of q/k/v/gate/up, columns of o/down). Every
LM head ends on a contiguous vocab chunk [r*V//G, (r+1)*V//G) per rank, so sampling can stay
vocab-parallel. The slices are read straight from the safetensors slices (`get_slice`), never
the whole tensor (`select`, used by shard.py's load_shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError

ROW = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.", "feed_forward.w3.")
COL = ("attention.wo.", "feed_forward.w2.")


@dataclass(frozen=True)
class Placement:
    """Rank `rank` of `world` holding its share of the model described by `cfg` (global)."""

    cfg: ModelConfig
    rank: int = 0
    world: int = 1

    def __post_init__(self):
        cfg, G = self.cfg, self.world
        if not 0 <= self.rank < G:
            raise ConfigError(f"rank {self.rank} outside a world of {G} devices")
        if self.splits_lanes:
            if cfg.num_lanes % G:
                raise ConfigError(
                    f"--devices {G}: must divide num_lanes={cfg.num_lanes} (1, 2, 4, 8, ...)"
                )
            return
        for name, v in (
            ("num_attention_heads", cfg.num_heads),
            ("num_key_value_heads", cfg.num_kv_heads),
            ("intermediate_size", cfg.intermediate_size),
        ):
            if v % G:
                raise ConfigError(f"--devices {G}: must divide {name}={v} for tensor parallelism")

    @property
    def splits_lanes(self) -> bool:
        """Laneformer (L > 1): split lanes; a one-lane model (Llama): split heads and FFN."""
        return self.cfg.num_lanes > 1

    @property
    def lanes(self) -> tuple[int, int]:
        """[lo, hi) of the global lanes held here (the single lane for tensor parallelism)."""
        if not self.splits_lanes:
            return (0, 1)
        n = self.cfg.num_lanes // self.world
        return (self.rank * n, (self.rank + 1) * n)

    def vocab_chunk(self, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        V = self.cfg.vocab_size
        return (r * V // self.world, (r + 1) * V // self.world)

    @property
    def vocab_sizes(self) -> list[int]:
        return [b - a for a, b in map(self.vocab_chunk, range(self.world))]

    @property
    def local_cfg(self) -> ModelConfig:
        """The shard's shapes: lanes, heads and FFN units divided; layers and vocab global."""
        cfg, G = self.cfg, self.world
        return cfg.with_overrides(
            num_lanes=cfg.num_lanes // G if self.splits_lanes else 1,
            num_heads=cfg.num_heads // G,
            num_kv_heads=cfg.num_kv_heads // G,
            intermediate_size=cfg.intermediate_size // G,
        )

    def select(self, name: str, sl, shape: tuple) -> torch.Tensor:
        """The part of checkpoint tensor `name` (ours) held here, read from a safetensors slice."""
        cfg, G, r = self.cfg, self.world, self.rank
        lo, hi = self.lanes
        if name.startswith("lm_head."):
            if cfg.lm_head_type == "vocab_parallel":
                return sl[lo:hi]
            a, b = self.vocab_chunk()
            return sl[a:b]
        if name.endswith("norm.scale"):  # per-lane (L, D)
            return sl[lo:hi]
        if ".layers." not in name or "norm" in name:  # embedding, shared norms: replicated
            return sl[:]
        if self.splits_lanes:  # lane-major (L, out, in) or bias (L, out)
            return sl[lo:hi]
        if any(k in name for k in ROW):  # (out, in) or bias (out,): a block of rows
            n = shape[0] // G
            return sl[r * n : (r + 1) * n]
        if any(k in name for k in COL):  # (out, in): a block of columns
            n = shape[1] // G
            return sl[:, r * n : (r + 1) * n]
        raise CheckpointError(f"no placement rule for tensor {name}")
