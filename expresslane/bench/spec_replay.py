"""Speculation at a preset's shapes on a GPU, replayed from acceptance recorded on real weights.

    python -m expresslane.bench.spec_replay [--trace FILE] [--preset laneformer-2b]
        [--context 1024] [--reps 50] [--device auto] [--dry-run]

Greedy speculative output is the plain step's by construction (batch-invariant steps), so which
drafts are kept depends on the model and the text, not on the device. FILE is the last line of
`expresslane bench MODEL --speculative-config ... --threads 1` run on a CPU (per workload:
tokens, verify steps, kept drafts); the default is the committed trace of SmolLM2-135M with
k = 5 (traces/, its command in BENCHMARKS.md). No trained weights of the 2B exist, so the GPU
cannot run the real model; what it can measure is what each step costs there.

The preset's engine (random weights, graphs captured as `run` captures them) times, with
--context tokens in its cache: t1, a plain decode replay (the decode stream reads tokens a
replay behind, so no sync per step), and t(w), a verify replay of width w = 2 .. k + 1 with its
host copy (the speculative loop reads each verify's result). A workload's speculative time is
then (plain tokens) t1 + (verify steps) t(k + 1), against (decoded tokens) t1 plainly: the
replayed speedup. It is a replay (device step times times recorded acceptance), not a run of
the real model, and it leaves out the host's drafting (microseconds a step). Issue 25 asks for
edits >= 2.5x and free text >= 0.98x at the 2B's shapes. One table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from ..engine import Engine
from ..errors import ExpressLaneError
from ..presets import load_model_config
from ..sampling.params import SamplingParams
from ..step.graph import DecodeGraph

TRACES = Path(__file__).parent / "traces"
DEFAULT_TRACE = TRACES / "smollm2-ngram-k5.json"
_FIELDS = {"workload", "kind", "tokens", "verify_steps", "accepted_tokens"}


def trace_rows(obj) -> list[dict]:
    """The per-workload rows of a speculative bench's JSON line, wherever they sit in it."""
    if isinstance(obj, dict):
        return [r for v in obj.values() for r in trace_rows(v)]
    if isinstance(obj, list):
        if obj and all(isinstance(r, dict) and _FIELDS <= set(r) for r in obj):
            return obj
        return [r for v in obj for r in trace_rows(v)]
    return []


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def plain_ms(graph: DecodeGraph, pos: int, reps: int) -> float:
    """One plain decode replay, streamed as the engine streams them (no sync between)."""
    token = torch.zeros((), dtype=torch.long, device=graph.token.device)
    for _ in range(3):  # lazy work outside the clock
        graph.load(token, pos)
        graph.run()
    _sync(graph.token.device)
    t = time.perf_counter()
    for _ in range(reps):
        graph.load(token, pos)  # the same slot each time: the cache does not grow
        graph.run()
    _sync(graph.token.device)
    return (time.perf_counter() - t) / reps * 1e3


def verify_ms(graph: DecodeGraph, pos: int, reps: int) -> float:
    """One verify replay with its host copy, as the speculative loop runs it."""
    drafts = list(range(1, graph.width))
    graph.load_drafts(0, drafts, pos)
    graph.capture_buckets([graph.live()])  # off the clock, as the engine captures at load
    for _ in range(3):
        graph.load_drafts(0, drafts, pos)
        graph.run().tolist()
    t = time.perf_counter()
    for _ in range(reps):
        graph.load_drafts(0, drafts, pos)
        graph.run().tolist()
    return (time.perf_counter() - t) / reps * 1e3


def replay(rows: list[dict], t1: float, tv: float) -> list[dict]:
    """Each workload's replayed speedup from its recorded acceptance and the step times."""
    out = []
    for r in rows:
        decoded = r["tokens"] - 1  # the first token comes from the prefill
        steps, kept = r["verify_steps"] or 0, r["accepted_tokens"] or 0
        plain_tokens = max(0, decoded - steps - kept)
        spec = plain_tokens * t1 + steps * tv
        out.append({"workload": r["workload"], "kind": r["kind"], "decoded": decoded,
                    "verify_steps": steps, "kept": kept,
                    "speedup": decoded * t1 / spec if spec > 0 else None})  # fmt: skip
    return out


def by_kind(rows: list[dict]) -> dict[str, float]:
    """Geometric mean of the replayed speedups per workload kind."""
    kinds: dict[str, list[float]] = {}
    for r in rows:
        if r["speedup"]:
            kinds.setdefault(r["kind"], []).append(r["speedup"])
    return {k: math.exp(sum(map(math.log, v)) / len(v)) for k, v in kinds.items()}


def measure(preset: str, device: str, dtype: str, context: int, k: int, reps: int) -> dict:
    """t1 and t(w) for w = 2 .. k + 1 on the preset's random-weight engine at `context`."""
    from ..checkpoint import resolve_device, resolve_dtype
    from .peers import prompt_ids
    from .weights import random_model

    cfg = load_model_config(preset)
    dev = resolve_device(device)
    model = random_model(cfg, dev, resolve_dtype(dtype, cfg, dev))
    engine = Engine(model, max_model_len=context + 2 * (k + 1) + 8, decode="graph",
                    prefill_warmup=False, grammar_graphs=False)  # fmt: skip
    engine.prefill(prompt_ids(cfg.vocab_size, context, torch.device("cpu"))[0].tolist())
    greedy = SamplingParams(temperature=0.0)
    t1 = plain_ms(engine.captures.graph_for(greedy), context, reps)
    widths = {}
    for w in range(2, k + 2):
        graph = DecodeGraph(engine.step, greedy, width=w, capture=engine.capture)
        widths[w] = verify_ms(graph, context, reps)
    return {"device": str(dev), "step": engine.step_name, "captured": engine.capture,
            "plain_ms": t1, "verify_ms": widths}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.spec_replay",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--preset", default="laneformer-2b")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens of the trace")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--dry-run", action="store_true", help="laneformer-tiny on the CPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.preset, args.device, args.dtype = "laneformer-tiny", "cpu", "float32"
        args.context, args.reps = min(args.context, 24), 3
    try:
        rows = trace_rows(json.loads(args.trace.read_text().strip().splitlines()[-1]))
    except (OSError, ValueError, IndexError) as e:
        print(f"error: --trace {args.trace}: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: --trace {args.trace}: no speculative rows (workload, kind, tokens, "
              "verify_steps, accepted_tokens) in its last line", file=sys.stderr)  # fmt: skip
        return 2
    if min(args.context, args.k, args.reps) < 1:
        print("error: --context, --k and --reps must be >= 1", file=sys.stderr)
        return 2
    try:
        m = measure(args.preset, args.device, args.dtype, args.context, args.k, args.reps)
    except ExpressLaneError as e:  # an unknown preset, a device that is not here
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1, tv = m["plain_ms"], m["verify_ms"][args.k + 1]
    out = replay(rows, t1, tv)
    kinds = by_kind(out)
    print(
        f"{args.preset} on {m['device']} ({m['step']}, captured {m['captured']}), ctx "
        f"{args.context}: plain step {t1:.3f} ms; verify by width "
        + ", ".join(f"{w}: {ms:.3f} ms ({ms / t1:.2f}x)" for w, ms in m["verify_ms"].items())
    )
    print(f"{'workload':<24}{'kind':>7}{'decoded':>9}{'verifies':>10}{'kept':>6}{'replayed':>10}")
    for r in out:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['workload']:<24}{r['kind']:>7}{r['decoded']:>9}{r['verify_steps']:>10}"
              f"{r['kept']:>6}{sp:>10}")  # fmt: skip
    print("by kind (geometric mean): " + ", ".join(f"{k} {v:.2f}x" for k, v in kinds.items()))
    print(json.dumps({"bench": "spec_replay", "preset": args.preset, "context": args.context,
                      "trace": args.trace.name, **m, "rows": out, "by_kind": kinds}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
