"""load_shard: one rank's slices of a checkpoint folder, read into a ParallelLaneformer.

Placement (placement.py) says which slice of every tensor the rank holds; this file opens the
folder through checkpoint.py, reads only those slices from the safetensors files (never a whole
tensor it does not keep), and builds the shard-size module that load_model cannot.
`bytes_loaded` on the result counts what was materialised.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint import (
    NoInit,
    hf_name,
    open_checkpoint,
    read_tensor,
    resolve_device,
    resolve_dtype,
)
from ..errors import CheckpointError
from ..rope import inv_frequencies
from .model import ParallelLaneformer
from .placement import Placement


def load_shard(
    path: str | os.PathLike,
    rank: int = 0,
    world: int = 1,
    device: str = "auto",
    dtype: str = "auto",
    overrides: dict | None = None,
    **model_kw,
):
    """Read this rank's slices of a checkpoint folder into a ParallelLaneformer.

    It opens the folder and reads each tensor through checkpoint.py (open_checkpoint,
    read_tensor with this rank's `select`), then builds the shard-size module load_model cannot.
    """
    folder, cfg, handles, where = open_checkpoint(path, overrides)
    place = Placement(cfg, rank, world)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, cfg, dev)
    with torch.device("meta"), NoInit():  # world 1: the whole model's names and shapes
        whole = dict(ParallelLaneformer(Placement(cfg)).named_parameters())
        model = ParallelLaneformer(place, **model_kw)
    state, nbytes = {}, 0
    for ours, p in model.named_parameters():
        key = hf_name(cfg, ours)
        if key not in where:
            raise CheckpointError(f"{folder}: missing tensor {key}")
        t = read_tensor(
            cfg, handles[where[key]], key, ours, whole[ours].shape, where[key], place.select
        )
        if t.shape != p.shape:  # a placement bug, not a user error
            raise AssertionError(f"{ours}: slice {tuple(t.shape)} != shard {tuple(p.shape)}")
        nbytes += t.numel() * t.element_size()
        state[ours] = t.to(device=dev, dtype=dt)
    model.load_state_dict(state, strict=True, assign=True)  # every parameter leaves meta
    model.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    model.bytes_loaded = nbytes
    return model.eval()
