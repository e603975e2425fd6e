"""The C products alone (csrc/cpu_matmul.c, cpu_nibble.c), per matrix of one layer and the head,
at several token counts: what a decode step (1 token), a verify (5) and a prefill chunk (40,
160) pay for each product, without attention, norms or Python around them.

Per file, matrix and token count S: the best of `--repeats` calls of `native_matmul` (random
activations; the packed weights exactly as the engine loads them), its time in ms and its
integer or float operations per second (2 N K S / time). One thread by default, where the
kernels' own cost shows best; the VM's neighbours move two-thread figures by more than the
differences measured here.

    python -m expresslane.bench.cpu_products [FILE.gguf ...] [--tokens 1 5 40 160]
        [--threads 1] [--repeats 9] [--layer 0] [--prompt]

`--layer` picks the layer whose products are timed: llama.cpp's mixes give layers different
types (its IQ2_XXS file of SmolLM2 keeps layers 0-2's ffn_down in Q2_K). `--prompt` times the
products as a prompt's chunk takes them (csrc/cpu_kernels.h's EL_PROMPT: on a CPU with AMX, Q8_0
and the nibble formats but NVFP4 in tiles, from their least chunk on).

Default file: SmolLM2-135M-Instruct as Q4_0 (llama.cpp's quantizer writes it: gguf/variants.py).
One table, then one JSON line.
"""

from __future__ import annotations

import json
import time

import torch

from .cpu_files import arguments, files, measure_all

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


def matrices(engine, index: int = 0) -> list[tuple[str, object]]:
    """(name, QTensor) of layer `index`'s products, piece by piece, then the head."""
    layer = engine.step.weights.layers[index]
    out = []
    for name in ("wqkv", "wo", "w13", "w2"):
        pieces = getattr(layer, name).pieces
        out += [(name if len(pieces) == 1 else f"{name}[{i}]", q) for i, q in enumerate(pieces)]
    return out + [("head", engine.step.weights.head)]


def measure(path: str, tokens, repeats: int, layer: int = 0, prompt: bool = False) -> list[dict]:
    from ..engine import Engine
    from ..errors import ConfigError
    from ..step.native import available, native_matmul

    engine = Engine.from_pretrained(path, progress=False, decode="graph")
    layers = len(engine.step.weights.layers)
    if not 0 <= layer < layers:
        raise ConfigError(f"--layer {layer}: {path} has layers 0-{layers - 1}")
    rows = []
    for name, q in matrices(engine, layer):
        if not available(q.fmt):
            continue
        N, K = q.shape[-2], q.shape[-1]
        g = torch.Generator().manual_seed(N + K)
        for S in tokens:
            x = torch.randn(S, K, generator=g)
            s = _best(lambda q=q, x=x: native_matmul(q, x, prompt=prompt), repeats)
            row = dict(file=path.rsplit("/", 1)[-1], layer=layer, matrix=name, fmt=q.fmt, rows=N,
                       k=K, tokens=S, prompt=prompt, ms=s * 1e3,
                       gops=2 * N * K * S / s / 1e9)  # fmt: skip
            rows.append(row)
            print(f"{row['file'][:36]:<36} {name:<8} {q.fmt:<6} {N:>6} {K:>5} {S:>5} "
                  f"{row['ms']:9.3f} {row['gops']:8.1f}", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, "tokens", TOKENS, repeats=9, threads=1)
    ap.add_argument("--layer", type=int, default=0, help="the layer whose products are timed")
    ap.add_argument(
        "--prompt",
        action="store_true",
        help="as a prompt's chunk takes them (AMX tiles for the block formats)",
    )
    args = ap.parse_args(argv)
    paths = files("cpu_products", args, "tokens", ["Q4_0"])
    if paths is None:
        return 2
    print(f"{'file':<36} {'matrix':<8} {'fmt':<6} {'rows':>6} {'K':>5} {'S':>5} {'ms':>9} "
          f"{'GOPS':>8}")  # fmt: skip
    rows = measure_all("cpu_products", paths,
                       lambda f: measure(f, args.tokens, args.repeats, args.layer,
                                         args.prompt))  # fmt: skip
    if rows is None:
        return 2
    print(json.dumps({"bench": "cpu_products", "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
