"""Kernels per decode step, and what they cost: the launch side of the batch-1 budget.

At batch 1 a token costs (bytes read) / bandwidth + (kernels) x (gap per kernel): the ramp,
tail and launch of each kernel, which a CUDA graph shrinks but does not remove (Kog counts
~4.5 us a kernel; Hazy Research measured the bubbles between kernels as the gap to the
bandwidth bound). This file counts the kernels of one greedy decode step on any machine:

- the static eager step (the model's own forward, as a CUDA graph would capture it): every ATen
  op that launches work, counted by a dispatch mode while the step runs on meta tensors;
- the fused step (kernels/): the Triton launches recorded by kernels/aot.py.

and predicts tokens/s from the spec-16 bytes (bench/ceiling.py) and a range of per-kernel gaps.
Predictions only: `expresslane bench` measures.

    python -m expresslane.bench.launches --model laneformer-2b --gpu h100 --context 1024
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ConfigError
from ..presets import load_model_config
from .ceiling import bytes_per_token, get_gpu

# ATen ops that only make a view or metadata: no kernel on a GPU.
_NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze",
    "squeeze", "select", "slice", "as_strided", "alias", "detach", "split", "unbind", "chunk",
    "narrow", "_reshape_alias", "lift_fresh", "empty", "empty_like", "new_empty",
}  # fmt: skip
GAPS_US = (1.0, 2.0, 4.5)  # per-kernel gap: graph replay (optimistic), typical, Kog's figure


class _KernelCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _NO_KERNEL:
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _meta_model(model_ref: str):
    from ..model import Laneformer

    cfg = load_model_config(model_ref)
    with torch.device("meta"):
        model = Laneformer(cfg)
    return cfg, model.to(device="meta", dtype=torch.bfloat16)


def eager_step_kernels(model_ref: str, max_len: int = 4096) -> dict[str, int]:
    """ATen kernels of one greedy static decode step through the model's forward."""
    from ..cache import KVCache
    from ..sampling.params import SamplingParams
    from ..step.graph import DecodeGraph
    from ..step.protocol import EagerStep

    cfg, model = _meta_model(model_ref)
    cache = KVCache(cfg, max_len, "meta", torch.bfloat16)
    graph = DecodeGraph(EagerStep(model, cache), SamplingParams(temperature=0.0), capture=False)
    counter = _KernelCount()
    with counter:
        graph.run()  # capture=False: the step itself, eagerly, in the cache's static mode
    return counter.ops


def fused_step_kernels(model_ref: str, max_len: int = 4096) -> int:
    """Triton launches of one greedy fused decode step (an H100's launch plan)."""
    from ..kernels.aot import record_decode_step

    return len(record_decode_step(model_ref, max_len, sms=132, pdl=True, logits=False, arch=None))


def predict(model_ref: str, gpu: str, context: int, efficiency: float = 0.9) -> dict:
    """us/token = bytes / (datasheet x efficiency) + kernels x gap, for each gap in GAPS_US."""
    cfg = load_model_config(model_ref)
    bw = get_gpu(gpu).bandwidth_tb_s * 1e12
    datasheet_us = bytes_per_token(cfg, context)["total"] / bw * 1e6
    stream_us = datasheet_us / efficiency
    eager = sum(eager_step_kernels(model_ref).values())
    fused = fused_step_kernels(model_ref)
    rows = []
    for name, kernels in (("static eager step (CUDA graph)", eager), ("fused step", fused)):
        for gap in GAPS_US:
            token_us = stream_us + kernels * gap
            rows.append(
                {"step": name, "kernels": kernels, "gap_us": gap, "token_us": token_us,
                 "tok_s": 1e6 / token_us, "of_datasheet": datasheet_us / token_us}
            )  # fmt: skip
    return {"model": model_ref, "gpu": gpu, "context": context, "efficiency": efficiency,
            "datasheet_us": datasheet_us, "stream_us": stream_us, "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.launches", description=__doc__)
    ap.add_argument("--model", default="laneformer-2b", help="preset or checkpoint folder")
    ap.add_argument("--gpu", default="h100", help="datasheet bandwidth preset (bench/ceiling.py)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--efficiency", type=float, default=0.9,
                    help="fraction of datasheet bandwidth a streaming kernel reaches (an H100's "
                    "device copy: ~3.0 of 3.35 TB/s)")  # fmt: skip
    args = ap.parse_args(argv)
    if not 0 < args.efficiency <= 1:
        print(f"error: --efficiency {args.efficiency}: expected a fraction in (0, 1]",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        out = predict(args.model, args.gpu, args.context, args.efficiency)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.model} on {args.gpu} at context {args.context}: the bytes take "
          f"{out['datasheet_us']:.0f} us/token at datasheet bandwidth, {out['stream_us']:.0f} "
          f"at {args.efficiency:.0%} of it")  # fmt: skip
    print(f"{'step':32} {'kernels':>8} {'gap us':>7} {'us/token':>9} {'tok/s':>7} {'of BW':>6}")
    for r in out["rows"]:
        print(f"{r['step']:32} {r['kernels']:>8} {r['gap_us']:>7.1f} {r['token_us']:>9.0f} "
              f"{r['tok_s']:>7.0f} {r['of_datasheet']:>6.0%}")  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
