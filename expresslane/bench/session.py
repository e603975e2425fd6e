"""The GPU session's bookkeeping: each stage's result as JSON, and the call's summary.

scripts/gpu_session.sh runs every stage under `timeout`, its whole output teed to
`$OUT/<stage>.log`; then `result` turns that log into `$OUT/<stage>.json`, whatever happened:

- `rc`, `seconds`, `timed_out` (rc 124 or 137: the stage ran past its limit);
- `rows`: every `{"row": ...}` line a benchmark printed as it measured (kept when it was killed);
- `result`: the stage's last JSON line (its summary), None when it never got that far;
- `tests`: pytest's verdict per test (from `-v` lines: kept when it was killed) and the counts;
- `tail`: the last lines of a stage that failed.

`summary` prints one line per stage from those files: the line the call's reply shows last.
Only the standard library: it must work when torch itself does not.

    python -m expresslane.bench.session result STAGE LOG RC SECONDS LIMIT > STAGE.json
    python -m expresslane.bench.session summary OUT STAGE...
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

_TEST = re.compile(r"^(\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_PYTEST_END = re.compile(r"^=+ (.+) in [\d.]+s")


def _json_objects(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


def _tests(lines: list[str]) -> dict | None:
    verdicts = {m.group(1): m.group(2) for m in map(_TEST.match, lines) if m}
    if not verdicts:
        return None
    counts: dict[str, int] = {}
    for v in verdicts.values():
        counts[v.lower()] = counts.get(v.lower(), 0) + 1
    end = next((m.group(1) for m in map(_PYTEST_END.match, reversed(lines)) if m), None)
    failed = sorted(t for t, v in verdicts.items() if v in ("FAILED", "ERROR"))
    return {"counts": counts, "failed": failed, "summary": end, "verdicts": verdicts}


def result(stage: str, log: Path, rc: int, seconds: float, limit: float) -> dict:
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    objs = _json_objects(lines)
    rows = [o["row"] for o in objs if set(o) == {"row"}]
    final = next((o for o in reversed(objs) if set(o) != {"row"}), None)
    out = {"stage": stage, "rc": rc, "ok": rc == 0, "seconds": seconds, "limit_s": limit,
           "timed_out": rc in (124, 137), "complete": final is not None, "rows": rows,
           "result": final}  # fmt: skip
    tests = _tests(lines)
    if tests is not None:
        out["tests"] = tests
    if rc != 0:
        out["tail"] = lines[-40:]
    return out


def headline(res: dict) -> str:
    """One line for a stage's result: what it found."""
    r = res.get("result") or {}
    if "tests" in res:
        t = res["tests"]
        failed = f"; failed: {', '.join(t['failed'][:5])}" if t["failed"] else ""
        return f"{t['counts']}{failed}"
    if res["stage"] == "smoke" and r:
        checks = [k for k, v in r.items() if isinstance(v, dict) and v.get("ok") is False]
        return "all checks ok" if r.get("ok") else f"FAILED: {', '.join(checks)}"
    if res["rows"]:
        return _bench_line(res["rows"])
    if r.get("bench") == "quant_gpu":
        return _quant_line(r)
    if r.get("bench") == "ttft":
        return "; ".join(f"{x['engine']} ctx {x['context']}: first {x['first_ms']:.1f} ms, "
                         f"steady {x['steady_ms']:.1f} ms" for x in r["summary"]
                         if "first_ms" in x)  # fmt: skip
    if r.get("bench") == "structured":
        return "; ".join(f"{x['mode']} {x['decode_tok_s']:.1f} tok/s ({x['vs_unconstrained']:.3f}x)"
                         for x in r["rows"])  # fmt: skip
    if r.get("bench") == "spec_replay":
        k1 = max(r["verify_ms"], key=int)
        kinds = ", ".join(f"{k} {v:.2f}x" for k, v in r["by_kind"].items())
        cost = r["verify_ms"][k1] / r["plain_ms"]
        return f"replayed {kinds}; a verify of {k1} rows {cost:.2f}x a step"
    if r.get("bench") == "barrier":  # the best µs per boundary of each form, every grid
        best: dict[str, float] = {}
        for x in r["rows"]:
            if x.get("us_per_boundary") is not None and x["variant"] != "stream":
                best[x["variant"]] = min(best.get(x["variant"], 1e9), x["us_per_boundary"])
        bad = sum(1 for x in r["rows"] if not x.get("ok"))
        return ", ".join(f"{k} {v:.2f} us/boundary" for k, v in best.items()) + (
            f"; {bad} rows not ok" if bad else "")  # fmt: skip
    if r.get("bench") == "persistent":  # per context: fused, then the best persistent grid
        out = []
        for ctx in dict.fromkeys(x["context"] for x in r["rows"]):
            rows = [x for x in r["rows"] if x["context"] == ctx]
            fused = next(x for x in rows if x["step"] == "fused")
            timed = [x for x in rows if x["step"] != "fused" and x["tok_s"]]
            if not timed:
                out.append(f"ctx {ctx}: fused {fused['tok_s']:.0f} tok/s, persistent FAILED")
                continue
            best = max(timed, key=lambda x: x["tok_s"])
            same = all(x.get("bitwise") and not x.get("failed_waits") for x in rows[1:])
            out.append(
                f"ctx {ctx}: fused {fused['tok_s']:.0f}, {best['step']} "
                f"{best['tok_s']:.0f} tok/s" + ("" if same else " (NOT EQUAL)")
            )
        return "; ".join(out)
    if r.get("bench") == "sweep":
        won = sum(len(v) for v in r["table"]["kernels"].values())
        return (f"{r['variants']} variants, {r['rejected']} rejected, {r['inexact']} not "
                f"batch-invariant; {won} winners over the defaults")  # fmt: skip
    if r.get("kernels") and isinstance(r["kernels"], dict):  # bench.kernels
        return ", ".join(f"{k} {v['gb_s']:.0f} GB/s" for k, v in r["kernels"].items()
                         if "gb_s" in v)  # fmt: skip
    if "total" in r:  # bench.profile
        t = r["total"]
        return (f"{t['us_per_step']:.0f} us/step, kernels {t['kernel_us_per_step']:.0f} us, "
                f"gaps {t['gap_us_per_step']:.0f} us")  # fmt: skip
    return "no result" if not r else "done"


def _bench_line(rows: list[dict]) -> str:
    """The first context's figures: every row's tok/s, then ours over each peer."""
    ctx = rows[0]["context"]
    here = [r for r in rows if r["context"] == ctx]
    parts = []
    for r in here:
        if "error" in r:
            parts.append(f"{r['engine']} ERROR")
            continue
        util = r.get("copy_bw_util")
        parts.append(f"{r['engine']} {r['decode_tok_s']:.1f} tok/s"
                     + (f" ({util:.0%} of copy)" if util else ""))  # fmt: skip
    ok = [r for r in here if "decode_tok_s" in r]
    ours = next((r for r in ok if r["engine"].startswith("expresslane")), None)
    peers = [r for r in ok if not r["engine"].startswith("expresslane")]
    ratios = [f"{ours['decode_tok_s'] / p['decode_tok_s']:.2f}x {p['engine']}" for p in peers]
    tail = f"; {ours['engine']} = " + ", ".join(ratios) if ours and ratios else ""
    return f"ctx {ctx}: " + ", ".join(parts) + tail


def _quant_line(r: dict) -> str:
    """bench.quant_gpu: decode tok/s per format (x bf16, % of copy), the products' speed-ups."""
    parts = []
    for row in r["rows"]:
        if row["part"] == "products":
            continue
        who = ("" if row["part"] == "decode" else "gpt-fast ") + row["format"]
        if "error" in row:
            parts.append(f"{who} ERROR")
        else:
            parts.append(f"{who} {row['tok_s']:.0f} tok/s ({row['x_bf16'] or 0:.2f}x, "
                         f"{row['pct_copy']:.0f}% of copy)")  # fmt: skip
    layer = [f"{k} {v['x_bf16']:.2f}x" for k, v in r.get("layer", {}).items()
             if not k.startswith("bf16")]  # fmt: skip
    return "; ".join(parts) + (f"; products per layer: {', '.join(layer)}" if layer else "")


def summary(out: Path, stages: list[str]) -> str:
    lines = []
    for stage in stages:
        path = out / f"{stage}.json"
        try:
            res = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            lines.append(f"{stage:<9} no result file ({type(e).__name__})")
            continue
        state = "ok" if res["ok"] else "TIMEOUT" if res["timed_out"] else f"rc={res['rc']}"
        lines.append(f"{stage:<9} {state:<7} {res['seconds']:>5.0f}s  {headline(res)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) == 6 and argv[0] == "result":
        stage, log, rc, seconds, limit = argv[1:]
        res = result(stage, Path(log), int(rc), float(seconds), float(limit))
        print(json.dumps(res, default=str))
        return 0
    if len(argv) >= 2 and argv[0] == "summary":
        print(summary(Path(argv[1]), argv[2:]))
        return 0
    print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
