"""The DTP ablation: one model size, one data set, one token budget, five ways to wire the lanes.

Variants (laneformer.md 5.2-5.3; every one is the `ablation` preset with 8 lanes and 6 layers):
- tp: standard tensor parallelism, every layer `present` (broadcast_delay = num_layers, so no
  layer reaches the `past` mode; use_comm stays true).
- no_comm: use_comm=false with delay 2: layers 0-1 `present`, then lanes never talk again.
- dtp1, dtp2: DTP with delay 1 and 2 (layers < d `present`, the rest `past`).
- dtp2_lane_norms: DTP delay 2 with per-lane RMSNorm scales (replicated_rmsn_scale=false).

Each (variant, seed) trains from scratch with the same TrainConfig; the seed sets both the
initial weights and the batch order. Writes docs/dtp-ablation.md (table) and
docs/dtp-ablation.png (validation loss against tokens). Finished runs are reused, so an
interrupted ablation picks up where it stopped. Regenerate with:

    python -m expresslane.train.ablation --steps 60 --seeds 0 1 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from ..config import ModelConfig
from .data import TokenStream, prepare
from .trainer import MODEL_PRESETS, TrainConfig, train

VARIANTS = {
    "tp": {"broadcast_delay": 6},
    "no_comm": {"broadcast_delay": 2, "use_comm": False},
    "dtp1": {"broadcast_delay": 1},
    "dtp2": {"broadcast_delay": 2},
    "dtp2_lane_norms": {"broadcast_delay": 2, "replicated_rmsn_scale": False},
}
LABELS = {
    "tp": "standard TP (every layer present)",
    "no_comm": "lanes, no communication",
    "dtp1": "DTP, delay 1",
    "dtp2": "DTP, delay 2",
    "dtp2_lane_norms": "DTP, delay 2, per-lane norms",
}


def run(
    variants: list[str],
    seeds: list[int],
    steps: int,
    run_root: Path,
    data_dir: Path,
    seq_len: int = 128,
    micro_batch: int = 8,
) -> dict:
    """Train every (variant, seed); return {variant: {seed: list of log records}}."""
    prep = prepare(data_dir)
    stream = TokenStream(prep.train, seq_len)
    val = TokenStream(prep.val, seq_len).eval_windows(48)
    nbytes = torch.from_numpy(prep.nbytes)
    logs: dict = {}
    for seed in seeds:  # every variant's first seed first, so partial results are comparable
        for v in variants:
            raw = {**MODEL_PRESETS["ablation"], **VARIANTS[v], "vocab_size": len(prep.nbytes)}
            cfg = TrainConfig(
                run_dir=str(run_root / f"{v}-s{seed}"),
                seq_len=seq_len,
                micro_batch=micro_batch,
                max_steps=steps,
                lr=3e-3,
                warmup_steps=max(1, steps // 20),
                decay_frac=0.2,
                eval_every=max(1, steps // 4),
                ckpt_every=steps,
                seed=seed,
                progress=False,
            )
            print(f"[ablation] {v} seed {seed}", file=sys.stderr, flush=True)
            train(ModelConfig.from_hf_dict(raw), stream, cfg, val, nbytes)
            lines = (Path(cfg.run_dir) / "log.jsonl").read_text().splitlines()
            recs = [json.loads(x) for x in lines]
            # a resumed run may have logged a step twice: keep the last record of each step
            logs.setdefault(v, {})[seed] = list({r["step"]: r for r in recs}.values())
    return logs


def _final(recs: list[dict], key: str) -> float:
    return [r[key] for r in recs if key in r][-1]


def table(logs: dict) -> str:
    """Final validation loss and bits per byte: mean ± sample std over seeds, and vs tp."""
    rows = [
        "| variant | wiring | seeds | val loss (nats/token) | vs tp | val bits/byte "
        "| per seed (loss) |",
        "|---|---|---|---|---|---|---|",
    ]
    final = {v: [_final(r, "val_loss") for r in s.values()] for v, s in logs.items()}
    base = statistics.mean(final["tp"]) if "tp" in final else None
    for v, by_seed in logs.items():
        losses = final[v]
        bpbs = [_final(r, "val_bpb") for r in by_seed.values()]
        spread = f" ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        delta = f"{statistics.mean(losses) - base:+.4f}" if base is not None else "-"
        rows.append(
            f"| {v} | {LABELS[v]} | {len(losses)} | {statistics.mean(losses):.4f}{spread} | "
            f"{delta} | {statistics.mean(bpbs):.4f} | "
            + ", ".join(f"{x:.4f}" for x in losses)
            + " |"
        )
    return "\n".join(rows)


def write_table(path: Path, text: str) -> None:
    """Replace the table between the markers of an existing page, or start the page."""
    begin, end = "<!-- table -->", "<!-- /table -->"
    page = path.read_text() if path.is_file() else f"# DTP ablation\n\n{begin}\n{end}\n"
    head, _, rest = page.partition(begin)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def plot(logs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, (v, by_seed) in enumerate(logs.items()):
        curves = [
            {r["tokens"]: r["val_loss"] for r in recs if "val_loss" in r}
            for recs in by_seed.values()
        ]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        ys = torch.tensor([[c[x] for x in xs] for c in curves])  # (seeds, points)
        ax.plot(xs, ys.mean(0), color=f"C{i}", label=f"{LABELS[v]} ({len(curves)} seeds)")
        ax.fill_between(xs, ys.min(0).values, ys.max(0).values, color=f"C{i}", alpha=0.2)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("DTP ablation: 8 lanes, 6 layers (line: seed mean, band: min-max)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--run-root", default="runs/ablation")
    p.add_argument("--data-dir", default="runs/corpus")
    p.add_argument("--docs", default="docs")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logs = run(args.variants, args.seeds, args.steps, Path(args.run_root), Path(args.data_dir))
    docs = Path(args.docs)
    docs.mkdir(exist_ok=True)
    write_table(docs / "dtp-ablation.md", table(logs))
    plot(logs, docs / "dtp-ablation.png")
    print(table(logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
