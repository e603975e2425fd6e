"""Sweep of the fused kernels' launch variants at a model's real shapes: the tuning table.

    python -m expresslane.bench.sweep [--model laneformer-2b llama-3.2-1b] [--context 1024]
        [--attention-contexts 128 1024 4000] [--tokens 1 4] [--reps 30] [--trials 10]
        [--kernels NAME ...] [--only KEY ...] [--table OUT.json] [--budget SECONDS] [--dry-run]
    python -m expresslane.bench.sweep --install OUT/sweep.json   (after a GPU session)

For each model and each kernel of its fused step (norm_qkv, attention full / sliding, the wo
and w2 projections with their reduce, norm_swiglu, the head), every prepared variant of VARIANTS
(tile sizes, splits, PREFETCH, warps, stages: a dict over the kernel's default configuration,
forced through kernels/tuning.forcing) is first checked, then timed:
- checked: its output against kernels/ref.py (bf16 tolerance), and each row of an S-token launch
  against a launch of that token alone, bit for bit (batch invariance, on the device it runs on);
  a variant that fails either, or that the shape rejects, is reported and never wins;
- timed at S = 1 and S = k + 1 tokens (`--tokens`) as bench/kernels.py times (CUDA graph of
  `reps` calls on independent weights, median of `trials` replays).
Attention is timed at several contexts (`--attention-contexts`, 128 1024 4000): its splits are
fixed chunks of the cache, so one configuration must serve short and long contexts alike. The
winner of each kernel and shape (the cases sharing a key scored by their total) is the checked
variant fastest at S = 1 (the plain step) among those within 3% of the default at the widest S,
and 2% faster than the default at S = 1 (MIN_GAIN: smaller gains flip between runs).
The winners, keyed as the kernels look them up (tuning.shape_key), are the JSON line's
"table" (and `--table` FILE) in the format of kernels/tuning/<gpu>.json; `--install` writes
the stage's table there: commit it, and the kernels read it at load, so the next run starts
from it.

`--dry-run`: small shapes on the CPU, the kernels in the Triton interpreter, every variant
checked (the plumbing and the variants' correctness, not their speed): what CI runs.
One table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from .sweep_cases import DRY_DIMS, Case, cases, dims_of

# Variants per kernel: each is applied over the kernel's default configuration. BLOCK_K and
# BLOCK_N change a row's summation order (not its batch invariance: the key holds no S).
VARIANTS: dict[str, list[dict]] = {
    "norm_qkv": [{}, {"PREFETCH": 1}, {"BLOCK_P": 4}, {"BLOCK_P": 16}, {"BLOCK_K": 128},
                 {"num_warps": 8}, {"num_stages": 3}],
    "attention": [{}, {"NUM_SPLITS": 8}, {"NUM_SPLITS": 32}, {"NUM_SPLITS": 64},
                  {"NUM_SPLITS": 128}, {"BLOCK_N": 8}, {"BLOCK_N": 32}, {"num_warps": 2},
                  {"num_warps": 8}, {"PREFETCH": 1}, {"PREFETCH": 1, "NUM_SPLITS": 32},
                  {"BLOCK_C": 16},
                  {"NUM_SPLITS": 64, "num_warps": 2}],
    "gemv_reduce_past": [{}, {"PREFETCH": 1}, {"BLOCK_O": 8}, {"BLOCK_O": 32},
                         {"BLOCK_K": 128}, {"num_warps": 8}, {"num_stages": 3}],
    "gemv_reduce_present": [{}, {"PREFETCH": 1}, {"BLOCK_O": 8}, {"SPLIT_K": 2},
                            {"SPLIT_K": 4}, {"num_warps": 8}],
    "norm_swiglu": [{}, {"PREFETCH": 1}, {"BLOCK_O": 4}, {"BLOCK_O": 16}, {"BLOCK_K": 128},
                    {"num_warps": 8}, {"num_stages": 3}],
    "lm_head": [{}, {"BLOCK_V": 8}, {"BLOCK_V": 16}, {"BLOCK_V": 64, "BLOCK_K": 64},
                {"num_warps": 8}],
}  # fmt: skip
SLACK = 1.03  # a winner may cost at most 3% more than the default at the widest S
# and must beat the default at S = 1 by 2%: two H200 sweeps of the same code (2026-11-27) swapped
# winners that were 0.2-1.6% ahead, so smaller gains are noise that a table must not carry
MIN_GAIN = 0.02


def check(case: Case, p: dict, n: int, dtype: torch.dtype) -> tuple[str, bool]:
    """(key the kernel looked up, exact): raises AssertionError when the variant is wrong."""
    from ..kernels import tuning

    with tuning.watching() as seen:
        got = case.run(p, n)
    key = next(k for kern, k in seen if kern == case.kernel)
    want = case.ref(p, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().clamp_min(1e-6).item()
    assert err <= tol * scale, f"max diff {err:.3g} > {tol} * {scale:.3g}"
    exact = all(torch.equal(got[j], case.lone(p, j)) for j in range(n))
    return key, exact


def sweep_case(case: Case, args, dtype, dev: str) -> list[dict]:
    """Every variant of the case's kernel: checked, then timed at each S of --tokens."""
    from ..kernels import tuning
    from .kernels import _copies, _time_graph

    rows = []
    params = _copies(case.make, case.nbytes, args.reps)
    for variant in VARIANTS[case.kernel]:
        if args.only and variant and not set(args.only) & set(variant):
            continue  # --only: the default and the variants that set one of these keys
        row = {"kernel": case.kernel, "case": case.label, "variant": variant}
        with tuning.forcing(case.kernel, variant):
            try:
                t = time.perf_counter()
                row["key"], row["exact"] = check(case, params[0], max(args.tokens), dtype)
                checked = time.perf_counter() - t
                for n in args.tokens:
                    if dev == "cpu":  # the interpreter: the check's seconds (plumbing, no speed)
                        row[f"us_s{n}"] = checked * 1e6
                        continue
                    calls = [functools.partial(case.run, params[i % len(params)], n)
                             for i in range(args.reps)]  # fmt: skip
                    row[f"us_s{n}"] = _time_graph(calls, args.trials) * 1e6
            except (AssertionError, RuntimeError, ValueError) as e:  # the shape rejects it
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def winners(rows: list[dict], tokens: list[int]) -> dict[str, dict[str, dict]]:
    """{kernel: {key: variant}}. The cases sharing a kernel and key (attention at several
    contexts) are scored together: the exact variant with the least total time at S =
    tokens[0] among those within SLACK of the default's total at the widest S, and that ran
    every case; no entry where the default wins."""
    lo, hi = f"us_s{tokens[0]}", f"us_s{tokens[-1]}"
    groups: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for r in rows:
        if "key" in r:
            var = json.dumps(r["variant"], sort_keys=True)
            groups.setdefault((r["kernel"], r["key"]), {}).setdefault(var, []).append(r)
    table: dict[str, dict[str, dict]] = {}
    for (kernel, key), by_var in groups.items():
        n_cases = max(len(v) for v in by_var.values())
        ok = {v: rs for v, rs in by_var.items() if len(rs) == n_cases
              and all("error" not in r and r["exact"] for r in rs)}  # fmt: skip
        if "{}" not in ok:
            continue
        total = {v: (sum(r[lo] for r in rs), sum(r[hi] for r in rs)) for v, rs in ok.items()}
        fit = [v for v in ok if total[v][1] <= SLACK * total["{}"][1]]
        best = min(fit, key=lambda v: total[v][0])
        if best != "{}" and total[best][0] <= (1 - MIN_GAIN) * total["{}"][0]:
            table.setdefault(kernel, {})[key] = json.loads(best)
    return table


def install(result_path: str) -> int:
    """kernels/tuning/<gpu>.json from a sweep stage's result file (or a `--table` file), merged
    over the one there (a kernel and shape measured again replaces its entry)."""
    from ..kernels import tuning

    try:
        doc = json.loads(Path(result_path).read_text())
        if "kernels" not in doc:  # a stage's result: its rows judged by the rules of today
            res = doc["result"]
            doc = {**res["table"], "kernels": winners(res["rows"], res["tokens"])}
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        print(f"error: {result_path}: no sweep table ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    path = tuning.TABLES / f"{tuning.slug(doc['gpu'])}.json"
    old = json.loads(path.read_text()) if path.is_file() else {"kernels": {}}
    for kernel, entries in doc["kernels"].items():
        old["kernels"].setdefault(kernel, {}).update(entries)
    merged = {**doc, "kernels": old["kernels"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.sweep",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--model", nargs="+", default=["laneformer-2b", "llama-3.2-1b"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--attention-contexts", type=int, nargs="+", default=[128, 1024, 4000],
                    help="contexts attention variants are timed at (scored together)")  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4],
                    help="token counts S to time (the first picks the winner)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--table", default=None, help="write the winners here (tuning JSON)")
    ap.add_argument("--kernels", nargs="+", default=None, choices=sorted(VARIANTS),
                    help="sweep only these kernels")  # fmt: skip
    ap.add_argument("--only", nargs="+", default=None, metavar="KEY",
                    help="only the default and the variants setting one of these keys "
                    "(PREFETCH, NUM_SPLITS, ...)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds: start no new case after this, and still write the table of "
                    "the cases swept (a device call's limit cuts the stage otherwise)")  # fmt: skip
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--install", metavar="SWEEP_JSON", default=None,
                    help="write the table of a sweep stage's result (OUT/sweep.json) or of a "
                    "--table file to "
                    "kernels/tuning/<gpu>.json, merged over the one there; no sweep")  # fmt: skip
    args = ap.parse_args(argv)
    if args.install:
        return install(args.install)
    if args.dry_run:  # before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["EXPRESSLANE_FORCE_TRITON"] = "1"
        args.context, args.reps, args.trials = min(args.context, 20), 1, 1
        # the ring of the dry shapes wraps at 40: the variants are checked where it has wrapped
        # (the ring not yet full: the default configuration, in tests/test_kernels.py)
        args.attention_contexts = [40]
    elif not torch.cuda.is_available():
        print("expresslane.bench.sweep needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    from ..errors import ExpressLaneError
    from ..kernels import MAX_TOKENS

    if not all(1 <= n <= MAX_TOKENS for n in args.tokens):
        print(f"error: --tokens {args.tokens}: each in 1..{MAX_TOKENS}", file=sys.stderr)
        return 2
    dev = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    try:
        dims = DRY_DIMS if args.dry_run else [dims_of(m) for m in args.model]
    except ExpressLaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu (Triton interpreter)"
    torch.manual_seed(0)
    rows: list[dict] = []
    s_cols = "".join(f"{'us S=' + str(n):>10}" for n in args.tokens)
    print(f"sweep on {gpu}, context {args.context}, tokens {args.tokens}")
    print(f"{'model':<16}{'case':<34}{'variant':<30}{'exact':>6}{s_cols}")
    start, skipped = time.monotonic(), []
    for d in dims:
        ctxs = [c for c in args.attention_contexts if c + max(args.tokens) <= d.MAX_LEN]
        for case in cases(d, args.context, dtype, dev, max(args.tokens), ctxs):
            if args.kernels and case.kernel not in args.kernels:
                continue
            if args.budget is not None and time.monotonic() - start > args.budget:
                skipped.append(f"{d.name} {case.label}")
                continue
            for r in sweep_case(case, args, dtype, dev):
                r["model"] = d.name
                rows.append(r)
                var = json.dumps(r["variant"], separators=(",", ":")) if r["variant"] else "default"
                times = "".join(f"{r.get(f'us_s{n}', float('nan')):>10.1f}" for n in args.tokens)
                note = f"  {r['error']}" if "error" in r else ""
                print(f"{d.name:<16}{case.label[:33]:<34}{var[:29]:<30}"
                      f"{str(r.get('exact', '-')):>6}{times}{note}", flush=True)  # fmt: skip
    import triton

    doc = {"gpu": gpu, "triton": triton.__version__, "context": args.context,
           "tokens": args.tokens, "kernels": winners(rows, args.tokens)}  # fmt: skip
    if args.table:
        with open(args.table, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
    failed = [r for r in rows if "error" in r and not r["variant"]]  # a default that fails
    inexact = [r for r in rows if "error" not in r and not r["exact"]]
    print(json.dumps({"bench": "sweep", "device": gpu, "context": args.context,
                      "tokens": args.tokens, "variants": len(rows),
                      "rejected": sum("error" in r for r in rows), "inexact": len(inexact),
                      "defaults_failed": len(failed), "skipped": skipped, "table": doc,
                      "rows": rows}))  # fmt: skip
    return 1 if failed or inexact else 0


if __name__ == "__main__":
    sys.exit(main())
