"""Quantized weights on the GPU against bf16: the products, the decode step, gpt-fast's int8/int4.

    python -m expresslane.bench.quant_gpu --preset laneformer-2b [--context 1024]
        [--formats int8 int4 ...] [--gptfast DIR] [--dry-run]

Three parts, one table, one JSON line last:
1. products: one layer's four products (Q/K/V stacked, wo, gate/up stacked, w2) at the
   preset's shapes, bf16 (kernels/gemv.lane_gemv) and each format (kernels/qgemv.qgemv), for 1
   and 4 tokens; each timed as kernels.py times kernels (a CUDA graph of calls over enough weight
   copies to stream from HBM); bytes counted for the format's layout (integers, scales, mins);
   GB/s against a device copy measured in the same run. `layer x` is the format's speed-up of
   the four products over bf16's: the bound on what the format buys.
2. decode: tokens/s of the engine on the preset with random weights at `--context`, bf16 with
   the fused kernels, then each format (`--quantization`: the quantized products inside the
   graph of the model's forward, kernels/qlinear.py), timed by the difference of two greedy runs
   (so prefill and capture drop out); bytes per token from bench/ceiling.py with the projections
   at their quantized size; utilisation = bytes x tokens/s / copy bandwidth.
3. gpt-fast (`--gptfast DIR`): its int8 (per channel) and int4 (groups of 128, tinygemm) on the
   same dims, through bench/peer_gptfast.py.
Targets (issue 27): int4 >= 2.8x and int8 >= 1.7x bf16's decode tokens/s, >= 80% of copy.
`--dry-run`: tiny shapes on the CPU, the kernels in the Triton interpreter, host clocks (the
plumbing, not speed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch

FORMATS = ("int8", "int8-g128", "int4", "int4-g32")


def _shapes(cfg) -> dict[str, tuple[int, int, int]]:
    """(L, O, K) of one layer's four products, as the fused step stacks them."""
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    q, kv, f = cfg.num_heads * hd // L, cfg.num_kv_heads * hd // L, cfg.intermediate_size // L
    return {"qkv": (L, q + 2 * kv, D), "wo": (L, D, q), "w13": (L, 2 * f, D), "w2": (L, D, f)}


def _products(cfg, formats, dev, dry: bool, reps: int, trials: int, copy_gb_s: float):
    """One row per (tokens, matrix, format): time, bytes and bandwidth of one call."""
    from ..kernels.gemv import lane_gemv
    from ..kernels.qgemv import qgemv
    from ..weights.gpu_pack import gpu_format, quantize
    from .kernels import _copies, _time_calls, _time_graph

    timer = _time_calls if dry else _time_graph
    rows = []
    for tokens in (1, 4):
        for name, (L, O, K) in _shapes(cfg).items():
            x = torch.randn(tokens, L, K, device=dev, dtype=torch.bfloat16)

            def bf16(L=L, O=O, K=K):
                return torch.randn(L, O, K, device=dev).to(torch.bfloat16) * K**-0.5

            for fmt in ("bf16", *formats):
                if fmt == "bf16":
                    make, nbytes = bf16, L * O * K * 2

                    def run(w, x=x):  # the bf16 product has no token axis yet: one per token
                        return [lane_gemv(w, x[s]) for s in range(x.shape[0])]
                else:
                    f, g = gpu_format(fmt)
                    make = functools.partial(lambda f, g, mk: quantize(mk(), f, g), f, g, bf16)
                    nbytes = make().nbytes

                    def run(w, x=x):
                        return qgemv(w, x)

                params = _copies(make, nbytes, reps)
                calls = [functools.partial(run, params[i % len(params)]) for i in range(reps)]
                t = timer(calls, trials)
                gb_s = nbytes / t / 1e9
                rows.append({"part": "products", "tokens": tokens, "matrix": name,
                             "shape": f"L{L} {O}x{K}", "format": fmt, "bytes": nbytes,
                             "us": t * 1e6, "gb_s": gb_s,
                             "pct_copy": 100 * gb_s / copy_gb_s})  # fmt: skip
                del params, calls
    return rows


def _layer_speedups(rows: list[dict]) -> dict:
    """Per (tokens, format): the four products' summed time and bf16's over it."""
    total: dict[tuple[int, str], float] = {}
    for r in rows:
        key = (r["tokens"], r["format"])
        total[key] = total.get(key, 0.0) + r["us"]
    return {f"{fmt}@{tok}": {"layer_us": us, "x_bf16": total[(tok, "bf16")] / us}
            for (tok, fmt), us in total.items()}  # fmt: skip


def _decode_tok_s(engine, vocab: int, context: int, tokens: int, dev) -> float:
    """Greedy decode tokens/s: (t(n2) - t(n1)) / (n2 - n1), prefill and capture cancel out."""
    from ..sampling.params import SamplingParams
    from .peers import prompt_ids, sync

    prompt = prompt_ids(vocab, context, dev)[0].tolist()

    def timed(n: int) -> float:
        sync(dev)
        t = time.perf_counter()
        list(engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
        sync(dev)
        return time.perf_counter() - t

    timed(tokens)  # capture and warm up
    short, long = timed(max(1, tokens // 4)), timed(tokens)
    return (tokens - max(1, tokens // 4)) / max(long - short, 1e-9)


def _decode(preset: str, formats, context: int, tokens: int, dev, copy_gb_s: float, dry: bool):
    from ..engine import Engine
    from ..kernels.qlinear import quantize_model, quantized_bytes
    from ..model import Laneformer, init_weights
    from ..presets import get_preset
    from .ceiling import bytes_per_token
    from .decode import fused_kernels

    cfg = get_preset(preset)
    dtype = torch.float32 if dry else torch.bfloat16
    base = bytes_per_token(cfg, context, dtype_bytes=2)
    rows = []
    for fmt in ("bf16", *formats[: 1 if dry else None]):  # dry: one (the interpreter is slow)
        torch.manual_seed(0)
        with torch.device(dev):
            model = init_weights(Laneformer(cfg).to(dtype)).eval()
        nbytes = base["total"]
        if fmt != "bf16":
            quantize_model(model, fmt)
            projections = base["attention"] + base["mlp"] + base["lm_head"]
            nbytes = nbytes - projections + quantized_bytes(model)
        engine = Engine(model, max_model_len=context + tokens + 8, decode="graph",
                        grammar_graphs=False)  # fmt: skip
        tok_s = _decode_tok_s(engine, cfg.vocab_size, context, tokens, dev)
        gb_s = nbytes * tok_s / 1e9
        rows.append({"part": "decode", "format": fmt, "context": context, "tok_s": tok_s,
                     "fused_kernels": fused_kernels(engine), "bytes": nbytes,
                     "gb_s": gb_s, "pct_copy": 100 * gb_s / copy_gb_s})  # fmt: skip
        del engine, model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    ref = rows[0]["tok_s"]
    for r in rows:
        r["x_bf16"] = r["tok_s"] / ref
    return rows


def _gptfast(preset: str, directory: str, context: int, tokens: int, dev, copy_gb_s: float):
    from ..presets import get_preset
    from .ceiling import bytes_per_token
    from .peer_gptfast import GptFast
    from .peers import PeerSetup

    cfg = get_preset(preset)
    kv = bytes_per_token(cfg, context, dtype_bytes=2)["kv"]
    rows = []
    for mode in (None, "int8", "int4"):
        setup = PeerSetup(cfg, None, dev, torch.bfloat16, tokens, 8, context + tokens + 16,
                          arg=directory)  # fmt: skip
        try:
            peer = GptFast(setup, quantization=mode)
            r = peer.measure(context)
            rows.append({"part": "gpt-fast", "format": mode or "bf16", "context": context,
                         "tok_s": r["decode_tok_s"], "bytes": peer.weight_bytes + kv})  # fmt: skip
            peer.close()
        except Exception as e:  # a peer that cannot run here is its row, not the run's end
            rows.append({"part": "gpt-fast", "format": mode or "bf16",
                         "error": f"{type(e).__name__}: {e}"[:300]})  # fmt: skip
    ok = [r for r in rows if "tok_s" in r]
    for r in ok:
        r["gb_s"] = r["bytes"] * r["tok_s"] / 1e9
        r["pct_copy"] = 100 * r["gb_s"] / copy_gb_s
        r["x_bf16"] = r["tok_s"] / ok[0]["tok_s"] if ok[0]["format"] == "bf16" else None
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'part':<9}{'format':<11}{'tok':>4} {'what':<22}{'MB':>9}{'us':>11}{'tok/s':>9}"
          f"{'GB/s':>8}{'%copy':>7}{'x bf16':>8}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['part']:<9}{r['format']:<11}  ERROR {r['error']}")
            continue
        what = f"{r['matrix']} {r['shape']}" if r["part"] == "products" else f"ctx {r['context']}"
        us = f"{r['us']:10.1f}" if "us" in r else f"{'':>10}"
        tok_s = f"{r['tok_s']:9.1f}" if "tok_s" in r else f"{'':>9}"
        x = r.get("x_bf16")
        print(f"{r['part']:<9}{r['format']:<11}{r.get('tokens', 1):>4} {what:<22}"
              f"{r['bytes'] / 1e6:9.2f} {us}{tok_s}{r['gb_s']:8.0f}{r['pct_copy']:7.1f}"
              f"{'' if x is None else f'{x:8.2f}'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.quant_gpu",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--preset", default="laneformer-2b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--gptfast", default=None, help="a gpt-fast checkout: its int8 / int4 rows")
    ap.add_argument("--skip", nargs="*", default=[], choices=["products", "decode"])
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU, kernels in the Triton interpreter")  # fmt: skip
    args = ap.parse_args(argv)
    if args.dry_run:  # before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["EXPRESSLANE_FORCE_TRITON"] = "1"
        args.preset = "laneformer-tiny" if args.preset.startswith("laneformer") else "llama-tiny"
        args.context, args.decode_tokens, args.reps, args.trials = 6, 2, 1, 1
        if args.formats == list(FORMATS):
            args.formats = ["int8", "int4"]
    elif not torch.cuda.is_available():
        print("expresslane.bench.quant_gpu needs a CUDA GPU (none found); --dry-run on a CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    from ..presets import get_preset
    from .bandwidth import copy_bandwidth_gb_s

    dev = torch.device("cpu" if args.dry_run else "cuda")
    copy_gb_s = copy_bandwidth_gb_s(dev, nbytes=16 << 20) if args.dry_run else (
        copy_bandwidth_gb_s(dev))  # fmt: skip
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device {name}, preset {args.preset}, context {args.context}, "
          f"copy {copy_gb_s:.0f} GB/s", flush=True)  # fmt: skip
    torch.manual_seed(0)
    rows: list[dict] = []
    if "products" not in args.skip:
        cfg = get_preset(args.preset)
        rows += _products(cfg, args.formats, dev, args.dry_run, args.reps, args.trials, copy_gb_s)
    if "decode" not in args.skip:
        rows += _decode(args.preset, args.formats, args.context, args.decode_tokens, dev,
                        copy_gb_s, args.dry_run)  # fmt: skip
    if args.gptfast:
        rows += _gptfast(args.preset, args.gptfast, args.context, args.decode_tokens, dev,
                         copy_gb_s)  # fmt: skip
    _print(rows)
    layer = _layer_speedups([r for r in rows if r["part"] == "products"])
    print(json.dumps({"bench": "quant_gpu", "device": name, "preset": args.preset,
                      "context": args.context, "copy_gb_s": copy_gb_s, "layer": layer,
                      "rows": rows}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
