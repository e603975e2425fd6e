"""`expresslane bench`: TTFT, prefill and decode tokens/s against a transformers peer.

A preset builds random weights of a real shape; a folder benchmarks that checkpoint. One table,
then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from ..bench.bandwidth import copy_bandwidth_gb_s, datasheet_tb_s
from ..bench.ceiling import bytes_per_token
from ..bench.decode import BenchConfig, run_bench
from ..checkpoint import load_config, resolve_device, resolve_model_dir
from ..presets import get_preset, preset_names

HELP = "benchmark time to first token, prefill and batch-1 decode speed (with a peer baseline)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (or use --preset)")
    p.add_argument(
        "--preset",
        default=None,
        help=f"random weights of a real shape: {', '.join(preset_names())}",
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--no-peer", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--peer-compile",
        action="store_true",
        help="also run transformers with its static cache and torch.compile",
    )
    p.add_argument(
        "--compile", action="store_true", help="also run our engine with the compiled step"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for both engines (default: the rule of `run --threads`)",
    )
    p.add_argument("--json", action="store_true", help="print only the JSON line")


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _table(rows: list[dict]) -> str:
    head = (
        f"{'engine':<30} {'model':<36} {'ctx':>6} {'TTFT ms':>9} {'prefill t/s':>12} "
        f"{'decode t/s':>11} {'ms/tok':>8} {'GB/tok':>8} {'GB/s':>8} {'x peer':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        gb = f"{r['bytes_per_token'] / 1e9:8.4f}" if "bytes_per_token" in r else f"{'':>8}"
        gbs = f"{r['achieved_gb_s']:8.1f}" if "achieved_gb_s" in r else f"{'':>8}"
        ratio = f"{r['speedup_vs_peer']:7.2f}" if "speedup_vs_peer" in r else f"{'':>7}"
        lines.append(
            f"{r['engine']:<30} {str(r['model'])[:36]:<36} {r['context']:>6} "
            f"{r['ttft_ms']:9.1f} {r['prefill_tok_s']:12.1f} {r['decode_tok_s']:11.1f} "
            f"{1e3 / r['decode_tok_s']:8.2f} {gb} {gbs} {ratio}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.preset is None):
        from ..errors import ConfigError

        raise ConfigError("give either a checkpoint folder or --preset NAME")
    checkpoint = None
    if args.preset:
        model_cfg = get_preset(args.preset)
    else:
        checkpoint = resolve_model_dir(args.model)
        model_cfg = load_config(checkpoint)
    device = resolve_device(args.device)
    cfg = BenchConfig(
        contexts=tuple(args.contexts),
        decode_tokens=args.decode_tokens,
        device=str(device),
        dtype=args.dtype,
        peer=not args.no_peer,
        peer_compile=args.peer_compile,
        compile=args.compile,
    )
    if device.type == "cpu":  # the same thread count for our engine and the peer
        nbytes = bytes_per_token(model_cfg, 1, dtype_bytes=4)["weights"]
        threads = args.threads or min(os.cpu_count() or 1, max(1, nbytes // (128 << 20)))
        torch.set_num_threads(threads)
    copy_gb_s = copy_bandwidth_gb_s(device)
    sheet = datasheet_tb_s(device)
    rows = run_bench(model_cfg, cfg, checkpoint)
    for r in rows:
        r["copy_bw_util"] = r.get("achieved_gb_s", 0) / copy_gb_s if "achieved_gb_s" in r else None
        if sheet and "achieved_gb_s" in r:
            r["datasheet_bw_util"] = r["achieved_gb_s"] / (sheet[1] * 1e3)
        peer = next(
            (p for p in rows if p["engine"] == "transformers" and p["context"] == r["context"]),
            None,
        )
        if r["engine"].startswith("expresslane") and peer:
            r["speedup_vs_peer"] = r["decode_tok_s"] / peer["decode_tok_s"]
    summary = {
        "model": args.preset or str(checkpoint),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "copy_gb_s": round(copy_gb_s, 1),
        "datasheet_tb_s": sheet[1] if sheet else None,
        "commit": _commit(),
        "rows": rows,
    }
    if not args.json:
        print(_table(rows))
        print(
            f"copy bandwidth {copy_gb_s:.1f} GB/s (read+write) on {summary['device_name']}"
            + (f"; datasheet {sheet[0]} {sheet[1]} TB/s" if sheet else "")
        )
    print(json.dumps(summary, default=lambda x: round(x, 4) if isinstance(x, float) else str(x)))
    return 0
