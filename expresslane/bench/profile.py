"""Where a decode step's time goes: torch.profiler over ~20 replays of the decode graph.

    python -m expresslane.bench.profile [--model laneformer-2b] [--context 1024] [--steps 20]
                                        [--kernels auto|on|off] [--dry-run]

The model's random weights are made on the device, a prompt of `context` tokens is prefilled,
the engine's decode graph (the fused step where it runs) is captured, and `steps` replays run
under the profiler. For every kernel name: launches per step, time per step and per launch, the
mean idle gap on the GPU before each launch (the previous kernel's end to this one's start: the
launch, ramp and drain that the bytes do not pay for), bytes per step and GB/s. Bytes come from
the fused step's own launches, recorded on the meta device (kernels/aot.py): each tensor argument
once, the KV cache as far as the context reaches, one row of the RoPE tables and of the slots a
step writes. Kernels outside the fused step (ATen) show no bytes. One table, a summary (time per
step, kernel time, gaps, tokens/s), then one JSON line last.

If the profiler sees no kernels inside graph replays (CUPTI without graph tracing), the same
step is profiled launched eagerly instead, and the output says so. `--dry-run`: the CPU with
`laneformer-tiny`, its top-level ATen ops in place of kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

import torch

from ..checkpoint import resolve_device, resolve_dtype
from ..presets import load_model_config


def launch_bytes(launch, context: int) -> int:
    """Bytes one recorded launch must move (see the module docstring for the rule)."""
    total = 0
    for name, shape, itemsize in launch.tensors:
        n = itemsize
        for d in shape:
            n *= d
        rows = shape[0] if shape else 1
        if name in ("cos_ptr", "sin_ptr") or (name.endswith("cache_ptr") and
                                              launch.name.startswith("norm_qkv")):  # fmt: skip
            n //= max(rows, 1)  # one row: this position's angles, the slot this step writes
        elif name.endswith("cache_ptr"):
            n = n * min(context + 1, rows) // max(rows, 1)  # the keys within reach
        total += n
    return total


def bytes_by_kernel(model_ref: str, context: int, sms: int, pdl: bool,
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:  # fmt: skip
    """Bytes per decode step for each Triton kernel name of the fused greedy step."""
    from ..kernels.aot import record_decode_step

    out: dict[str, int] = defaultdict(int)
    max_len = context + 1
    for launch in record_decode_step(model_ref, max_len, sms, pdl, logits=False, arch=None,
                                     dtype=dtype):  # fmt: skip
        out[launch.name] += launch_bytes(launch, context)
    return dict(out)


def _events(prof, cuda: bool) -> list:
    """Kernels on the GPU (or top-level ATen ops on a CPU), in start order."""
    from torch.autograd import DeviceType

    if cuda:
        evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        evs = [e for e in prof.events() if e.device_type == DeviceType.CPU
               and e.cpu_parent is None and e.name.startswith("aten::")]  # fmt: skip
    return sorted(evs, key=lambda e: e.time_range.start)


def summarise(evs: list, steps: int, nbytes: dict[str, int]) -> tuple[list[dict], dict]:
    """Per-kernel rows and the step's totals from profiled events of `steps` steps."""
    per: dict[str, dict] = {}
    prev_end = None
    for e in evs:
        r = per.setdefault(e.name, {"kernel": e.name, "launches": 0, "us": 0.0, "gaps": []})
        r["launches"] += 1
        r["us"] += e.time_range.end - e.time_range.start
        if prev_end is not None:
            r["gaps"].append(max(0.0, e.time_range.start - prev_end))
        prev_end = e.time_range.end
    rows = []
    for r in per.values():
        b = nbytes.get(r["kernel"])
        us_step = r["us"] / steps
        rows.append(
            {
                "kernel": r["kernel"],
                "launches_per_step": r["launches"] / steps,
                "us_per_step": us_step,
                "us_per_launch": r["us"] / r["launches"],
                "gap_us": statistics.mean(r["gaps"]) if r["gaps"] else None,
                "bytes_per_step": b,
                "gb_s": b / us_step / 1e3 if b and us_step else None,
            }
        )
    rows.sort(key=lambda r: -r["us_per_step"])  # fmt: skip
    span = (evs[-1].time_range.end - evs[0].time_range.start) / steps if evs else 0.0
    busy = sum(r["us_per_step"] for r in rows)
    return rows, {"us_per_step": span, "kernel_us_per_step": busy, "gap_us_per_step": span - busy,
                  "launches_per_step": len(evs) / steps}  # fmt: skip


def profile_step(model, engine, context: int, steps: int, capture: bool):
    """Prefill `context` tokens, then profile `steps` runs of the decode graph."""
    from ..sampling.params import SamplingParams
    from ..step.graph import DecodeGraph

    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    g = torch.Generator().manual_seed(context)
    prompt = torch.randint(3, model.cfg.vocab_size, (context,), generator=g).tolist()
    logits = engine.prefill(prompt)
    graph = DecodeGraph(engine.step, params, capture=capture)
    graph.load(logits.argmax(), position=context)
    graph.capture_buckets([graph.live()])
    graph.run()  # a warm run; replays below start one position on
    graph.load(logits.argmax(), position=context)
    cuda = engine.device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            graph.run()
        if cuda:
            torch.cuda.synchronize()
    return prof


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.profile", description=__doc__)
    ap.add_argument("--model", default="laneformer-2b", help="preset or checkpoint folder")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kernels", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--dry-run", action="store_true", help="laneformer-tiny on the CPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.model, args.device, args.dtype = "laneformer-tiny", "cpu", "float32"
        args.context, args.steps = min(args.context, 16), min(args.steps, 3)
    from ..engine import Engine
    from .bandwidth import copy_bandwidth_gb_s
    from .ceiling import bytes_per_token
    from .weights import random_model

    cfg = load_model_config(args.model)
    dev = resolve_device(args.device)
    dt = resolve_dtype(args.dtype, cfg, dev)
    model = random_model(cfg, dev, dt)
    engine = Engine(model, max_model_len=args.context + 2 * args.steps + 8, kernels=args.kernels,
                    grammar_graphs=False)  # fmt: skip
    cuda = dev.type == "cuda"
    fused = engine.step_name == "fused kernels" and engine.step.kernels
    mode = "graph replay" if cuda else "eager (CPU)"
    prof = profile_step(model, engine, args.context, args.steps, capture=cuda)
    evs = _events(prof, cuda)
    if cuda and not evs:  # no kernel records inside graphs: profile the launches instead
        mode = "eager launches (no kernel records in graph replays)"
        prof = profile_step(model, engine, args.context, args.steps, capture=False)
        evs = _events(prof, cuda)
    nbytes = {}
    if fused:
        from ..kernels.gemv import num_sms, pdl_enabled

        probe = next(model.parameters())
        nbytes = bytes_by_kernel(args.model, args.context, num_sms(probe) or 132,
                                 pdl_enabled(probe), dt)  # fmt: skip
    rows, total = summarise(evs, args.steps, nbytes)
    copy_gb_s = copy_bandwidth_gb_s(dev, nbytes=(16 << 20) if args.dry_run else 1 << 30)
    token_bytes = bytes_per_token(cfg, args.context + 1, dtype_bytes=dt.itemsize)["total"]
    total.update(tok_s=1e6 / total["us_per_step"] if total["us_per_step"] else None,
                 bytes_per_token=token_bytes, copy_gb_s=copy_gb_s)  # fmt: skip
    print(f"{args.model}, context {args.context}, {args.steps} steps, {mode}, fused kernels "
          f"{'on' if fused else 'off'}, copy {copy_gb_s:.0f} GB/s")  # fmt: skip
    print(f"{'kernel':<44} {'/step':>5} {'us/step':>8} {'us/call':>8} {'gap us':>7} "
          f"{'MB/step':>8} {'GB/s':>7} {'%copy':>6}")  # fmt: skip
    for r in rows:
        gap = f"{r['gap_us']:7.2f}" if r["gap_us"] is not None else " " * 7
        mb = f"{r['bytes_per_step'] / 1e6:8.2f}" if r["bytes_per_step"] else " " * 8
        gbs = f"{r['gb_s']:7.0f} {100 * r['gb_s'] / copy_gb_s:6.1f}" if r["gb_s"] else ""
        print(f"{r['kernel'][:44]:<44} {r['launches_per_step']:5.1f} {r['us_per_step']:8.1f} "
              f"{r['us_per_launch']:8.2f} {gap} {mb} {gbs}")  # fmt: skip
    t = total
    print(f"step {t['us_per_step']:.1f} us ({t['tok_s'] or 0:.1f} tok/s): kernels "
          f"{t['kernel_us_per_step']:.1f} us, idle gaps {t['gap_us_per_step']:.1f} us, "
          f"{t['launches_per_step']:.0f} launches; {token_bytes / 1e9:.3f} GB/token = "
          f"{token_bytes / max(t['us_per_step'], 1e-9) / 1e3:.0f} GB/s")  # fmt: skip
    print(json.dumps({"profile": args.model, "context": args.context, "steps": args.steps,
                      "mode": mode, "fused_kernels": fused, "device": str(dev),
                      "total": total, "kernels": rows}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
