"""Micro-benchmark of the fused decode kernels on Laneformer-2B shapes: time and bandwidth.

The prefill's residual + norm kernel (kernels/prefill_norm.py) has two rows too: `--context`
tokens of the 2B's residual stream, present and past mode.

    python -m expresslane.bench.kernels [--dtype bf16] [--context 1024] [--reps 50] [--dry-run]

For each kernel (and one whole decoder layer) it prints the median time of one call, the bytes
the call must move (weights, KV read, activations), the achieved GB/s, and that as a fraction of
a device-to-device copy measured in the same run; then the plain-PyTorch reference's time. One
table, then one JSON line last.

Method. Every measurement replays a CUDA graph of `reps` calls, each on its own copy of the
weights (enough copies to exceed ~4x a 50 MB L2), so the weights stream from HBM as they do in
a real decode step, and Python launch overhead is excluded as it is under the engine's CUDA
graph. The median over `--trials` replays, divided by `reps`, is reported. Graph replay keeps
the small gaps between kernels, which is what a decode step pays too. Needs CUDA: exits 2
elsewhere, except `--dry-run`: tiny shapes on the CPU, the kernels in the Triton interpreter,
timed call by call (the plumbing and the kernels' arguments, not their speed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

SHAPE = dict(L=8, D=3072, HQ=32, HKV=16, HD=96, F=12288, V=32000, MAX_LEN=4096, WINDOW=2048)
DRY_SHAPE = dict(L=2, D=64, HQ=4, HKV=2, HD=16, F=96, V=64, MAX_LEN=48, WINDOW=16)
L2_BYTES = 50 << 20  # H100 L2; H200 has the same


def _time_graph(calls: list[Callable[[], object]], trials: int) -> float:
    """Median seconds per call of a CUDA graph replaying `calls` once each."""
    for call in calls[:2]:  # compile / autotune outside the capture
        call()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the allocator on the capture stream
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(trials + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times[2:])


def _time_calls(calls: list[Callable[[], object]], trials: int) -> float:
    """Median seconds per call, called one by one with a host clock (the CPU dry run)."""
    import time

    calls[0]()
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - t) / len(calls))
    return statistics.median(times)


def _copies(make: Callable[[], dict], nbytes: int, reps: int) -> list[dict]:
    """Independent weight sets, enough that one graph replay streams >= 4x L2 from HBM."""
    n = max(2, min(reps, -(-4 * L2_BYTES // max(nbytes, 1))))
    return [make() for _ in range(n)]


class Case(NamedTuple):
    name: str
    shape: str  # for the table
    nbytes: int  # bytes one call must move: weights, KV read, activations
    make: Callable[[], dict]  # one independent copy of the weights (and KV)
    run: Callable[[dict], object]  # the fused kernel(s)
    run_ref: Callable[[dict], object]  # the kernels/ref.py twin


def _cases(dtype: torch.dtype, context: int, dev: str = "cuda", s: dict = SHAPE) -> list[Case]:
    from expresslane.kernels import (
        decode_attention,
        gemv_reduce,
        lm_head,
        norm_qkv,
        prefill_norm,
        ref,
        swiglu,
    )
    from expresslane.kernels.decode_step import fused_decode_layer, reference_decode_layer

    L, D, hd, FL, VL = s["L"], s["D"], s["HD"], s["F"] // s["L"], s["V"] // s["L"]
    QL, KL = s["HQ"] * hd // L, s["HKV"] * hd // L
    e = torch.empty((), dtype=dtype).element_size()

    def w(*shape):
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dtype)

    def cache(cap):  # (k, v, pos) holding the last min(cap, context) positions
        k = torch.randn(cap, s["HKV"], hd, device=dev).to(dtype)
        slots = torch.arange(cap, device=dev)
        pos = torch.where(slots < context, slots, -1) if cap >= context else slots + context - cap
        return k, k.clone(), pos

    h = torch.randn(L, D, device=dev).to(dtype)
    nw = torch.ones(D, device=dev, dtype=dtype)
    inv = 10000.0 ** (-torch.arange(0, hd, 2, device=dev) / hd)
    ang = torch.arange(s["MAX_LEN"], device=dev)[:, None] * inv[None, :]  # (max_len, hd/2)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    position = torch.tensor([context - 1], device=dev)
    ring = cache(s["WINDOW"])
    q = torch.randn(s["HQ"], hd, device=dev).to(dtype)
    a_attn = torch.randn(L, QL, device=dev).to(dtype)
    a_mlp = torch.randn(L, FL, device=dev).to(dtype)
    act = L * D * e  # one (L, D) activation
    kv = {c: 2 * min(context, c) * s["HKV"] * hd * e for c in (s["MAX_LEN"], s["WINDOW"])}

    cases = [
        Case(
            "norm_qkv",
            f"L{L} ({QL}+2x{KL}) x {D}",
            L * (QL + 2 * KL) * D * e + act,
            lambda: {"wq": w(L, QL, D), "wk": w(L, KL, D), "wv": w(L, KL, D)},
            lambda p: norm_qkv.norm_qkv(
                h, nw, p["wq"], p["wk"], p["wv"], cos, sin, position, *ring
            ),
            lambda p: ref.norm_qkv(h, nw, p["wq"], p["wk"], p["wv"], cos, sin, position, *ring),
        )
    ]
    for name, cap, window in (
        ("attn full", s["MAX_LEN"], None),
        ("attn sliding", s["WINDOW"], s["WINDOW"]),
    ):
        cases.append(
            Case(
                name,
                f"ctx {context} Hq{s['HQ']}/Hkv{s['HKV']} hd{hd}",
                kv[cap],
                lambda cap=cap: {"kv": cache(cap)},  # own KV per copy: no L2 hits
                lambda p, win=window: decode_attention.decode_attention(
                    q, *p["kv"], position, window=win
                ),
                lambda p, win=window: ref.decode_attention(q, *p["kv"], position, window=win),
            )
        )
    for name, a, k in (("wo+reduce", a_attn, QL), ("w2+reduce", a_mlp, FL)):
        cases.append(
            Case(
                name,
                f"past L{L} {D} x {k}",
                L * D * k * e + 5 * act,
                lambda k=k: {"w": w(L, D, k)},
                lambda p, a=a: gemv_reduce.gemv_reduce(a, p["w"], h, h, mode="past"),
                lambda p, a=a: ref.gemv_reduce(a, p["w"], h, h, mode="past"),
            )
        )
    cases.append(
        Case(
            "norm_swiglu",
            f"L{L} 2x{FL} x {D}",
            2 * L * FL * D * e + act,
            lambda: {"w1": w(L, FL, D), "w3": w(L, FL, D)},
            lambda p: swiglu.norm_swiglu(h, nw, p["w1"], p["w3"]),
            lambda p: ref.norm_swiglu(h, nw, p["w1"], p["w3"]),
        )
    )
    for name, fn, ref_fn in (
        ("head argmax", lm_head.lm_head_argmax, ref.lm_head_argmax),
        ("head logits", lm_head.lm_head_logits, ref.lm_head_logits),
    ):
        cases.append(
            Case(
                name,
                f"vocab_parallel L{L} {VL} x {D}",
                L * VL * D * e + act,
                lambda: {"w": w(L, VL, D)},
                lambda p, fn=fn: fn(h, nw, p["w"], head_type="vocab_parallel"),
                lambda p, fn=ref_fn: fn(h, nw, p["w"], head_type="vocab_parallel"),
            )
        )

    def layer_w():
        names = {"wq": (L, QL, D), "wk": (L, KL, D), "wv": (L, KL, D), "wo": (L, D, QL),
                 "w1": (L, FL, D), "w3": (L, FL, D), "w2": (L, D, FL)}  # fmt: skip
        return {"attention_norm": nw, "ffn_norm": nw} | {k: w(*v) for k, v in names.items()}

    # the prefill's residual + norm over `context` tokens (kernels/prefill_norm.py): reads y,
    # h (and past), writes h_new and the normed stream; its reference is the eager ops
    n_act = context * L * D * e
    for mode, past in (("present", False), ("past", True)):
        cases.append(
            Case(
                f"prefill {mode[:4]}",
                f"S{context} L{L} {D}, residual+norm",
                (5 if past else 4) * n_act,
                lambda past=past: _prefill_inputs(context, L, D, dtype, dev, past),
                lambda p, mode=mode: prefill_norm.residual_norm(**p, mode=mode),
                lambda p, mode=mode: ref.residual_norm(**p, mode=mode),
            )
        )
    kw = dict(reduce_mode="past", past_attn=h, past_mlp=h, window=s["WINDOW"])
    cases.append(
        Case(
            "decode layer",
            f"sliding, ctx {context}",
            L * (2 * QL + 2 * KL + 3 * FL) * D * e + kv[s["WINDOW"]] + 8 * act,
            layer_w,
            lambda p: fused_decode_layer(h, p, *ring, position, cos, sin, **kw),
            lambda p: reference_decode_layer(h, p, *ring, position, cos, sin, **kw),
        )
    )
    return cases


def _prefill_inputs(n: int, lanes: int, dim: int, dtype, dev: str, past: bool) -> dict:
    """h (N, L, D), y and past as lane_linear returns them ((L, N, D) storage), a shared norm."""

    def lane_major():
        return torch.randn(lanes, n, dim, device=dev).to(dtype).transpose(0, 1)

    return {"h": torch.randn(n, lanes, dim, device=dev).to(dtype), "y": lane_major(),
            "past": lane_major() if past else None,
            "gamma": torch.ones(dim, device=dev, dtype=dtype), "eps": 1e-5}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--context", type=int, default=1024, help="tokens in the KV cache")
    ap.add_argument("--reps", type=int, default=50, help="calls per graph replay")
    ap.add_argument("--trials", type=int, default=20, help="graph replays; the median is kept")
    ap.add_argument("--pdl", choices=["on", "off"], default="on",
                    help="programmatic dependent launch where supported (sm90+)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU, kernels in the Triton interpreter")  # fmt: skip
    args = ap.parse_args(argv)
    if args.pdl == "off":
        os.environ["EXPRESSLANE_PDL"] = "0"
    if args.dry_run:  # before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["EXPRESSLANE_FORCE_TRITON"] = "1"
        args.dtype, args.context = "fp32", min(args.context, 24)
    elif not torch.cuda.is_available():
        print("expresslane.bench.kernels needs a CUDA GPU (none found)", file=sys.stderr)
        return 2
    from expresslane.kernels.gemv import pdl_enabled

    from .bandwidth import copy_bandwidth_gb_s, datasheet_tb_s

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    dev = torch.device("cpu" if args.dry_run else "cuda")
    shape = DRY_SHAPE if args.dry_run else SHAPE
    copy_gb_s = (
        copy_bandwidth_gb_s(dev, nbytes=16 << 20) if args.dry_run else copy_bandwidth_gb_s(dev)
    )
    sheet = datasheet_tb_s(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    pdl = pdl_enabled(torch.empty(1, device=dev))
    print(f"device {name}, {args.dtype}, context {args.context}, "
          f"PDL {args.pdl if pdl else 'off (unsupported)'}, "
          f"copy {copy_gb_s:.0f} GB/s, datasheet {sheet[1] * 1e3 if sheet else float('nan'):.0f}"
          f" GB/s, shapes {shape}", flush=True)  # fmt: skip
    header = f"{'kernel':<14}{'shape':<30}{'MB':>8}{'us':>9}{'GB/s':>8}{'%copy':>7}{'ref us':>9}"
    print(header)
    print("-" * len(header), flush=True)
    results = {}
    for case in _cases(dtype, args.context, str(dev), shape):
        try:
            results[case.name] = _measure(case, args, copy_gb_s)
        except Exception as e:  # one kernel's failure is its row, not the run's end
            results[case.name] = {"shape": case.shape, "error": f"{type(e).__name__}: {e}"}
            print(f"{case.name:<14}{case.shape:<30} ERROR {type(e).__name__}: {e}", flush=True)
            continue
        r = results[case.name]
        print(f"{case.name:<14}{case.shape:<30}{case.nbytes / 1e6:>8.2f}{r['us']:>9.1f}"
              f"{r['gb_s']:>8.0f}{r['pct_copy']:>7.1f}{r['ref_us']:>9.1f}", flush=True)  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"bench": "kernels", "device": name, "dtype": args.dtype,
                      "context": args.context, "pdl": args.pdl if pdl else "off",
                      "copy_gb_s": copy_gb_s,
                      "datasheet_gb_s": sheet[1] * 1e3 if sheet else None,
                      "kernels": results}), flush=True)  # fmt: skip
    return 0


def _measure(case: Case, args, copy_gb_s: float) -> dict:
    """Median time of the fused kernel(s) and of their reference, on independent weights."""
    params = _copies(case.make, case.nbytes, args.reps)
    calls = [functools.partial(case.run, params[i % len(params)]) for i in range(args.reps)]
    ref_calls = [functools.partial(case.run_ref, params[i % len(params)]) for i in range(args.reps)]
    timer = _time_calls if args.dry_run else _time_graph
    t = timer(calls, args.trials)
    try:
        t_ref = timer(ref_calls, args.trials)
    except RuntimeError:  # a reference that cannot be captured: report no time
        t_ref = float("nan")
    gb_s = case.nbytes / t / 1e9
    return {"shape": case.shape, "bytes": case.nbytes, "us": t * 1e6, "gb_s": gb_s,
            "pct_copy": 100 * gb_s / copy_gb_s, "ref_us": t_ref * 1e6}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
