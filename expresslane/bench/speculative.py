"""The speculative decoding benchmark: plain vs prompt-lookup decoding on the shipped workloads.

For each workload (bench/spec_workloads.py) plain and speculative greedy decoding run on the same
weights, interleaved: the order alternates from one run to the next, so that a shared machine's
load falls on both alike. Reported per workload: decode tokens/s of each (tokens after the first
over the time after the first), the speedup, drafted and kept tokens, mean kept per verify step,
and whether the two outputs are identical; where they are not, the index of the first
difference and the plain path's top-2 logit gap there (a near tie, < 1e-5, is the one allowed
difference). Per kind, the geometric mean speedup. One table, then one JSON line.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import torch

from ..config import SamplingParams
from ..engine import Engine
from ..model import Laneformer
from ..speculative import SpeculativeConfig
from .spec_workloads import KINDS, WORKLOADS, Workload


def prompt_ids(tokenizer, w: Workload) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": w.message}])
    return tokenizer.encode(text, add_special_tokens=False)


def _run(engine: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], float, dict]:
    out = list(engine.generate(ids, SamplingParams(max_tokens=max_tokens)))
    return out, engine.stats.decode_tokens_per_s, engine.stats.extra.get("speculative", {})


@torch.inference_mode()
def top2_gap(model: Laneformer, ids: list[int]) -> float:
    """The top-2 logit gap of the next token after `ids` (full forward, no cache)."""
    dev = next(model.parameters()).device
    top = model(torch.tensor([ids], device=dev), last_only=True)[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def bench_workload(plain: Engine, spec: Engine, ids: list[int], w: Workload, repeats: int):
    """Interleaved runs of one workload -> a row (order alternates with the repeat index)."""
    speeds: dict[str, list[float]] = {"plain": [], "spec": []}
    outs: dict[str, list[int]] = {}
    fig: dict = {}
    for r in range(repeats):
        order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
        for which in order:
            out, tps, f = _run(plain if which == "plain" else spec, ids, w.max_tokens)
            speeds[which].append(tps)
            outs[which] = out
            fig = f if which == "spec" else fig
    a, b = outs["plain"], outs["spec"]
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    row = {
        "workload": w.name,
        "kind": w.kind,
        "prompt_tokens": len(ids),
        "tokens": len(a),
        "plain_tok_s": statistics.median(speeds["plain"]),
        "spec_tok_s": statistics.median(speeds["spec"]),
        **{k: fig.get(k) for k in ("draft_tokens", "accepted_tokens", "verify_steps")},
        "mean_accepted_per_verify": fig.get("mean_accepted_per_verify"),
        "identical": diff is None,
    }
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"] if row["plain_tok_s"] else None
    if diff is not None:
        row.update(first_difference=diff, top2_gap=top2_gap(plain.model, ids + a[:diff]))
    return row


def run_speculative_bench(
    model: Laneformer,
    tokenizer,
    cfg: SpeculativeConfig,
    repeats: int = 1,
    workloads: Sequence[Workload] = WORKLOADS,
    **engine_kw,
) -> tuple[list[dict], dict]:
    """(one row per workload, per-kind geometric mean speedups)."""
    prompts = [prompt_ids(tokenizer, w) for w in workloads]
    max_len = max(len(p) + w.max_tokens for p, w in zip(prompts, workloads, strict=True)) + 1
    plain = Engine(model, max_model_len=max_len, **engine_kw)
    spec = Engine(model, max_model_len=max_len, speculative=cfg, **engine_kw)
    for engine in (plain, spec):  # one-time costs (imports, lazy inits) stay out of the rows
        _run(engine, prompts[0][:32], 16)
    rows = [
        bench_workload(plain, spec, p, w, repeats) for p, w in zip(prompts, workloads, strict=True)
    ]
    by_kind = {}
    for kind in KINDS:
        ups = [r["speedup"] for r in rows if r["kind"] == kind and r["speedup"]]
        if ups:
            by_kind[kind] = math.exp(sum(map(math.log, ups)) / len(ups))
    return rows, by_kind


def table(rows: list[dict], by_kind: dict) -> str:
    head = (
        f"{'workload':<12} {'kind':<6} {'prompt':>6} {'tokens':>6} {'plain t/s':>10} "
        f"{'spec t/s':>9} {'speedup':>8} {'drafted':>8} {'kept':>6} {'kept/step':>10} "
        f"{'identical':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        same = "yes" if r["identical"] else f"no@{r['first_difference']} gap {r['top2_gap']:.1e}"
        lines.append(
            f"{r['workload']:<12} {r['kind']:<6} {r['prompt_tokens']:>6} {r['tokens']:>6} "
            f"{r['plain_tok_s']:>10.2f} {r['spec_tok_s']:>9.2f} {r['speedup']:>7.2f}x "
            f"{r['draft_tokens']:>8} {r['accepted_tokens']:>6} "
            f"{r['mean_accepted_per_verify'] or 0:>10.2f} {same:>10}"
        )
    means = ", ".join(f"{k} {v:.2f}x" for k, v in by_kind.items())
    lines.append(f"geometric mean speedup: {means}")
    return "\n".join(lines)
