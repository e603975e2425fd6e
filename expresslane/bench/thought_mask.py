"""The grammar after a thought (`serve --reasoning-parser`): what its mask costs a token.

    python -m expresslane.bench.thought_mask [MODEL] [--schemas 12] [--thought-tokens 200]

A thinking model under a schema first writes a thought the grammar does not constrain (any text
up to </think>: structured/grammar.py's wrapper), then the answer the schema holds. Both phases
compute a token mask each step, the engine's `Matcher.fill`; this times it. For the first N
schemas of the suite (schemas.py): the plain grammar and the wrapped one for each parser, the
same answer walk (bench/grammar.py's: a random allowed token each step, a fixed seed),
the wrapped ones after a thought of English prose (`--thought-tokens` of it, then
"</think>\\n\\n"). MODEL: a tokenizer folder or file (default SmolLM2-135M's GGUF, fetched once).
One thread, masks on the CPU. Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import replace

import torch

from ..gguf.fetch import model_or_smollm2
from ..structured.grammar import GrammarCompiler, GrammarSpec
from ..structured.reasoning import END, PARSERS, START
from ..tokenizer import Tokenizer
from .grammar import walk
from .schemas import SCHEMAS

PROSE = ("The user asks for a record. I should check which fields the schema requires, what "
         "each value may be, and whether any field is optional. Then I write the object, "
         "keeping every string short and every number inside its bounds. ")  # fmt: skip


def _timed_fill(m, out: list[float]) -> None:
    t = time.perf_counter()
    m.fill()
    out.append(time.perf_counter() - t)


def run(tok: Tokenizer, n_schemas: int, thought_tokens: int) -> list[dict]:
    compiler = GrammarCompiler(tok, tok.vocab_size)
    ids = tok.encode(PROSE * (1 + thought_tokens // 30), False)[:thought_tokens]
    closing = tok.encode(END + "\n\n", False)
    eos = tok.eos_ids[0]
    rows = []
    for think in ("", *PARSERS):
        thought_s: list[float] = []
        answer_s: list[float] = []
        for name, schema in list(SCHEMAS.items())[:n_schemas]:
            spec = replace(GrammarSpec.json_schema(schema), think=think)
            m = compiler.compile(spec).matcher()
            if think:
                for t in tok.encode(START, False) + ids + closing:
                    _timed_fill(m, thought_s)
                    m.consume(t)
            # bench/grammar.py's walk on a copy of llguidance's matcher, replayed on ours
            path = walk(m.m.deep_copy(), tok.vocab_size, eos, random.Random(name))
            for t in path[:-1]:
                _timed_fill(m, answer_s)
                m.consume(t)
        rows.append({
            "grammar": f"after a thought ({think})" if think else "plain",
            "thought_us_median": statistics.median(thought_s) * 1e6 if thought_s else None,
            "answer_us_median": statistics.median(answer_s) * 1e6,
            "answer_us_p90": statistics.quantiles(answer_s, n=10)[8] * 1e6,
            "masks": len(thought_s) + len(answer_s),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.thought_mask")
    ap.add_argument("model", nargs="?", help="a tokenizer folder or file (default: SmolLM2)")
    ap.add_argument("--schemas", type=int, default=12)
    ap.add_argument("--thought-tokens", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.model = model_or_smollm2(args.model)
    rows = run(Tokenizer.from_dir(args.model), args.schemas, args.thought_tokens)
    print(f"{'grammar':32} {'thought µs/mask':>16} {'answer µs/mask':>15} {'answer p90':>11}")
    for r in rows:
        thought = "-" if r["thought_us_median"] is None else f"{r['thought_us_median']:.1f}"
        print(f"{r['grammar']:32} {thought:>16} {r['answer_us_median']:>15.1f} "
              f"{r['answer_us_p90']:>11.1f}")  # fmt: skip
    print(json.dumps({"model": str(args.model), "schemas": args.schemas,
                      "thought_tokens": args.thought_tokens, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
