"""What `tool_choice: auto`'s free grammar costs free text, in one process, per convention.

    python -m expresslane.bench.free_grammar [MODEL] [--max-tokens 200] [--repeats 4]
                                            [--temperature 0.0] [--threads N]

Under `auto` each token of free text is drawn from the unmasked logits and checked against the
convention's free grammar (serve/tools.py auto_grammar, structured/decoding.py checked_pick);
the text is the text without a grammar. This decodes one chat answer (`--max-tokens`, end of
text ignored) without a grammar and under the Hermes, Mistral and Llama 3 free grammars of
bench/auto_tools.py's two tools, the four ways in turn for `--repeats` rounds (each
round starting at the next way), and asserts that
every way gives the same tokens (a fixed seed when sampled). The engine is built once; the
server's HTTP and threads (bench/auto_tools.py) are left out, so what differs is the check.
Per way: the median decode tokens/s, its ratio to no grammar, and the milliseconds a token the
grammar adds. Issue 26 asks <= 5% on the CPU. Prints one table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from ..engine import Engine
from ..sampling.params import SamplingParams
from ..serve.tools import auto_grammar, plan_tools
from ..structured.grammar import GrammarCompiler
from ..tokenizer import Tokenizer
from .auto_tools import CHATML, PARSER, TOOLS
from .serve_decode import measured, model_parser

ASK = "Write a long story about a dragon."
CONVENTIONS = ("hermes", "mistral", "llama3")


def grammars(engine: Engine, tok: Tokenizer) -> dict:
    """The compiled free grammar of each convention (Hermes: the generic prompt's)."""
    compiler = GrammarCompiler(tok, engine.cfg.vocab_size)
    out = {}
    for c in CONVENTIONS:
        template, parser = ("", None) if c == "hermes" else (CHATML, PARSER[c])
        out[c] = compiler.compile(auto_grammar(plan_tools({"tools": TOOLS}, template, parser, tok)))
    return out


def measure(model: str, max_tokens: int, repeats: int, temperature: float,
            threads: int | None) -> dict:  # fmt: skip
    """{way: [decode tok/s per round]}; every way's tokens equal no grammar's."""
    if threads:
        torch.set_num_threads(threads)
    engine = Engine.from_pretrained(model, progress=False)
    tok = Tokenizer.from_dir(model)
    prompt = tok.encode_chat([{"role": "user", "content": ASK}])
    ways = {"none": None, **grammars(engine, tok)}

    def run(grammar) -> tuple[list[int], float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0,
                                ignore_eos=True, grammar=grammar)  # fmt: skip
        ids = list(engine.generate(prompt, params))
        return ids, engine.stats.decode_tokens_per_s

    want = run(None)[0]  # also the untimed first use
    speeds: dict[str, list[float]] = {w: [] for w in ways}
    order = list(ways)
    for r in range(repeats):  # each round starts at the next way: no way always runs first
        for way in order[r % len(order) :] + order[: r % len(order)]:
            ids, tps = run(ways[way])
            if ids != want:
                raise AssertionError(f"{way}: other tokens than without a grammar")
            speeds[way].append(tps)
    return speeds


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("free_grammar", __doc__)
    ap.set_defaults(repeats=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    bad = args.max_tokens < 2 or args.repeats < 1 or args.temperature < 0 or \
        (args.threads is not None and args.threads < 1)  # fmt: skip
    problem = ("--max-tokens: at least 2; --repeats, --threads: at least 1; --temperature: not "
               "negative") if bad else None  # fmt: skip
    speeds = measured("free_grammar", args, problem, lambda model: measure(
        model, args.max_tokens, args.repeats, args.temperature, args.threads))  # fmt: skip
    if speeds is None:
        return 2
    base = statistics.median(speeds["none"])
    rows = []
    print("| grammar | decode tok/s (median) | rounds | vs none | ms a token added |")
    print("|---|---|---|---|---|")
    for way, tps in speeds.items():
        med = statistics.median(tps)
        added = 1e3 / med - 1e3 / base
        rows.append({"grammar": way, "tokens_per_s": med, "rounds": tps, "ratio": med / base,
                     "added_ms": added})  # fmt: skip
        rounds = " / ".join(f"{t:.1f}" for t in tps)
        print(f"| {way} | {med:.1f} | {rounds} | {med / base:.3f} | {added:.3f} |")
    print(json.dumps({"model": str(args.model), "max_tokens": args.max_tokens,
                      "temperature": args.temperature, "threads": torch.get_num_threads(),
                      "same_tokens": True, "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
