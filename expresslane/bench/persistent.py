"""The persistent decode step against the fused step, at a preset's shapes (issue 23, item 3).

    python -m expresslane.bench.persistent [--preset laneformer-2b] [--contexts 1024 128 4000]
        [--programs-per-sm 2 4] [--chunks 1 4] [--warps 2 4] [--deps phase lane]
        [--steps 16] [--trials 5] [--dry-run]

On the preset's random weights (bf16 on a GPU) with `context` positions in the cache (random
keys and values, the positions a prefill would leave, rings included), for each context:
- **checked**: the logits and the greedy pick of one step, persistent against fused from the
  same cache (bitwise, else the largest difference), the counts of waits that gave up, and for
  each warp count once, a verify of 4 tokens against 4 lone steps (bitwise: the batch
  invariance exact speculation needs, of the compiled build);
- **timed**: a CUDA graph of `--steps` greedy steps (each writes the same slot, so the cache
  does not grow), replayed `--trials` times: the fused step (77 launches a step for the 2B) and
  the persistent step (one launch a step) at each programs-per-SM, chunk (the tasks a program
  takes from the queue at once), warp count and form of waits (whole phases, or each lane's own
  chain: step/persistent_tasks.py). Tasks come from a queue, so any grid is correct; the sm_90
  build keeps 4 programs of 2 warps an SM resident, or 3 of 4 (`python -m
  expresslane.kernels.aot --persistent`).
GB/s counts the bytes a step must read (bench/ceiling.py: weights once, the scanned KV) and
%copy sets them against a copy measured in the same run. One table, then one JSON line.
--dry-run runs a narrowed laneformer-tiny (DRY_MODEL), or llama-tiny for a one-lane preset, on
the CPU through the Triton interpreter, timed by a host clock: the wiring, not a figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

from ..cache import KVCache
from ..config import ModelConfig
from ..errors import ExpressLaneError
from ..presets import load_model_config, preset_hf_dict

# --dry-run's model: laneformer-tiny's layout (rings, delay 2: past-mode layers whose lanes meet
# only through partials, a vocab-parallel head) at a quarter of its width, for the interpreter.
DRY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_lanes": 4, "vocab_size": 128,
             "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 16}  # fmt: skip
DRY_LLAMA = {"num_lanes": 1, "sliding_window": None}  # a one-lane preset's dry run: llama-tiny


def fill_cache(cache: KVCache, context: int, seed: int = 0) -> None:
    """Positions 0 .. context-1 as a prefill leaves them (rings hold the last cap), random K/V."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    for k, v, pos in zip(cache.k, cache.v, cache.pos, strict=True):
        cap = k.shape[0]
        held = torch.arange(max(0, context - cap), context)
        pos.fill_(-1)
        pos[held % cap] = held.to(pos.device)
        k.copy_((torch.randn(k.shape, generator=g) * 0.5).to(k.dtype))
        v.copy_((torch.randn(v.shape, generator=g) * 0.5).to(v.dtype))


def _snapshot(cache: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.k + cache.v + cache.pos]


def _restore(cache: KVCache, snap: list[torch.Tensor]) -> None:
    for t, s in zip(cache.k + cache.v + cache.pos, snap, strict=True):
        t.copy_(s)


def check(fused, persistent, cache: KVCache, position: torch.Tensor) -> dict:
    """One step from the same cache both ways: logits and picks equal, waits that gave up."""
    token = torch.tensor([3], device=position.device)
    snap = _snapshot(cache)
    want = fused.forward(token, position)
    want_pick = fused.pick(token, position)
    _restore(cache, snap)
    try:
        got = persistent.forward(token, position)
        got_pick = persistent.pick(token, position)
    except RuntimeError as e:  # its waits gave up (step/persistent.py): the row says so
        _restore(cache, snap)
        return {"bitwise": False, "max_diff": float("nan"), "same_pick": False,
                "failed_waits": max(1, persistent.errors()), "error": str(e)}  # fmt: skip
    _restore(cache, snap)
    return {"bitwise": bool(torch.equal(want, got)),
            "max_diff": float((want - got).abs().max()),
            "same_pick": bool(torch.equal(want_pick, got_pick)),
            "failed_waits": persistent.errors()}  # fmt: skip


def rows_are_lone_steps(persistent, cache: KVCache, position: torch.Tensor, width: int = 4) -> bool:
    """A verify of `width` tokens against as many lone steps from the same cache, bitwise: the
    batch invariance that makes greedy speculation plain decoding (the compiled build's)."""
    tokens = torch.tensor([3, 9, 4, 7, 1, 8, 2, 6][:width], device=position.device)
    snap = _snapshot(cache)
    wide = persistent.forward(tokens, position)
    _restore(cache, snap)
    lone = torch.cat([persistent.forward(tokens[j : j + 1], position + j) for j in range(width)])
    _restore(cache, snap)
    return bool(torch.equal(wide, lone))


def seconds_per_step(step, steps: int, trials: int, gpu: bool) -> float:
    from .kernels import _time_calls, _time_graph

    calls = [step] * steps
    return _time_graph(calls, trials) if gpu else _time_calls(calls, trials)


def measure(args) -> dict:
    from ..checkpoint import resolve_device
    from ..step.fused import FusedDecoder
    from ..step.persistent import PersistentDecoder
    from .bandwidth import copy_bandwidth_gb_s
    from .ceiling import bytes_per_token
    from .weights import random_model

    if args.dry_run:
        llama = DRY_LLAMA if args.dry_base == "llama-tiny" else {}
        cfg = ModelConfig.from_hf_dict({**preset_hf_dict(args.dry_base), **DRY_MODEL, **llama})
    else:
        cfg = load_model_config(args.preset)
    dev = resolve_device(args.device)
    gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    model = random_model(cfg, dev, dtype)
    cache = KVCache(cfg, max(args.contexts) + 8, dev, dtype, headroom=7)  # as the engine
    fused = FusedDecoder(model, cache, kernels=True)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if gpu else 1
    copy = copy_bandwidth_gb_s(dev) if gpu else None
    token = torch.tensor([3], device=dev)
    rows = []
    for ctx in args.contexts:
        fill_cache(cache, ctx)
        position = torch.tensor([ctx], device=dev)
        nbytes = bytes_per_token(cfg, ctx + 1, torch.finfo(dtype).bits // 8)["total"]
        variants = [("fused", fused, None)]
        for per_sm, chunk, warps, deps in itertools.product(
            args.programs_per_sm, args.chunks, args.warps, args.deps
        ):
            step = PersistentDecoder(model, cache, programs=per_sm * sms, chunk=chunk,
                                     deps=deps, warps=warps)  # fmt: skip
            variants.append((f"persistent x{per_sm} c{chunk} w{warps} {deps}", step, per_sm))
        checked_rows = set()  # one verify check per warp count (a compile each)
        for name, step, per_sm in variants:
            row = {"context": ctx, "step": name, "programs": None if per_sm is None
                   else per_sm * sms}  # fmt: skip
            if per_sm is not None:
                row.update(check(fused, step, cache, position))
                if step.warps not in checked_rows and not row["failed_waits"]:
                    checked_rows.add(step.warps)
                    row["rows_are_lone_steps"] = rows_are_lone_steps(
                        step, cache, position, 2 if args.dry_run else 4
                    )  # the interpreter's dry run: 2 rows, a step of 2 s each
                if row["failed_waits"]:  # a broken launch's time says nothing
                    rows.append(row | {"us_per_step": None, "tok_s": None, "gb_s": None,
                                       "pct_copy": None})  # fmt: skip
                    continue
            if per_sm is None:
                run = lambda s=step, p=position: s.pick(token, p)  # noqa: E731
            else:
                run = lambda s=step, p=position: s.run(token, p, True)  # noqa: E731
            sec = seconds_per_step(run, args.steps, args.trials, gpu)
            gb_s = nbytes / sec / 1e9
            row.update(us_per_step=sec * 1e6, tok_s=1 / sec, gb_s=gb_s,
                       pct_copy=100 * gb_s / copy if copy else None)  # fmt: skip
            rows.append(row)
    return {"device": torch.cuda.get_device_name(dev) if gpu else "cpu (interpreter)",
            "copy_gb_s": copy, "rows": rows}  # fmt: skip


def _line(r: dict) -> str:
    if r["us_per_step"] is None:
        return (
            f"{r['context']:>6} {r['step']:<30}{r['programs']:>9}  not timed: "
            f"{r['failed_waits']} waits gave up (max diff {r['max_diff']:.1e})"
        )
    pct = f"{r['pct_copy']:.0f}%" if r["pct_copy"] is not None else "-"
    ok = "-" if "bitwise" not in r else (
        "bitwise" if r["bitwise"] else f"diff {r['max_diff']:.1e}") + (
        "" if r.get("same_pick", True) else " PICK DIFFERS") + (
        f" {r['failed_waits']} FAILED WAITS" if r.get("failed_waits") else "") + (
        "" if "rows_are_lone_steps" not in r else "; verify rows = lone steps"
        if r["rows_are_lone_steps"] else "; VERIFY ROWS DIFFER")  # fmt: skip
    return (f"{r['context']:>6} {r['step']:<30}{r['programs'] or '-':>9}{r['us_per_step']:>10.1f}"
            f"{r['tok_s']:>9.0f}{r['gb_s']:>8.0f}{pct:>7}  {ok}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.persistent",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--preset", default="laneformer-2b")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 128, 4000])
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 4],
                    help="tasks a program takes from the queue at once")  # fmt: skip
    ap.add_argument(
        "--warps",
        type=int,
        nargs="+",
        default=[2, 4],
        help="warps a program (2: batch-invariant; step/persistent.py WARPS)",
    )
    ap.add_argument(
        "--deps",
        nargs="+",
        default=["phase", "lane"],
        choices=["phase", "lane"],
        help="what a task waits for: the whole previous phase, or its lane's",
    )
    ap.add_argument("--steps", type=int, default=16, help="greedy steps in one timed graph")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dry-run", action="store_true", help="laneformer-tiny on the CPU")
    args = ap.parse_args(argv)
    if args.dry_run:  # before triton is first imported
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("error: --dry-run runs the kernels in the interpreter, and triton was imported "
                  "without it", file=sys.stderr)  # fmt: skip
            return 2
        try:
            one_lane = load_model_config(args.preset).num_lanes == 1  # the preset's family
        except ExpressLaneError as e:  # refused before the environment is touched
            print(f"error: {e}", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["EXPRESSLANE_FORCE_TRITON"] = "1"
        args.dry_base = "llama-tiny" if one_lane else "laneformer-tiny"
        args.preset, args.device, args.contexts = f"{args.dry_base} (narrowed)", "cpu", [24]
        args.programs_per_sm, args.chunks, args.steps, args.trials = [2], [3], 1, 1
        args.deps, args.warps = ["lane"], [2]
    if min(args.contexts + args.programs_per_sm + args.chunks + args.warps
           + [args.steps, args.trials]) < 1:  # fmt: skip
        print("error: --contexts, --programs-per-sm, --chunks, --warps, --steps and --trials "
              "must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        m = measure(args)
    except ExpressLaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    copy = f"{m['copy_gb_s']:.0f} GB/s" if m["copy_gb_s"] else "not measured"
    print(f"{args.preset} on {m['device']}, copy {copy}, {args.steps} steps a graph")
    print(f"{'ctx':>6} {'step':<30}{'programs':>9}{'us/step':>10}{'tok/s':>9}{'GB/s':>8}"
          f"{'%copy':>7}  vs fused")  # fmt: skip
    for r in m["rows"]:
        print(_line(r))
    print(json.dumps({"bench": "persistent", "preset": args.preset, **m}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
