"""load_shard: one rank's slices of a checkpoint folder, read into a ParallelLaneformer.

Placement (placement.py) says which slice of every tensor the rank holds; this file opens the
folder through checkpoint.py, reads only those slices from the safetensors files (never a whole
tensor it does not keep, except one a LoRA adapter changes: merged whole, then sliced), and
builds the shard-size module that load_model cannot.
`bytes_loaded` on the result counts what was materialised.
"""

from __future__ import annotations

import os

import torch

from ..checkpoint import (
    NoInit,
    from_hf_tensor,
    hf_name,
    open_checkpoint,
    read_tensor,
    resolve_device,
    resolve_dtype,
    to_hf_tensor,
)
from ..errors import CheckpointError
from ..rope import inv_frequencies
from ..weights.lora import check_fits, load_adapter, summed
from .model import ParallelLaneformer
from .placement import Placement


def load_shard(
    path: str | os.PathLike,
    rank: int = 0,
    world: int = 1,
    device: str = "auto",
    dtype: str = "auto",
    overrides: dict | None = None,
    lora: tuple[tuple[str, float], ...] = (),
    **model_kw,
):
    """Read this rank's slices of a checkpoint folder into a ParallelLaneformer.

    It opens the folder and reads each tensor through checkpoint.py (open_checkpoint,
    read_tensor with this rank's `select`), then builds the shard-size module load_model cannot.
    `lora`: (adapter, scale) pairs (weights/lora.py); an adapted tensor is read whole, merged in
    fp32, then sliced as the rank's share, so every rank holds its part of the merged weight.
    """
    folder, cfg, handles, where = open_checkpoint(path, overrides)
    deltas = summed([load_adapter(a, cfg, s) for a, s in lora]) if lora else {}
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
        module = ours.removesuffix(".weight")
        if module in deltas:
            t = _merged_share(cfg, handles[where[key]], key, ours, whole[ours].shape, where[key],
                              deltas.pop(module), place)  # fmt: skip
        else:
            t = read_tensor(
                cfg, handles[where[key]], key, ours, whole[ours].shape, where[key], place.select
            )
        if t.shape != p.shape:  # a placement bug, not a user error
            raise AssertionError(f"{ours}: slice {tuple(t.shape)} != shard {tuple(p.shape)}")
        nbytes += t.numel() * t.element_size()
        state[ours] = t.to(device=dev, dtype=dt)
    if deltas:  # an adapter names a module the model lacks
        raise CheckpointError(f"a LoRA adapter adapts {sorted(deltas)[0]}, which this model "
                              "lacks")  # fmt: skip
    model.load_state_dict(state, strict=True, assign=True)  # every parameter leaves meta
    model.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(dev)
    model.bytes_loaded = nbytes
    return model.eval()


def _merged_share(cfg, handle, key, ours, shape, file, delta, place) -> torch.Tensor:
    """The rank's slice of a tensor with a LoRA delta (out, in) added to the whole of it."""
    whole = read_tensor(cfg, handle, key, ours, shape, file)  # ours: (1, out, in), one lane
    check_fits(ours.removesuffix(".weight"), delta, whole.shape)
    merged = (whole.float() + delta).to(whole.dtype)
    hf = to_hf_tensor(cfg, ours, merged)
    return from_hf_tensor(cfg, ours, place.select(ours, hf, tuple(hf.shape)))
