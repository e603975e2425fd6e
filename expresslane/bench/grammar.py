"""Grammar engines compared: schema compile time and mask time per token, llguidance vs xgrammar.

    python -m expresslane.bench.grammar [MODEL ...]   (default: the embedded model and SmolLM2)

For each tokenizer and engine: the time to compile each schema of the suite (schemas.py; the
engine's own cache off or a fresh compiler per schema) and the time to compute one token mask,
over the same token walk for both engines. The walk picks, with a fixed seed, a random token
the grammar allows at each step (the end of text as soon as it is allowed), up to 48 tokens per
schema. Masks are the engines' packed bitmasks on the CPU, one thread. Prints one table, then
one JSON line. The engines are imported here only (neither is a dependency of this module's
importers); a missing one prints its row as an error.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ..tokenizer import Tokenizer
from .schemas import SCHEMAS

WALK = 48
COMPACT = {"whitespace_flexible": False}  # both engines: no whitespace between tokens


def _hf_tokenizer(tok: Tokenizer):
    backend = getattr(tok._backend, "tk", None)
    if backend is None:
        raise SystemExit("the grammar engines need a tokenizer.json (tokenizers) tokenizer")
    return backend


def walk(matcher, n_vocab: int, eos: int, rng: random.Random) -> list[int]:
    """A random token path through an llguidance matcher (the path both engines replay)."""
    import llguidance.torch as lt

    mask = lt.allocate_token_bitmask(1, n_vocab)
    path: list[int] = []
    while len(path) < WALK and not matcher.is_stopped():
        lt.fill_next_token_bitmask(matcher, mask)
        bits = ((mask[0, :, None] >> torch.arange(32)) & 1).view(-1)[:n_vocab]
        allowed = bits.nonzero().view(-1).tolist()
        if not allowed:
            break
        t = eos if eos in allowed else rng.choice(allowed)
        path.append(t)
        if t == eos or not matcher.consume_token(t):
            break
    return path


def bench_llguidance(tok: Tokenizer, n_vocab: int, eos: int) -> tuple[dict, dict]:
    import llguidance
    import llguidance.torch as lt

    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(_hf_tokenizer(tok).to_str(), n_vocab=n_vocab, eos_token=eos)
    setup = time.perf_counter() - t
    compile_s, mask_s, paths = [], [], {}
    mask = lt.allocate_token_bitmask(1, n_vocab)
    for name, schema in SCHEMAS.items():
        t = time.perf_counter()
        m = llguidance.LLMatcher(
            lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
        )
        lt.fill_next_token_bitmask(m, mask)  # compilation is lazy: the first mask finishes it
        compile_s.append(time.perf_counter() - t)
        if m.is_error():
            raise RuntimeError(f"{name}: {m.get_error()}")
        paths[name] = path = walk(m.deep_copy(), n_vocab, eos, random.Random(name))
        for tk in path[:-1]:
            m.consume_token(tk)
            t = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask)
            mask_s.append(time.perf_counter() - t)
    return _row("llguidance", setup, compile_s, mask_s), paths


def bench_xgrammar(tok: Tokenizer, n_vocab: int, eos: int, paths: dict) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=_hf_tokenizer(tok))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab, stop_token_ids=[eos])
    setup = time.perf_counter() - t
    compile_s, mask_s = [], []
    mask = xgr.allocate_token_bitmask(1, n_vocab)
    for name, schema in SCHEMAS.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )
        m = xgr.GrammarMatcher(compiled)
        m.fill_next_token_bitmask(mask)
        compile_s.append(time.perf_counter() - t)
        for tk in paths[name][:-1]:
            if not m.accept_token(tk):
                break  # the engines disagree on a path: its remaining masks are not timed
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            mask_s.append(time.perf_counter() - t)
    return _row("xgrammar", setup, compile_s, mask_s)


def _row(engine: str, setup: float, compile_s: list[float], mask_s: list[float]) -> dict:
    q = statistics.quantiles(mask_s, n=100) if len(mask_s) > 1 else [0.0] * 99
    return {
        "engine": engine,
        "tokenizer_setup_ms": setup * 1e3,
        "compile_ms_median": statistics.median(compile_s) * 1e3,
        "compile_ms_max": max(compile_s) * 1e3,
        "mask_us_median": statistics.median(mask_s) * 1e6 if mask_s else 0.0,
        "mask_us_p99": q[98] * 1e6,
        "masks": len(mask_s),
    }


def _models(names: list[str]) -> list[tuple[str, Tokenizer, int, int]]:
    out = []
    for name in names:
        if name == "embedded":
            from ..assets import default_model_dir

            path = default_model_dir()
        elif name == "smollm2":
            from ..gguf.fetch import fetch_smollm2

            path = fetch_smollm2()
        else:
            path = name
        tok = Tokenizer.from_dir(path)
        out.append((name, tok, tok.vocab_size, tok.eos_ids[0]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.grammar")
    ap.add_argument("models", nargs="*", default=["embedded", "smollm2"],
                    help="'embedded', 'smollm2' or a model path")  # fmt: skip
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, tok, n_vocab, eos in _models(args.models):
        paths = {}
        try:
            row, paths = bench_llguidance(tok, n_vocab, eos)
        except Exception as e:  # a missing or failing engine is a row, not the end
            row = {"engine": "llguidance", "error": str(e)}
        rows.append({"model": name, "vocab": n_vocab, **row})
        try:
            row = bench_xgrammar(tok, n_vocab, eos, paths) if paths else {"error": "no walk"}
        except Exception as e:
            row = {"engine": "xgrammar", "error": str(e)}
        rows.append({"model": name, "vocab": n_vocab, "engine": "xgrammar", **row})
    head = (f"{'model':<10} {'vocab':>6} {'engine':<11} {'setup ms':>9} {'compile ms':>11} "
            f"{'max ms':>8} {'mask us':>8} {'p99 us':>8} {'masks':>6}")  # fmt: skip
    print(f"{len(SCHEMAS)} schemas, a {WALK}-token walk each, 1 thread")
    print(head)
    for r in rows:
        lead = f"{r['model'][:10]:<10} {r['vocab']:>6} {r['engine']:<11}"
        if "error" in r:
            print(f"{lead} ERROR {r['error'][:120]}")
            continue
        print(f"{lead} {r['tokenizer_setup_ms']:9.1f} {r['compile_ms_median']:11.2f} "
              f"{r['compile_ms_max']:8.1f} {r['mask_us_median']:8.1f} {r['mask_us_p99']:8.1f} "
              f"{r['masks']:6d}")  # fmt: skip
    print(json.dumps({"bench": "grammar", "schemas": len(SCHEMAS), "rows": rows}))


if __name__ == "__main__":
    main()
