"""`expresslane ceiling`: bytes per token, bandwidth ceiling, and predicted TP vs DTP tokens/s.

Prints one table (one column per --context), then the same figures as one JSON line, last, so
scripts can read `tail -n 1`. With --json only the JSON object is printed. The arithmetic lives in
expresslane/bench/ceiling.py; this file only parses flags and formats.
"""

from __future__ import annotations

import argparse
import json

from ..bench.ceiling import GPUS, ceiling, get_gpu, moe_projections
from ..presets import load_model_config, preset_names

HELP = "bandwidth ceiling and predicted batch-1 tokens/s of a model on a GPU node"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="laneformer-2b",
        help=f"preset ({', '.join(preset_names())}), checkpoint folder or "
        "config.json (default: laneformer-2b)",
    )
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)} (default h100)")
    parser.add_argument("--count", type=int, default=1, help="GPUs in the node (default 1)")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="TB/s",
        help="aggregate bandwidth of all --count GPUs, overriding the preset "
        "(e.g. 30.7, Kog's effective 8x H200 figure)",
    )
    parser.add_argument(
        "--context",
        type=int,
        nargs="+",
        default=[1024],
        metavar="T",
        help="context length(s) in tokens, counting the current one (default 1024)",
    )
    parser.add_argument(
        "--dtype-bytes",
        type=int,
        default=2,
        help="bytes per weight and KV element (default 2: bf16/fp16)",
    )
    parser.add_argument(
        "--message-latency-us",
        type=float,
        default=3.0,
        help="latency of one cross-GPU message (default 3.0, KCCL-class)",
    )
    parser.add_argument(
        "--kernel-overhead-us",
        type=float,
        default=0.0,
        help="dead time per kernel (default 0: persistent monokernel)",
    )
    parser.add_argument(
        "--kernels-per-layer", type=int, default=10, help="kernels per decoder layer (default 10)"
    )
    parser.add_argument(
        "--mbu",
        type=float,
        default=0.36,
        help="bandwidth utilization for --moe (default 0.36, Kog's)",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="also print Kog's published MoE projections, published vs computed",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON object")


def _bytes(n: int) -> str:
    return f"{n:,} B"


def _rate(p: dict | None) -> str:
    return "n/a" if p is None else f"{p['tok_s']:,.0f} tok/s ({p['token_us']:.1f} us)"


# (label, how to read one cell from a ceiling() result)
_ROWS = [
    ("weights: attention", lambda r: _bytes(r["bytes"]["attention"])),
    ("weights: MLP", lambda r: _bytes(r["bytes"]["mlp"])),
    ("weights: LM head", lambda r: _bytes(r["bytes"]["lm_head"])),
    ("weights: norms", lambda r: _bytes(r["bytes"]["norms"])),
    ("weights: embedding row", lambda r: _bytes(r["bytes"]["embedding_row"])),
    ("weights total", lambda r: _bytes(r["bytes"]["weights"])),
    ("KV cache read", lambda r: _bytes(r["bytes"]["kv"])),
    ("total per token", lambda r: _bytes(r["bytes"]["total"])),
    ("per device: shard", lambda r: _bytes(r["bytes"]["per_device"]["shard"])),
    ("per device: weights", lambda r: _bytes(r["bytes"]["per_device"]["weights"])),
    ("per device: KV", lambda r: _bytes(r["bytes"]["per_device"]["kv"])),
    ("per device: total", lambda r: _bytes(r["bytes"]["per_device"]["total"])),
    ("ceiling (aggregate bandwidth)", lambda r: f"{r['ceiling_tok_s']:,.0f} tok/s"),
    ("ceiling (busiest device)", lambda r: f"{r['device_ceiling_tok_s']:,.0f} tok/s"),
    ("stream time per token", lambda r: f"{r['stream_us']:.1f} us"),
    ("predicted, immediate all-reduce", lambda r: _rate(r["tp"])),
    ("predicted, DTP", lambda r: _rate(r["dtp"])),
]


def _table(results: list[dict]) -> list[str]:
    cols = [[f"T={r['context']}"] + [cell(r) for _, cell in _ROWS] for r in results]
    width = max(len(label) for label, _ in _ROWS)
    lines = []
    for i, label in enumerate([""] + [label for label, _ in _ROWS]):
        cells = "".join(f"  {col[i]:>24}" for col in cols)
        lines.append(f"{label:<{width}}{cells}")
    return lines


def _moe_table(rows: list[dict], mbu: float) -> list[str]:
    lines = [
        f"MoE projections at {mbu:.0%} MBU (Kog's table; 8x H200 at 30.7 TB/s, "
        "8x MI300X at 33.6 TB/s)",
        f"{'model':<20}{'active':>8}{'precision':>11}{'GB/token':>10}"
        f"{'H200 pub':>10}{'computed':>10}{'MI300X pub':>12}{'computed':>10}",
    ]
    for r in rows:
        (ph, pm), (ch, cm) = r["published"], r["computed"]
        lines.append(
            f"{r['model']:<20}{r['active_params_b']:>7g}B{r['precision']:>11}"
            f"{r['active_gb']:>10g}{ph:>10,}{ch:>10,.0f}{pm:>12,}{cm:>10,.0f}"
        )
    for r in rows:  # rows whose published figures the precision label alone does not explain
        (nh, nm), (ch, _) = r["nominal"], r["computed"]
        if abs(nh / ch - 1) > 0.05:
            lines.append(
                f"  {r['model']}: at {r['precision']} throughout it would be {nh:,.0f} / "
                f"{nm:,.0f} tok/s; GB/token is what the published figures imply"
            )
    return lines


def main(args: argparse.Namespace) -> int:
    cfg = load_model_config(args.model)
    gpu = get_gpu(args.gpu)
    results = [
        ceiling(
            cfg,
            gpu,
            args.count,
            bandwidth=args.bandwidth,
            context=t,
            dtype_bytes=args.dtype_bytes,
            message_latency_us=args.message_latency_us,
            kernel_overhead_us=args.kernel_overhead_us,
            kernels_per_layer=args.kernels_per_layer,
        )
        for t in args.context
    ]
    out = {"model": args.model, "gpu": args.gpu.lower(), "count": args.count, "results": results}
    if args.moe:
        out["moe"] = moe_projections(args.mbu)
    if not args.json:
        r0 = results[0]
        print(
            f"{args.model} on {args.count}x {r0['gpu']}: {r0['bandwidth_tb_s']:.2f} TB/s "
            f"aggregate ({r0['device_bandwidth_tb_s']:.3g} TB/s per device), "
            f"{args.dtype_bytes}-byte weights and KV, message latency "
            f"{args.message_latency_us:g} us{' (unused on 1 GPU)' if args.count == 1 else ''}"
        )
        print("\n".join(_table(results)))
        if args.moe:
            print()
            print("\n".join(_moe_table(out["moe"], args.mbu)))
    print(json.dumps(out))
    return 0
