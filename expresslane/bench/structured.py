"""Structured output on a real model: validity over the schema suite, and what the mask costs.

    python -m expresslane.bench.structured [MODEL] [--threads 2] [--max-tokens 256]

MODEL defaults to SmolLM2-135M-Instruct (GGUF Q4_1, fetched once). For each of the suite's
schemas (schemas.py) a chat prompt asks for a JSON object of that schema; the answer is decoded
under the schema greedy and sampled (temperature 0.7, a seed per schema), and every finished
output is validated with `jsonschema`. The same prompts decoded without a grammar (up to the
same max_tokens, end of text ignored) give the unconstrained decode speed beside the
constrained one, in the same process and the same thread count. Prints one table, then one
JSON line. Measure on a quiet machine: the target is <= 5% fewer tokens/s constrained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ..config import SamplingParams
from ..engine import Engine
from ..structured.grammar import GrammarCompiler, GrammarSpec
from ..tokenizer import Tokenizer
from .schemas import SCHEMAS


def _prompt(tok: Tokenizer, name: str, schema: dict) -> list[int]:
    ask = (f"Write one example '{name.replace('_', ' ')}' as a JSON object matching this "
           f"schema, and nothing else.\nSchema: {json.dumps(schema)}")  # fmt: skip
    return tok.encode_chat([{"role": "user", "content": ask}])


def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict]:
    ids = [s.token for s in engine.generate_steps(prompt, params)]
    st = engine.stats
    return ids, {"tokens": st.generated_tokens, "decode_s": st.decode_s, "finish": st.finish_reason}


def measure(engine: Engine, tok: Tokenizer, max_tokens: int) -> tuple[list[dict], list[dict]]:
    import jsonschema

    comp = GrammarCompiler(tok, engine.cfg.vocab_size)
    rows = {k: {"mode": k, "tokens": 0, "decode_s": 0.0, "finished": 0, "valid": 0, "runs": 0}
            for k in ("unconstrained", "greedy", "sampled")}  # fmt: skip
    compile_ms, failures = [], []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        prompt = _prompt(tok, name, schema)
        t = time.perf_counter()
        grammar = comp.compile(GrammarSpec.json_schema(schema))
        compile_ms.append((time.perf_counter() - t) * 1e3)
        free = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        runs = [("unconstrained", free, False),
                ("greedy", SamplingParams(max_tokens=max_tokens, grammar=grammar), True),
                ("sampled", SamplingParams(max_tokens=max_tokens, grammar=grammar,
                                           temperature=0.7, seed=i), True)]  # fmt: skip
        for mode, params, check in runs:
            ids, st = _run(engine, prompt, params)
            r = rows[mode]
            r["runs"] += 1
            r["tokens"] += st["tokens"] - 1  # decode tokens: after the first
            r["decode_s"] += st["decode_s"]
            if not check:
                continue
            if st["finish"] != "stop":
                failures.append({"schema": name, "mode": mode, "error": "max_tokens reached"})
                continue
            r["finished"] += 1
            text = tok.decode(ids, skip_special_tokens=True)
            try:
                jsonschema.validate(json.loads(text), schema)
                r["valid"] += 1
            except Exception as e:  # an invalid output is the benchmark's finding, not a crash
                failures.append({"schema": name, "mode": mode, "error": str(e)[:200]})
    out = []
    for r in rows.values():
        r["decode_tok_s"] = r["tokens"] / r["decode_s"] if r["decode_s"] > 0 else 0.0
        r["compile_ms_median"] = statistics.median(compile_ms)
        out.append(r)
    base = out[0]["decode_tok_s"]
    for r in out:
        r["vs_unconstrained"] = r["decode_tok_s"] / base if base else None
    return out, failures


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.structured")
    ap.add_argument("model", nargs="?", help="a model path (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from ..gguf.fetch import fetch_smollm2

        path = str(fetch_smollm2())
    engine = Engine.from_pretrained(path, progress=False)
    tok = Tokenizer.from_dir(path)
    rows, failures = measure(engine, tok, args.max_tokens)
    print(f"{len(SCHEMAS)} schemas, {args.threads} threads, max_tokens {args.max_tokens}")
    print(f"{'mode':<14} {'runs':>5} {'finished':>9} {'valid':>6} {'tokens':>7} "
          f"{'decode t/s':>11} {'x free':>7}")  # fmt: skip
    for r in rows:
        cells = f"{r['runs']:>5} {r['finished']:>9} {r['valid']:>6} {r['tokens']:>7}"
        print(f"{r['mode']:<14} {cells} {r['decode_tok_s']:11.1f} {r['vs_unconstrained']:7.3f}")
    for f in failures:
        print(f"  not valid: {f['schema']} ({f['mode']}): {f['error']}")
    print(json.dumps({"bench": "structured", "model": path, "threads": args.threads,
                      "compile_ms_median": rows[0]["compile_ms_median"], "rows": rows,
                      "failures": failures}))  # fmt: skip


if __name__ == "__main__":
    main()
