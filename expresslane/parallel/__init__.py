"""Lanes (or heads) placed on several devices, and the delayed (DTP) exchange between them.

- placement.py: which slice of every tensor a rank holds.
- shard.py: load_shard, reading only those slices into a ParallelLaneformer.
- exchange.py: asynchronous all-reduces waited on where consumed, tracing, injected latency,
  and the vocab-parallel token pick.
- model.py: ParallelLaneformer, the forward over local lanes with the DTP wiring.
- engine.py: ParallelEngine, the Engine every rank runs in lockstep.

Processes are started by launch.py (`--devices N`, or torchrun).
"""

from .engine import ParallelEngine
from .exchange import Exchange
from .model import ParallelLaneformer
from .placement import Placement
from .shard import load_shard

__all__ = ["Exchange", "ParallelEngine", "ParallelLaneformer", "Placement", "load_shard"]
