"""Greedy agreement of the weight formats with fp32 (or bf16), on real chat prompts.

    python -m expresslane.bench.agreement MODEL [--formats bfloat16 int8 gguf gpu-int4 ...]
        [--tokens 128] [--reference float32|bfloat16]

The CPU formats run as the packed step stores them. The GPU formats (`gpu-int8`, `gpu-int4`,
`gpu-int8-g128`, `gpu-int4-g32`: `--quantization int8|int4...` on a GPU) run through their
reference path on the CPU: each layer projection replaced by its dequantized values
(kernels/qlinear.quantized_reference), which is what the GPU products compute, in fp32.

For each prompt, the reference decodes greedily through the engine; each other format then
- decodes freely through its own packed step: `same_prefix`, the tokens equal to fp32's before
  the first difference (one flip changes everything after it, so this is the strict measure);
- is fed fp32's tokens (teacher forcing, one forward over prompt + answer): `top1`, the share of
  positions whose argmax is fp32's next token (the stable measure of what the weights changed).
One table, then one JSON line. Nothing is asserted: formats trade accuracy for bytes.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..checkpoint import load_model, resolve_model_dir
from ..engine import Engine
from ..errors import ConfigError
from ..gguf import find_gguf
from ..kernels.qlinear import quantized_reference
from ..sampling.params import SamplingParams
from ..tokenizer import Tokenizer
from ..weights.lora import load_adapter, merge
from ..weights.packing import pack_gguf, pack_model, packed_format

CPU_FORMATS = ("bfloat16", "float16", "int8", "int8-row", "gguf")
GPU_FORMATS = ("gpu-int8", "gpu-int4", "gpu-int8-g128", "gpu-int4-g32")
PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for a good night's sleep.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How many legs does a spider have, and why?",
    "Translate 'good morning, how are you?' into Spanish.",
)


def engine_for(path, fmt: str, max_len: int, compile: bool = False,
               kv_cache_dtype: str = "auto", lora=()) -> Engine:  # fmt: skip
    """A CPU engine on the packed step with weights in `fmt` ("gguf": a GGUF file's blocks),
    `lora`'s (adapter, scale) pairs merged first (weights/lora.py)."""
    model = load_model(path, device="cpu", dtype="float32", progress=False)
    adapted = merge(model, [load_adapter(a, model.cfg, s) for a, s in lora]) if lora else set()
    if fmt.startswith("gpu-"):
        quantized_reference(model, fmt.removeprefix("gpu-"))
    elif fmt == "gguf":
        if find_gguf(path) is None:
            raise ConfigError(f"--formats gguf: {path} is not a GGUF file")
        pack_gguf(model, find_gguf(path), adapted)
    elif fmt != "float32":
        pack_model(model, packed_format(fmt))
    # prefix reuse off: a bench's rounds repeat one prompt, and its TTFT is a cold prefill's
    # (with reuse, rounds after the first prefilled one token: the 2026-11-27 GGUF table's TTFT)
    return Engine(model, max_model_len=max_len, decode="graph", compile=compile,
                  prefix_reuse=False, kv_cache_dtype=kv_cache_dtype)  # fmt: skip


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@torch.inference_mode()
def top1(engine: Engine, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(positions whose argmax is answer's next token, positions) with answer fed in."""
    ids = torch.tensor([prompt + answer])
    logits = engine.model(ids)[0, len(prompt) - 1 : -1]  # predicts answer[0..]
    hits = (logits.argmax(-1) == torch.tensor(answer)).sum().item()
    return int(hits), len(answer)


def measure(path, formats: list[str], tokens: int, prompts=PROMPTS,
            reference: str = "float32") -> list[dict]:  # fmt: skip
    tok = Tokenizer.from_dir(path)
    chats = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                   add_special_tokens=False)
        for p in prompts
    ]  # fmt: skip
    max_len = max(len(c) for c in chats) + tokens + 8
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ref = engine_for(path, reference, max_len)
    answers = [list(ref.generate(c, params)) for c in chats]
    del ref
    rows = []
    for fmt in formats:
        eng = engine_for(path, fmt, max_len)
        prefix, hits, total = [], 0, 0
        for chat, answer in zip(chats, answers, strict=True):
            prefix.append(same_prefix(list(eng.generate(chat, params)), answer))
            h, n = top1(eng, chat, answer)
            hits, total = hits + h, total + n
        rows.append({"format": fmt, "reference": reference, "prompts": len(chats), "tokens": tokens,
                     "same_prefix": prefix, "same_prefix_mean": sum(prefix) / len(prefix),
                     "all_tokens_same": sum(p == tokens for p in prefix),
                     "top1": hits / total})  # fmt: skip
        del eng
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.agreement", description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--formats", nargs="+", default=["bfloat16", "float16", "int8", "int8-row"],
                    choices=[*CPU_FORMATS, *GPU_FORMATS])  # fmt: skip
    ap.add_argument("--reference", default="float32", choices=["float32", "bfloat16"],
                    help="the format the others are compared with")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_dir(args.model)
    rows = measure(path, args.formats, args.tokens, reference=args.reference)
    print(f"{'format':<14} {'prompts':>7} {'tokens':>6} {'same prefix (mean)':>19} "
          f"{'all same':>8} {'top-1 vs ' + args.reference:>17}")  # fmt: skip
    for r in rows:
        print(f"{r['format']:<14} {r['prompts']:>7} {r['tokens']:>6} {r['same_prefix_mean']:19.1f} "
              f"{r['all_tokens_same']:>8} {r['top1']:17.1%}")  # fmt: skip
    print(json.dumps({"model": str(path), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
