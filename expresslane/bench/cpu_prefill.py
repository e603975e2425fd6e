"""Prefill on a CPU: the model's forward against the packed decode step, by prompt length.

The model's forward computes in fp32 from weights its packed projections dequantize on every
call (a fixed ~0.2-0.3 s for SmolLM2's quantized blocks, whatever the prompt's length); the
packed step (step/packed.py, its C layers) reads the blocks as stored, 40 tokens a call. Short
prompts, and the new part of a prompt whose prefix the cache holds (an agent's next turn), are
faster through the step; long ones through the forward's GEMMs. This bench measures where the
two cross for each weight format; `step/prefill.py` STEP_PREFILL_MAX holds the result.

    python -m expresslane.bench.cpu_prefill [FILE.gguf ...] [--lengths 16 40 ...] [--threads 2]

Default files: SmolLM2-135M-Instruct as F32, Q8_0 and Q4_K_M (llama.cpp's quantizer writes
them: gguf/variants.py). Per file and length: the best of `--repeats` cold prefills (an empty
cache) each way, ms, and whether the step's last-position argmax agrees with the forward's.
One table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

LENGTHS = (16, 40, 64, 128, 192, 256, 384, 512)


def _cold(engine, ids: list[int], use_step: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of `ids` into an empty cache, and its last logits."""
    engine.cache.reset()
    engine.prefix.enabled = False
    prefill = engine._prefill
    old = prefill.max_tokens
    prefill.max_tokens = len(ids) if use_step else 0  # the policy forced one way
    try:
        t = time.perf_counter()
        logits = engine.prefill(ids)
        return time.perf_counter() - t, logits.float()
    finally:
        prefill.max_tokens = old


def measure(path: str, lengths, repeats: int) -> list[dict]:
    from ..engine import Engine
    from ..step.prefill import StepPrefill

    engine = Engine.from_pretrained(path, progress=False, decode="graph")
    if not isinstance(engine._prefill, StepPrefill):
        raise SystemExit(f"{path}: its step cannot prefill (not the packed C step)")
    fmt = "+".join(sorted(engine.step.weights.formats))
    rows = []
    for n in lengths:
        ids = [(i * 37 + 11) % engine.cfg.vocab_size for i in range(n)]
        fwd = min(_cold(engine, ids, False)[0] for _ in range(repeats))
        stp = min(_cold(engine, ids, True)[0] for _ in range(repeats))
        agree = int(_cold(engine, ids, False)[1].argmax()) == int(
            _cold(engine, ids, True)[1].argmax()
        )
        rows.append({"file": path.rsplit("/", 1)[-1], "formats": fmt, "tokens": n,
                     "forward_ms": fwd * 1e3, "step_ms": stp * 1e3,
                     "argmax_agrees": agree})  # fmt: skip
        r = rows[-1]
        print(f"{r['file'][:36]:<36} {fmt[:18]:<18} {n:>6} {r['forward_ms']:>10.0f} "
              f"{r['step_ms']:>9.0f} {r['forward_ms'] / r['step_ms']:>7.2f} {agree!s:>6}",
              flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="GGUF files or checkpoint folders")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if min(args.lengths) < 1 or args.repeats < 1 or args.threads < 1:
        print("cpu_prefill: --lengths, --repeats and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    files = args.files
    if not files:
        from ..gguf.variants import ensure

        files = [str(ensure(t)) for t in ("F32", "Q8_0", "Q4_K_M")]
    print(f"{'file':<36} {'formats':<18} {'tokens':>6} {'forward ms':>10} {'step ms':>9} "
          f"{'x fwd':>7} {'argmax':>6}")  # fmt: skip
    rows = []
    for f in files:
        rows += measure(f, args.lengths, args.repeats)
    print(json.dumps({"bench": "cpu_prefill", "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
