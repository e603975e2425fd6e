"""Prefill on a CPU: the three ways a prompt can go, by prompt length, against the fp32 forward.

- `forward`: the model's own forward in fp32 (the reference): its packed projections dequantize
  their blocks on every call, and its head dequantizes the vocabulary's matrix;
- `layers`: StepPrefill's path for long prompts: the model's layers with their products in the
  policy's dtype (bf16 for quantized, bf16 or fp16 weights where the CPU multiplies bf16 and
  `--prefill-dtype` asks for it, the weights from the C decoder), then the step's C head on the
  last row;
- `step`: the packed decode step (step/packed.py, its C layers), 40 tokens a call, the blocks
  read as stored; exact, or with x at llama.cpp's precision (`+lowp`: `--prefill-dtype int8`,
  or bfloat16 on bf16 weights).

StepPrefill takes the step up to `STEP_PREFILL_MAX` tokens (step/prefill.py) and `layers` above:
this bench measures where they cross for each weight format. Per file and length: the best of
`--repeats` cold prefills (an empty cache) each way, ms, and each way's largest |logit|
difference from the fp32 forward's last position, and whether its argmax agrees. With `--peer
llama.cpp`, llama.cpp's own prefill of the same file and ids too (llama-cpp-python, the same
threads): its time and its difference from our fp32 forward, the yardstick for `layers`' bf16.

    python -m expresslane.bench.cpu_prefill [FILE.gguf ...] [--lengths 16 40 ...] [--threads 2]
        [--peer llama.cpp] [--prefill-dtype float32|bfloat16|int8] [--quantization int8|int8-row]

Default files: SmolLM2-135M-Instruct as F32, Q8_0 and Q4_K_M (llama.cpp's quantizer writes
them: gguf/variants.py). One table, then one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..step.choose import PREFILL_DTYPES
from ..weights.packing import QUANTIZATIONS
from .cpu_files import arguments, files, measure_all

LENGTHS = (16, 40, 64, 128, 192, 256, 384, 512)
WAYS = ("forward", "layers", "step")


def _cold(engine, ids: list[int], way: str) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill of `ids` into an empty cache `way`, and its last logits."""
    engine.cache.reset()
    engine.prefix.enabled = False
    prefill = engine._prefill
    old = prefill.max_tokens
    prefill.max_tokens = len(ids) if way == "step" else 0  # the policy forced one way
    try:
        t = time.perf_counter()
        if way == "forward":
            logits = engine.model(torch.tensor([ids]), None, engine.cache, True)
        else:
            logits = engine.prefill(ids)
        return time.perf_counter() - t, logits.float().flatten()
    finally:
        prefill.max_tokens = old


def _peer_cold(peer, ids: list[int]) -> tuple[float, torch.Tensor]:
    """The same for llama.cpp (bench/llamacpp.py's peer on the same file)."""
    peer.llm.reset()
    t = time.perf_counter()
    peer.llm.eval(ids)
    return time.perf_counter() - t, torch.from_numpy(peer.last_logits().copy())


def measure(path: str, lengths, repeats: int, peer: bool = False, threads: int = 2,
            prefill_dtype: str = "float32",
            quantization: str | None = None) -> list[dict]:  # fmt: skip
    from ..engine import Engine
    from ..step.prefill import StepPrefill

    engine = Engine.from_pretrained(path, progress=False, decode="graph",
                                    prefill_dtype=prefill_dtype,
                                    quantization=quantization)  # fmt: skip
    if not isinstance(engine._prefill, StepPrefill):
        raise SystemExit(f"{path}: its step cannot prefill (not the packed C step)")
    fmt = "+".join(sorted(engine.step.weights.formats))
    products = str(engine._prefill.products or torch.float32).replace("torch.", "")
    if engine._prefill.lowp:  # the step's x at llama.cpp's precision (--prefill-dtype)
        products += "+lowp"
    llm = None
    if peer:
        from pathlib import Path

        from .llamacpp import LlamaCppPeer

        llm = LlamaCppPeer(Path(path), threads, n_ctx=max(lengths) + 8)
    rows = []
    for n in lengths:
        ids = [(i * 37 + 11) % engine.cfg.vocab_size for i in range(n)]
        ref = _cold(engine, ids, "forward")[1]
        row = {"file": path.rsplit("/", 1)[-1], "formats": fmt, "products": products, "tokens": n}
        runs = {w: (lambda w=w, ids=ids: _cold(engine, ids, w)) for w in WAYS}
        if llm is not None:
            runs["llama.cpp"] = lambda ids=ids: _peer_cold(llm, ids)
        for way, run in runs.items():
            best = min(run()[0] for _ in range(repeats))
            logits = run()[1]
            row[way] = {"ms": best * 1e3, "max_abs_diff": float((logits - ref).abs().max()),
                        "argmax_agrees": int(logits.argmax()) == int(ref.argmax())}  # fmt: skip
        rows.append(row)
        cells = "".join(f" {row[w]['ms']:>8.0f} {row[w]['max_abs_diff']:>6.3f}"
                        f"{'' if row[w]['argmax_agrees'] else '*'}" for w in runs)  # fmt: skip
        print(f"{row['file'][:36]:<36} {fmt[:18]:<18} {products:<13} {n:>6}{cells}", flush=True)
    if llm is not None:
        llm.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, "lengths", LENGTHS, repeats=3, threads=2)
    ap.add_argument(
        "--peer",
        choices=["llama.cpp"],
        default=None,
        help="llama.cpp's prefill of the same files too (llama-cpp-python)",
    )
    ap.add_argument(
        "--prefill-dtype",
        choices=PREFILL_DTYPES,
        default="float32",
        help="the layers' products (bfloat16: for quantized, bf16 or fp16 weights), and with "
        "int8 (or bfloat16 on bf16 weights) the step's x at llama.cpp's precision: `products` "
        "then reads +lowp",
    )
    ap.add_argument(
        "--quantization",
        choices=list(QUANTIZATIONS),
        default=None,
        help="a float file's weights quantized, as `run --quantization` (int8: Q8_0's layout, "
        "int8-row: a scale per row; GGUF blocks stay as stored)",
    )
    args = ap.parse_args(argv)
    paths = files("cpu_prefill", args, "lengths", ["F32", "Q8_0", "Q4_K_M"])
    if paths is None:
        return 2
    if args.peer:
        from .llamacpp import available

        if not available():
            print("cpu_prefill: --peer llama.cpp needs llama-cpp-python", file=sys.stderr)
            return 2
    ways = [*WAYS, *([args.peer] if args.peer else [])]
    head = "".join(f" {w + ' ms':>8} {'|d|':>6}" for w in ways)
    print(f"{'file':<36} {'formats':<18} {'products':<13} {'tokens':>6}{head}  (* argmax differs)")
    rows = measure_all(
        "cpu_prefill",
        paths,
        lambda f: measure(
            f,
            args.lengths,
            args.repeats,
            args.peer is not None,
            args.threads,
            args.prefill_dtype,
            args.quantization,
        ),
    )
    if rows is None:
        return 2
    print(json.dumps({"bench": "cpu_prefill", "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
