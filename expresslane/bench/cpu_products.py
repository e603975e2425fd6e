"""The C products alone (csrc/cpu_matmul.c, cpu_nibble.c), per matrix of one layer and the head,
at several token counts: what a decode step (1 token), a verify (5) and a prefill chunk (40,
160) pay for each product, without attention, norms or Python around them.

Per file, matrix and token count S: the best of `--repeats` calls of `native_matmul` (random
activations; the packed weights exactly as the engine loads them), its time in ms and its
integer or float operations per second (2 N K S / time). One thread by default, where the
kernels' own cost shows best; the VM's neighbours move two-thread figures by more than the
differences measured here.

    python -m expresslane.bench.cpu_products [FILE.gguf ...] [--tokens 1 5 40 160]
        [--threads 1] [--repeats 9]

Default file: SmolLM2-135M-Instruct as Q4_0 (llama.cpp's quantizer writes it: gguf/variants.py).
One table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..errors import ExpressLaneError

TOKENS = (1, 5, 40, 160)


def _best(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def matrices(engine) -> list[tuple[str, object]]:
    """(name, QTensor) of the first layer's products, piece by piece, then the head."""
    layer = engine.step.weights.layers[0]
    out = []
    for name in ("wqkv", "wo", "w13", "w2"):
        pieces = getattr(layer, name).pieces
        out += [(name if len(pieces) == 1 else f"{name}[{i}]", q) for i, q in enumerate(pieces)]
    return out + [("head", engine.step.weights.head)]


def measure(path: str, tokens, repeats: int) -> list[dict]:
    from ..engine import Engine
    from ..step.native import available, native_matmul

    engine = Engine.from_pretrained(path, progress=False, decode="graph")
    rows = []
    for name, q in matrices(engine):
        if not available(q.fmt):
            continue
        N, K = q.shape[-2], q.shape[-1]
        g = torch.Generator().manual_seed(N + K)
        for S in tokens:
            x = torch.randn(S, K, generator=g)
            s = _best(lambda q=q, x=x: native_matmul(q, x), repeats)
            row = dict(file=path.rsplit("/", 1)[-1], matrix=name, fmt=q.fmt, rows=N, k=K,
                       tokens=S, ms=s * 1e3, gops=2 * N * K * S / s / 1e9)  # fmt: skip
            rows.append(row)
            print(f"{row['file'][:36]:<36} {name:<8} {q.fmt:<6} {N:>6} {K:>5} {S:>5} "
                  f"{row['ms']:9.3f} {row['gops']:8.1f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="GGUF files or checkpoint folders")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if min(args.tokens) < 1 or args.repeats < 1 or args.threads < 1:
        print("cpu_products: --tokens, --repeats and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    files = args.files
    if not files:
        from ..gguf.variants import ensure

        files = [str(ensure("Q4_0"))]
    print(f"{'file':<36} {'matrix':<8} {'fmt':<6} {'rows':>6} {'K':>5} {'S':>5} {'ms':>9} "
          f"{'GOPS':>8}")  # fmt: skip
    rows = []
    try:
        with torch.inference_mode():
            for f in files:
                rows += measure(f, args.tokens, args.repeats)
    except ExpressLaneError as e:  # a missing or malformed file: the message, not a traceback
        print(f"cpu_products: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"bench": "cpu_products", "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
