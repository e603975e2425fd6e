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
import dataclasses
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

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


@dataclasses.dataclass(frozen=True)
class Dims:
    """The shapes of one model's fused step (lane-major, as the kernels see them)."""

    name: str
    L: int
    D: int
    HQ: int
    HKV: int
    HD: int
    F: int
    V: int
    MAX_LEN: int
    WINDOW: int | None
    mode: str  # the reduce mode of most layers
    head: str  # lm_head_type
    rope: str


def dims_of(model_ref: str, max_len: int = 4096) -> Dims:
    from ..presets import load_model_config

    cfg = load_model_config(model_ref)
    windows = [cfg.window(i) for i in range(cfg.num_layers) if cfg.window(i)]
    modes = [cfg.reduce_mode(i) for i in range(cfg.num_layers)]
    return Dims(model_ref, cfg.num_lanes, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, max_len,
                min(windows[0], max_len) if windows else None, max(set(modes), key=modes.count),
                cfg.lm_head_type, cfg.rope_style)  # fmt: skip


DRY_DIMS = [  # interpreter-sized: 2 lanes and "past"; 1 lane, GQA 4, head_dim 24, "present"
    Dims("dry-laneformer", 2, 64, 4, 2, 16, 96, 64, 48, 16, "past", "vocab_parallel",
         "interleaved"),
    Dims("dry-llama", 1, 48, 4, 1, 24, 64, 50, 48, None, "present", "replicate", "half"),
]  # fmt: skip


@dataclasses.dataclass
class Case:
    kernel: str  # the tuning name
    label: str
    nbytes: int  # bytes one call must move (S = 1)
    make: Callable[[], dict]  # independent weights (and KV) for one copy
    run: Callable[[dict, int], torch.Tensor]  # (copy, S) -> the kernel's output, (S, ...)
    lone: Callable[[dict, int], torch.Tensor]  # (copy, j) -> token j launched alone
    ref: Callable[[dict, int], torch.Tensor]  # (copy, S) -> kernels/ref.py's output


def _attention_case(d: Dims, name: str, cap: int, win: int | None, ctx: int, q: torch.Tensor,
                    dtype: torch.dtype, dev: str, s_max: int) -> Case:  # fmt: skip
    """Attention of s_max new tokens after ctx - 1 cached positions, on a cache of cap slots."""
    from ..kernels import decode_attention as da
    from ..kernels import ref

    pos0 = ctx - 1
    at = torch.tensor([pos0], dtype=torch.int64, device=dev)

    def kv():
        k = torch.randn(cap, d.HKV, d.HD, device=dev).to(dtype)
        held = torch.arange(max(0, pos0 + s_max - cap), pos0 + s_max, device=dev)
        pos = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        pos[held % cap] = held
        return k, k.clone(), pos

    def lone(p, j):
        k, v, pos = p["kv"]
        pos = torch.where(pos > pos0 + j, -1, pos)  # later tokens not yet written
        return da.decode_attention(q[j], k, v, pos, at + j, window=win)

    e = torch.empty((), dtype=dtype).element_size()
    return Case("attention", f"{name} ctx {ctx} Hq{d.HQ}/Hkv{d.HKV} hd{d.HD}",
                2 * min(ctx, cap) * d.HKV * d.HD * e, lambda: {"kv": kv()},
                lambda p, n: da.decode_attention(q[:n], *p["kv"], at, window=win), lone,
                lambda p, n: ref.decode_attention(q[:n], *p["kv"], at, window=win))  # fmt: skip


def cases(d: Dims, context: int, dtype: torch.dtype, dev: str, s_max: int,
          attn_contexts: list[int]) -> list[Case]:  # fmt: skip
    """One case per kernel of the step at the context (attention at each of attn_contexts);
    inputs for up to s_max tokens."""
    from ..kernels import gemv_reduce as gr
    from ..kernels import lm_head, norm_qkv, ref, swiglu

    L, D, hd, FL = d.L, d.D, d.HD, d.F // d.L
    QL, KL = d.HQ * hd // L, d.HKV * hd // L
    e = torch.empty((), dtype=dtype).element_size()
    pos0 = context - 1

    def w(*shape):
        return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dtype)

    def kv(cap):  # the positions before pos0, the S new ones written as norm_qkv would
        k = torch.randn(cap, d.HKV, hd, device=dev).to(dtype)
        held = torch.arange(max(0, pos0 + s_max - cap), pos0 + s_max, device=dev)
        pos = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        pos[held % cap] = held
        return k, k.clone(), pos

    # made before any capture: a host-to-device copy cannot be captured
    wheres = [torch.tensor([pos0 + j], dtype=torch.int64, device=dev) for j in range(s_max)]

    x = torch.randn(s_max, L, D, device=dev).to(dtype)
    nw = (1 + 0.1 * torch.randn(D, device=dev)).to(dtype)
    ang = torch.arange(pos0 + s_max, device=dev)[:, None] * (
        10000.0 ** (-torch.arange(0, hd, 2, device=dev) / hd))[None, :]  # fmt: skip
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    q = torch.randn(s_max, d.HQ, hd, device=dev).to(dtype)
    ring = d.WINDOW + s_max - 1 if d.WINDOW else None
    out: list[Case] = []

    def qkv(p, xs, where):  # a fresh copy of the cache each call: writes must not accumulate
        cache = [t.clone() for t in p["kv"]]
        return norm_qkv.norm_qkv(xs, nw, p["wq"], p["wk"], p["wv"], cos, sin, where, *cache,
                                 rope_style=d.rope), cache  # fmt: skip

    def qkv_ref(p, n):
        cache = [t.clone() for t in p["kv"]]
        return ref.norm_qkv(x[:n], nw, p["wq"], p["wk"], p["wv"], cos, sin, wheres[0], *cache,
                            rope_style=d.rope)  # fmt: skip

    out.append(Case("norm_qkv", f"L{L} ({QL}+2x{KL}) x {D}", L * (QL + 2 * KL) * D * e,
                    lambda: {"wq": w(L, QL, D), "wk": w(L, KL, D), "wv": w(L, KL, D),
                             "kv": kv(ring or d.MAX_LEN)},
                    lambda p, n: qkv(p, x[:n], wheres[0])[0],
                    lambda p, j: qkv(p, x[j], wheres[j])[0], qkv_ref))  # fmt: skip
    for ctx in attn_contexts:  # splits are fixed cache chunks: time short and long contexts
        for name, cap, win in (("full", d.MAX_LEN, None), ("sliding", ring, d.WINDOW)):
            if cap is not None:
                out.append(_attention_case(d, name, cap, win, ctx, q, dtype, dev, s_max))
    r = torch.randn(s_max, L, D, device=dev).to(dtype)
    past = r.flip(0).contiguous() if d.mode == "past" else None
    for name, k_in in (("wo", QL), ("w2", FL)):
        a = torch.randn(s_max, L, k_in, device=dev).to(dtype)

        def proj(p, n, fn, a=a):
            return fn(a[:n], p["w"], r[:n], None if past is None else past[:n], mode=d.mode)[0]

        out.append(Case(f"gemv_reduce_{d.mode}", f"{name} {d.mode} L{L} {D} x {k_in}",
                        L * D * k_in * e, lambda k_in=k_in: {"w": w(L, D, k_in)},
                        lambda p, n, proj=proj: proj(p, n, gr.gemv_reduce),
                        lambda p, j, a=a: gr.gemv_reduce(
                            a[j], p["w"], r[j], None if past is None else past[j], mode=d.mode)[0],
                        lambda p, n, proj=proj: proj(p, n, ref.gemv_reduce)))  # fmt: skip
    out.append(Case("norm_swiglu", f"L{L} 2x{FL} x {D}", 2 * L * FL * D * e,
                    lambda: {"w1": w(L, FL, D), "w3": w(L, FL, D)},
                    lambda p, n: swiglu.norm_swiglu(x[:n], nw, p["w1"], p["w3"]),
                    lambda p, j: swiglu.norm_swiglu(x[j], nw, p["w1"], p["w3"]),
                    lambda p, n: ref.norm_swiglu(x[:n], nw, p["w1"], p["w3"])))  # fmt: skip
    shape = {"vocab_parallel": (L, d.V // L, D), "lane": (d.V, L * D)}.get(d.head, (d.V, D))
    kw = dict(head_type=d.head)
    out.append(Case("lm_head", f"{d.head} {'x'.join(map(str, shape))}",
                    d.V * (shape[-1] if d.head != "lane" else L * D) * e,
                    lambda: {"w": w(*shape)},
                    lambda p, n: lm_head.lm_head_logits(x[:n], nw, p["w"], **kw),
                    lambda p, j: lm_head.lm_head_logits(x[j], nw, p["w"], **kw),
                    lambda p, n: ref.lm_head_logits(x[:n], nw, p["w"], **kw)))  # fmt: skip
    return out


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
