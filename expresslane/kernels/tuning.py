"""Launch configurations of the fused kernels: the built-in defaults and the measured winners.

A configuration is a dict of one kernel's tuning constexprs and launch options (BLOCK_O,
PREFETCH, NUM_SPLITS, num_warps, num_stages, ...). A wrapper asks `choose(kernel, t, key,
default)` with the shape key of its launch; the answer is the default, updated by the table of
t's GPU (`tuning/<gpu>.json`, written by the sweep: bench/sweep.py) where it has that kernel
and shape, updated by `forcing` (the sweep and the tests pin a variant). Off CUDA, or for a GPU
or shape the table lacks, the default stands.

Keys hold the shape only, never the token count S: a configuration fixes each row's tiles and
reduction order, so one configuration for every S keeps the kernels batch-invariant.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from pathlib import Path

import torch

TABLES = Path(__file__).parent / "tuning"
# A GPU to plan launches for when none is here: kernels/aot.py sets {"sms": 132, "pdl": True,
# "name": ...} to record the launches that GPU would make. Empty: ask the device.
PLANNED_GPU: dict = {}
OPTIONS = ("num_warps", "num_stages")  # launch options; the rest are constexprs
# The kernels that ask `choose`, by the name their table entries and forced variants use.
KERNELS = ("attention", "gemv_reduce_past", "gemv_reduce_present", "gemv_reduce_no_reduce",
           "lane_gemv", "lm_head", "norm_qkv", "norm_swiglu")  # fmt: skip
_FORCED: dict[str, dict] = {}
SEEN: list[tuple[str, str]] = []  # (kernel, key) of every choice, while `watching`
_WATCH = [False]


def slug(gpu: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': the table's file name."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def gpu_name(t: torch.Tensor) -> str | None:
    """The name of t's GPU (the planned one under kernels/aot.py); None off CUDA."""
    if "name" in PLANNED_GPU:
        return PLANNED_GPU["name"]
    if not t.is_cuda:
        return None
    return torch.cuda.get_device_name(t.device)


@functools.cache
def table(gpu: str) -> dict:
    """{kernel: {shape key: config}} from tuning/<slug>.json; {} when there is none."""
    path = TABLES / f"{slug(gpu)}.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("kernels", {})


def shape_key(**dims: int) -> str:
    """'L8-D3072-O1536' from dims in the given order: a table key."""
    return "-".join(f"{k}{v}" for k, v in dims.items())


def choose(kernel: str, t: torch.Tensor, key: str, default: dict) -> dict:
    """default, then the table's entry for (t's GPU, kernel, key), then any forced variant."""
    assert kernel in KERNELS, f"{kernel}: not in tuning.KERNELS"
    if _WATCH[0]:
        SEEN.append((kernel, key))
    cfg = dict(default)
    gpu = gpu_name(t)
    if gpu is not None:
        cfg.update(table(gpu).get(kernel, {}).get(key, {}))
    cfg.update(_FORCED.get(kernel, {}))
    return cfg


def split(cfg: dict) -> tuple[dict, dict]:
    """(constexprs, launch options) of a configuration."""
    consts = {k: v for k, v in cfg.items() if k not in OPTIONS}
    return consts, {k: v for k, v in cfg.items() if k in OPTIONS}


@contextlib.contextmanager
def forcing(kernel: str, cfg: dict):
    """Within: every launch of `kernel` uses cfg over its chosen configuration."""
    old = _FORCED.get(kernel)
    _FORCED[kernel] = dict(cfg)
    try:
        yield
    finally:
        if old is None:
            _FORCED.pop(kernel, None)
        else:
            _FORCED[kernel] = old


@contextlib.contextmanager
def watching():
    """Within: SEEN lists the (kernel, key) of every choice made (the sweep's table keys)."""
    SEEN.clear()
    _WATCH[0] = True
    try:
        yield SEEN
    finally:
        _WATCH[0] = False
