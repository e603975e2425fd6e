"""What `tool_choice: auto`'s free grammar costs free text, in one process, per convention.

    python -m expresslane.bench.free_grammar [MODEL] [--max-tokens 200] [--repeats 4]
                                            [--temperature 0.0] [--threads N]
    python -m expresslane.bench.free_grammar --preset laneformer-2b --device cuda
                                            [--tokenizer DIR] [--max-tokens 128]

Under `auto` each token of free text is drawn from the unmasked logits and checked against the
convention's free grammar (serve/tools.py auto_grammar, structured/decoding.py checked_pick);
the text is the text without a grammar. This decodes one chat answer (`--max-tokens`, end of
text ignored) without a grammar and under the Hermes, Mistral and Llama 3 free grammars of
bench/auto_tools.py's two tools, the four ways in turn for `--repeats` rounds (each
round starting at the next way), and reports whether every way gave the tokens of no grammar
(a fixed seed when sampled): free text that opens no call must. The engine is built once; the
server's HTTP and threads (bench/auto_tools.py) are left out, so what differs is the check.
Per way: the median decode tokens/s, its ratio to no grammar, and the milliseconds a token the
grammar adds. Issue 26 asks <= 5% on the CPU. `--preset` times a preset's shape on random
weights with a borrowed tokenizer (default: the embedded model's), as bench/structured.py does:
the GPU's checked pick (an unmasked replay of the captured pick, a masked one when refused) at
the 2B's shapes, where no trained weights exist, its head cut to the tokenizer's vocabulary
(the 2B's 32,000 rows to the embedded model's 4,096: 3% of its bytes); random text may open a
call, and that row's tokens then differ. `--dry-run`: the embedded model's shape on random
weights, CPU, 8 tokens. Prints one table, then one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from ..engine import Engine
from ..errors import ExpressLaneError
from ..sampling.params import SamplingParams
from ..serve.tools import auto_grammar, plan_tools
from ..structured.grammar import GrammarCompiler
from ..tokenizer import Tokenizer
from .auto_tools import CHATML, PARSER, TOOLS
from .serve_decode import model_parser
from .structured import bench_model

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


def measure(engine: Engine, tok: Tokenizer, max_tokens: int, repeats: int,
            temperature: float) -> tuple[dict, dict]:  # fmt: skip
    """({way: [decode tok/s per round]}, {way: every round gave no grammar's tokens})."""
    prompt = tok.encode_chat([{"role": "user", "content": ASK}])
    ways = {"none": None, **grammars(engine, tok)}

    def run(grammar) -> tuple[list[int], float]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0,
                                ignore_eos=True, grammar=grammar)  # fmt: skip
        ids = list(engine.generate(prompt, params))
        return ids, engine.stats.decode_tokens_per_s

    want = run(None)[0]  # also the untimed first use
    speeds: dict[str, list[float]] = {w: [] for w in ways}
    same = dict.fromkeys(ways, True)
    order = list(ways)
    for r in range(repeats):  # each round starts at the next way: no way always runs first
        for way in order[r % len(order) :] + order[: r % len(order)]:
            ids, tps = run(ways[way])
            same[way] = same[way] and ids == want
            speeds[way].append(tps)
    return speeds, same


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("free_grammar", __doc__)
    ap.set_defaults(repeats=4)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--preset", help="a preset's shape on random weights instead of a model")
    ap.add_argument("--tokenizer", help="with --preset: a folder with tokenizer.json "
                    "(default: the embedded model's)")  # fmt: skip
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--dry-run", action="store_true",
                    help="the embedded model's shape on random weights, CPU, 8 tokens")  # fmt: skip
    args = ap.parse_args(argv)
    if args.dry_run:  # the embedded model's shape: its tokenizer fits its vocabulary
        from ..assets import TRAINED

        args.preset, args.device, args.dtype = str(TRAINED), "cpu", "float32"
        args.max_tokens, args.repeats = 8, 1
    bad = args.max_tokens < 2 or args.repeats < 1 or args.temperature < 0 or \
        (args.threads is not None and args.threads < 1)  # fmt: skip
    try:
        if bad:
            raise ExpressLaneError("--max-tokens: at least 2; --repeats, --threads: at least 1; "
                                   "--temperature: not negative")  # fmt: skip
        if args.threads:
            torch.set_num_threads(args.threads)
        engine, tok, args.model = bench_model(args, cut_vocab=True)
        speeds, same = measure(engine, tok, args.max_tokens, args.repeats, args.temperature)
    except ExpressLaneError as e:  # a bad flag, an unknown model or preset, an absent device
        print(f"free_grammar: {e}", file=sys.stderr)
        return 2
    base = statistics.median(speeds["none"])
    rows = []
    print("| grammar | decode tok/s (median) | rounds | vs none | ms a token added | same tokens |")
    print("|---|---|---|---|---|---|")
    for way, tps in speeds.items():
        med = statistics.median(tps)
        added = 1e3 / med - 1e3 / base
        rows.append({"grammar": way, "tokens_per_s": med, "rounds": tps, "ratio": med / base,
                     "added_ms": added, "same_tokens": same[way]})  # fmt: skip
        rounds = " / ".join(f"{t:.1f}" for t in tps)
        print(f"| {way} | {med:.1f} | {rounds} | {med / base:.3f} | {added:.3f} | {same[way]} |")
    print(json.dumps({"model": args.model, "device": str(engine.device),
                      "max_tokens": args.max_tokens, "temperature": args.temperature,
                      "threads": torch.get_num_threads(), "same_tokens": all(same.values()),
                      "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
