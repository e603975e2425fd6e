"""What an embedding costs against the prefill of the same tokens as a prompt.

    python -m expresslane.bench.embeddings [MODEL] [--lengths 64 256 1000] [--repeats 3]

`/v1/embeddings` (serve/embeddings.py) prefills each input like a prompt and pools the LM head's
input (step/pooling.py). For each input length this times `pooled` (last-token pooling) and the
engine's own prompt prefill (`Engine.prefill`, prefix reuse off: the cache is reset before
each), alternating, on the same engine. MODEL: a checkpoint folder or GGUF file (default
SmolLM2-135M-Instruct's Q4_1 GGUF, fetched once), on the CPU with the threads torch has.
Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..engine import Engine
from ..errors import ExpressLaneError
from ..gguf.fetch import model_or_smollm2
from ..step.pooling import pooled


def _tokens(n: int, vocab: int) -> list[int]:
    return [1 + (i * 7919) % (vocab - 1) for i in range(n)]  # fixed, spread over the vocabulary


def measure(engine: Engine, n: int, repeats: int) -> dict:
    ids = _tokens(n, engine.cfg.vocab_size)
    times: dict[str, list[float]] = {"embedding": [], "prefill": []}
    for _ in range(repeats + 1):  # the first round warms up, and is dropped
        for name in times:
            engine.cache.reset()
            t = time.perf_counter()
            pooled(engine, ids, "last", None) if name == "embedding" else engine.prefill(ids)
            times[name].append(time.perf_counter() - t)
    ms = {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()}
    return {"tokens": n, "embedding_ms": ms["embedding"], "prefill_ms": ms["prefill"],
            "ratio": ms["embedding"] / ms["prefill"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.embeddings",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("model", nargs="?", default=None, help="checkpoint folder or GGUF file")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        args.model = model_or_smollm2(args.model)
        if args.repeats < 1 or min(args.lengths) < 1:
            raise ExpressLaneError("--repeats and --lengths: at least 1")
        engine = Engine.from_pretrained(str(args.model), device="cpu",
                                        max_model_len=max(args.lengths) + 1, progress=False,
                                        prefix_reuse=False)  # fmt: skip
    except (ExpressLaneError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [measure(engine, n, args.repeats) for n in args.lengths]
    print(f"{'tokens':>7} {'embedding ms':>13} {'prompt prefill ms':>18} {'ratio':>6}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['embedding_ms']:>13.1f} {r['prefill_ms']:>18.1f} "
              f"{r['ratio']:>6.2f}")  # fmt: skip
    print(json.dumps({"model": str(args.model), "threads": torch.get_num_threads(),
                      "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
