"""The speculative decoding benchmark: plain vs prompt-lookup decoding on the shipped workloads,
and, where a workload carries one, plain decoding given its predicted output (OpenAI's
Predicted Outputs: the plain engine drafts from it, no --speculative-config).

For each workload (bench/spec_workloads.py) plain and speculative greedy decoding run on the same
weights, interleaved: the order alternates from one run to the next, so that a shared machine's
load falls on both alike. Reported per workload: decode tokens/s of each (tokens after the first
over the time after the first) and their ratio; the same ratio in CPU time per decoded token (the
process's CPU seconds, which leave out the time other jobs held the cores of a shared machine);
drafted and kept tokens, mean kept per verify step; whether the two outputs are identical, and
where they are not, the index of the first difference and the plain path's top-2 logit gap
there (a near tie, < 1e-5, is the one allowed difference). Per kind, the geometric mean
speedups. Then what one verify step costs against one plain step, by its number of rows (what
spec_decode.DRAFT_COST is set from). One table, then one JSON line.

Both engines are built as `run` builds them on the device (the CLI passes its decode mode and
packed weights): on a CPU the plain path is the packed decode step, and speculation verifies on
the same packed weights, so the speedup is against what users get without speculation.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch

from ..engine import Engine
from ..model import Laneformer
from ..sampling.params import SamplingParams
from ..speculative.drafting import SpeculativeConfig
from .spec_workloads import KINDS, WORKLOADS, Workload


def prompt_ids(tokenizer, w: Workload) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": w.message}])
    return tokenizer.encode(text, add_special_tokens=False)


def _run(engine: Engine, ids: list[int], max_tokens: int, prediction: tuple[int, ...] = ()):
    """Greedy tokens and figures: decode tokens/s (wall) and CPU seconds per decoded token."""
    out, cpu = [], []
    params = SamplingParams(max_tokens=max_tokens, prediction=prediction)
    for step in engine.generate_steps(ids, params):
        out.append(step.token)
        cpu.append(time.process_time())
    n = len(out) - 1
    return out, {
        "tok_s": engine.stats.decode_tokens_per_s,
        "cpu_ms": (cpu[-1] - cpu[0]) / n * 1e3 if n > 0 else None,
        "spec": engine.stats.extra.get("speculative", {}),
    }


@torch.inference_mode()
def top2_gap(model: Laneformer, ids: list[int]) -> float:
    """The top-2 logit gap of the next token after `ids` (full forward, no cache)."""
    dev = next(model.parameters()).device
    top = model(torch.tensor([ids], device=dev), last_only=True)[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def bench_workload(plain: Engine, spec: Engine, ids: list[int], w: Workload, repeats: int,
                   prediction: tuple[int, ...] = ()):  # fmt: skip
    """Interleaved runs of one workload -> a row (order alternates with the repeat index). With
    a `prediction` (the workload's, tokenized) a third way: the plain engine given it."""
    ways = {"plain": (plain, ()), "spec": (spec, ())}
    if prediction:
        ways["pred"] = (plain, prediction)
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    outs: dict[str, list[int]] = {}
    for r in range(repeats):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for which in order:
            engine, pred = ways[which]
            outs[which], f = _run(engine, ids, w.max_tokens, pred)
            runs[which].append(f)
    fig = runs["spec"][-1]["spec"]

    def median(which: str, key: str) -> float | None:
        values = [f[key] for f in runs[which] if f[key] is not None]
        return statistics.median(values) if values else None

    a, b = outs["plain"], outs["spec"]
    diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    row = {
        "workload": w.name,
        "kind": w.kind,
        "prompt_tokens": len(ids),
        "tokens": len(a),
        "plain_tok_s": median("plain", "tok_s"),
        "spec_tok_s": median("spec", "tok_s"),
        "plain_cpu_ms_per_tok": median("plain", "cpu_ms"),
        "spec_cpu_ms_per_tok": median("spec", "cpu_ms"),
        **{k: fig.get(k) for k in ("draft_tokens", "accepted_tokens", "verify_steps")},
        "mean_accepted_per_verify": fig.get("mean_accepted_per_verify"),
        "identical": diff is None,
    }
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"] if row["plain_tok_s"] else None
    cpu = row["plain_cpu_ms_per_tok"], row["spec_cpu_ms_per_tok"]
    row["cpu_speedup"] = cpu[0] / cpu[1] if cpu[0] and cpu[1] else None
    if diff is not None:
        row.update(first_difference=diff, top2_gap=top2_gap(plain.model, ids + a[:diff]))
    if prediction:
        got = runs["pred"][-1]["spec"]
        row.update(pred_tok_s=median("pred", "tok_s"), pred_identical=outs["pred"] == a,
                   pred_tokens=len(prediction),
                   accepted_prediction_tokens=got["accepted_prediction_tokens"],
                   rejected_prediction_tokens=got["rejected_prediction_tokens"])  # fmt: skip
        row["pred_speedup"] = row["pred_tok_s"] / row["plain_tok_s"] if row["plain_tok_s"] else None
    return row


@torch.inference_mode()
def verify_cost(engine: Engine, ids: list[int], k: int, repeats: int = 7) -> dict:
    """What a verify step over S = 1 .. k + 1 rows costs, in plain decode steps, on the paths
    this engine takes (its step for both: the packed step on a CPU, the fused one on a GPU,
    else the model's forward), each the minimum of `repeats` timings after a warm-up, the cache
    put back after each. `per_extra_row` is the least-squares slope over S: the decoder's
    DRAFT_COST (speculative/decoder.py).
    """
    cache = engine.cache
    engine.prefill(ids)
    pos = len(ids)
    graph = engine.captures.graph_for(SamplingParams()) if engine.decode == "graph" else None
    tokens = (ids * (k + 1))[: k + 1]
    at = torch.tensor([pos], device=engine.device)

    def plain():
        if graph is not None:
            graph.load(torch.tensor(ids[-1], device=engine.device), position=pos)
            graph.run()
        else:
            engine.model(torch.tensor([ids[-1:]], device=engine.device), cache=cache)

    def verify(S: int):
        cache.live = pos + S  # what a verify graph bounds the scan to
        try:
            engine.step.forward(torch.tensor(tokens[:S], device=engine.device), at).argmax(-1)
        finally:
            cache.live = None

    def best(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            fn()
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            cache.truncate(pos)  # the rows written are forgotten
        return min(times[1:])

    step = best(plain)
    rows = list(range(1, k + 2))
    rel = [best(lambda S=S: verify(S)) / step for S in rows]
    mean_s, mean_r = statistics.fmean(rows), statistics.fmean(rel)
    slope = sum((s - mean_s) * (r - mean_r) for s, r in zip(rows, rel, strict=True)) / sum(
        (s - mean_s) ** 2 for s in rows
    )
    return {
        "path": f"{engine.step_name} step, the same for S rows",
        "plain_step_ms": round(step * 1e3, 3),
        "rows": rows,
        "relative": [round(r, 3) for r in rel],
        "per_extra_row": round(slope, 3),
    }


def run_speculative_bench(
    model: Laneformer,
    tokenizer,
    cfg: SpeculativeConfig,
    repeats: int = 1,
    workloads: Sequence[Workload] = WORKLOADS,
    **engine_kw,
) -> tuple[list[dict], dict, dict]:
    """(one row per workload, per-kind geometric mean speedups, verify_cost figures)."""
    prompts = [prompt_ids(tokenizer, w) for w in workloads]
    max_len = max(len(p) + w.max_tokens for p, w in zip(prompts, workloads, strict=True)) + 1
    plain = Engine(model, max_model_len=max_len, **engine_kw)
    spec = Engine(model, max_model_len=max_len, speculative=cfg, **engine_kw)
    for engine in (plain, spec):  # one-time costs (imports, lazy inits) stay out of the rows
        _run(engine, prompts[0][:32], 16)
    preds = [
        tuple(tokenizer.encode(w.prediction, False)) if w.prediction else () for w in workloads
    ]
    rows = [bench_workload(plain, spec, p, w, repeats, pred)
            for p, w, pred in zip(prompts, workloads, preds, strict=True)]  # fmt: skip
    by_kind = {}
    for kind in KINDS:
        for key in ("speedup", "cpu_speedup", "pred_speedup"):
            ups = [r[key] for r in rows if r["kind"] == kind and r.get(key)]
            if ups:
                by_kind.setdefault(kind, {})[key] = math.exp(sum(map(math.log, ups)) / len(ups))
    cost = verify_cost(spec, prompts[0], cfg.num_speculative_tokens)
    return rows, by_kind, cost


def _pred_cells(r: dict) -> str:
    """The prediction's columns: tokens/s, speedup over plain, kept / drafted from it ("same"
    unless its output differs from plain's, which would be a bug: it is marked)."""
    if "pred_tok_s" not in r:
        return ""
    kept = f"{r['accepted_prediction_tokens']}/"
    kept += f"{r['accepted_prediction_tokens'] + r['rejected_prediction_tokens']}"
    mark = "" if r["pred_identical"] else " DIFFERS"
    return f" {r['pred_tok_s']:>8.2f} {r['pred_speedup']:>5.2f}x {kept:>9}{mark}"


def spec_table(rows: list[dict], by_kind: dict, cost: dict | None = None) -> str:
    head = (
        f"{'workload':<11} {'kind':<5} {'prompt':>6} {'tokens':>6} {'plain t/s':>9} "
        f"{'spec t/s':>8} {'speedup':>7} {'cpu x':>6} {'drafted':>7} {'kept':>5} "
        f"{'kept/step':>9} {'identical':>9} {'pred t/s':>8} {'pred x':>6} {'pred kept':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        same = "yes" if r["identical"] else f"no@{r['first_difference']} gap {r['top2_gap']:.1e}"
        cpu = f"{r['cpu_speedup']:5.2f}x" if r["cpu_speedup"] else f"{'':>6}"
        lines.append(
            f"{r['workload']:<11} {r['kind']:<5} {r['prompt_tokens']:>6} {r['tokens']:>6} "
            f"{r['plain_tok_s']:>9.2f} {r['spec_tok_s']:>8.2f} {r['speedup']:>6.2f}x {cpu} "
            f"{r['draft_tokens']:>7} {r['accepted_tokens']:>5} "
            f"{r['mean_accepted_per_verify'] or 0:>9.2f} {same:>9}" + _pred_cells(r)
        )
    means = ", ".join(
        f"{k} {v['speedup']:.2f}x (cpu time {v.get('cpu_speedup', 0):.2f}x"
        + (f"; prediction {v['pred_speedup']:.2f}x)" if "pred_speedup" in v else ")")
        for k, v in by_kind.items()
    )
    lines.append(f"geometric mean speedup: {means}")
    if cost:
        pairs = zip(cost["rows"], cost["relative"], strict=True)
        rel = ", ".join(f"{s}: {r:.2f}" for s, r in pairs)
        lines.append(
            f"{cost['path']}: verify of S rows in plain steps ({cost['plain_step_ms']:.2f} ms) "
            f"{rel}; per extra row {cost['per_extra_row']:.3f}"
        )
    return "\n".join(lines)
