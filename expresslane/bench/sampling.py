"""What one draw costs, per sampler and per piece: `sampler.sample` on a vocabulary-sized row.

    python -m expresslane.bench.sampling [--vocab 49152] [--scale 6 1] [--device cpu]
                                        [--threads 2] [--repeats 300]

The row is N(0, scale^2) logits with a fixed seed: scale 6 is peaked, as a chat model's next
token is (SmolLM2 had 273 top-p 0.9 candidates of 49,152); scale 1 is flat, where every token
is a top-p candidate. Per scale, the median microseconds of one call over `--repeats` calls
(after 20 untimed), synchronised on a GPU: `sample` under each sampler, then the pieces the
CPU's fast paths replaced beside their references (sampling/sampler.py: the race against the
inverse CDF, the full sort against top-p's candidates, torch's argmax against numpy's, the
whole vocabulary's top-k against the k best). Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..sampling.params import SamplingParams
from ..sampling.sampler import (
    argmax,
    draw,
    filter_logits,
    make_generator,
    race,
    sample,
    top_k_draw,
    top_p_candidates,
    top_p_sorted,
)

SAMPLERS = {
    "greedy": {"temperature": 0.0},
    "temperature 0.8": {},
    "top-p 0.9": {"top_p": 0.9},
    "top-k 40": {"top_k": 40},
    "top-k 40, top-p 0.95": {"top_k": 40, "top_p": 0.95},
    "min-p 0.05": {"min_p": 0.05},
}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median microseconds of one call of fn."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def cases(x: torch.Tensor) -> dict:
    """{name: a call}: each sampler, then each fast piece and its reference."""
    out = {}
    for name, kw in SAMPLERS.items():
        params = SamplingParams(**{"temperature": 0.8, "seed": 0, **kw})
        gen = make_generator(params, x.device)
        out[f"sample: {name}"] = lambda p=params, g=gen: sample(x, p, g)
    gen = make_generator(SamplingParams(temperature=0.8, seed=0), x.device)
    probs = (x / 0.8).softmax(-1)
    top_k = SamplingParams(temperature=0.8, top_k=40)
    out |= {
        "draw: race (reference)": lambda: race(probs, gen),
        "draw: inverse CDF": lambda: draw(probs, gen),
        "top-p 0.9: full sort (reference)": lambda: top_p_sorted(x, 0.9),
        "top-p 0.9: candidates": lambda: top_p_candidates(x, 0.9),
        "argmax: torch (reference)": lambda: x.argmax(-1),
        "argmax: numpy": lambda: argmax(x),
        "top-k 40: whole vocabulary (reference)": lambda: draw(
            filter_logits(x, top_k).softmax(-1), gen
        ),
        "top-k 40: the 40 best": lambda: top_k_draw(x, top_k, None, gen),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.sampling",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--scale", type=float, nargs="+", default=[6.0, 1.0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    if args.vocab < 64 or args.repeats < 1 or args.threads < 1 or min(args.scale) <= 0:
        print("sampling: --vocab at least 64; --repeats, --threads at least 1; --scale "
              "positive", file=sys.stderr)  # fmt: skip
        return 2
    try:
        device = torch.device(args.device)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as e:  # no such device here
        print(f"sampling: --device {args.device}: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows = []
    for scale in args.scale:
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(args.vocab, generator=g) * scale).to(device)
        for name, fn in cases(x).items():
            rows.append({"scale": scale, "case": name, "us": timed(fn, args.repeats, device)})
    names = list(dict.fromkeys(r["case"] for r in rows))
    print("| case | " + " | ".join(f"scale {s:g}, us" for s in args.scale) + " |")
    print("|---|" + "---|" * len(args.scale))
    for n in names:
        cells = " | ".join(f"{r['us']:.1f}" for r in rows if r["case"] == n)
        print(f"| {n} | {cells} |")
    print(json.dumps({"bench": "sampling", "device": str(device), "vocab": args.vocab,
                      "threads": torch.get_num_threads(), "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
