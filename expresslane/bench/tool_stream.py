"""A forced tool call streamed through the server: when its arguments start to arrive, against
when the call is whole.

    python -m expresslane.bench.tool_stream [MODEL] [--max-tokens 200] [--repeats 3]

An agent's UI shows a tool call as the model writes it (a file being written, a shell command
being typed), so the streamed call's arguments should come as they are decoded, not in one piece
when the answer ends. This starts `expresslane serve MODEL` in its own process and asks, in a
stream, for a forced call (`tool_choice` names it) to `write_file(path, text)` with `--max-tokens`
tokens of budget (SmolLM2 writes a long text there). Per request: the time to the first chunk,
to the call's first delta (id and name), to its first argument piece, and to its last, from the
moment the request is sent; the number of argument pieces; whether the joined arguments parse.
Before serve/tool_stream.py a call came whole in the finishing chunk, so the last column is also
when the call arrived before. A plain greedy chat answer is timed three times before the calls
and three times after them (a grammar's compile once left every later request three times
slower: step/threads.py). MODEL: a checkpoint folder or GGUF file (default
SmolLM2-135M-Instruct's Q4_1 GGUF, fetched once). Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from contextlib import ExitStack

from .agent import _post, start_server
from .serve_decode import measured, model_parser

WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a text file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                   "text": {"type": "string"}}, "required": ["path", "text"]}}}  # fmt: skip
ASK = "Write a poem of twenty lines about the sea to poem.txt."


def streamed_call(url: str, max_tokens: int, model: str = "agent") -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": ASK}], "tools": [WRITE],
            "tool_choice": {"type": "function", "function": {"name": "write_file"}},
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    t0, at, pieces, args, finish = time.perf_counter(), {}, 0, "", None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ms = (time.perf_counter() - t0) * 1e3
            at.setdefault("chunk", ms)
            choice = json.loads(line[6:])["choices"][0]
            finish = choice.get("finish_reason") or finish
            for d in choice["delta"].get("tool_calls") or []:
                at.setdefault("call", ms)
                if d["function"].get("arguments"):
                    at.setdefault("args", ms)
                    at["last"], pieces = ms, pieces + 1
                    args += d["function"]["arguments"]
    try:
        parses = isinstance(json.loads(args), dict)
    except ValueError:
        parses = False
    return {**at, "pieces": pieces, "chars": len(args), "parses": parses, "finish": finish}


def plain_decode(url: str) -> float:
    """The server's decode tokens/s for a plain greedy chat answer of 128 tokens."""
    body = {"model": "agent", "messages": [{"role": "user", "content": ASK}], "max_tokens": 128,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    return _post(url + "/v1/chat/completions", body)["timings"]["decode_tokens_per_s"]


def measure(model: str, max_tokens: int, repeats: int) -> tuple[list[dict], dict]:
    """(the forced calls' rows, plain decode tok/s before and after them: a grammar's compile
    once slowed every later request threefold, step/threads.py)."""
    with ExitStack() as stack:
        flags = argparse.Namespace(device="auto", dtype="auto", max_model_len=None, threads=None)
        url = start_server(stack, model, True, flags)
        plain_decode(url)  # untimed: first-use costs
        before = statistics.median(plain_decode(url) for _ in range(3))
        streamed_call(url, 8)  # untimed: the grammar's compile
        rows = [streamed_call(url, max_tokens) for _ in range(repeats)]
        after = statistics.median(plain_decode(url) for _ in range(3))
        return rows, {"before": before, "after": after}


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("tool_stream", __doc__)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args(argv)
    bad = args.max_tokens < 8 or args.repeats < 1
    problem = "--max-tokens: at least 8; --repeats: at least 1" if bad else None
    res = measured("tool_stream", args, problem,
                   lambda model: measure(model, args.max_tokens, args.repeats))  # fmt: skip
    if res is None:
        return 2
    rows, plain = res
    cols = ("chunk", "call", "args", "last")
    print("| request | first chunk, ms | call's first delta, ms | first argument piece, ms | "
          "last argument piece, ms | pieces | chars | parses | finish |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        times = " | ".join(f"{r[c]:.0f}" if c in r else "-" for c in cols)
        print(f"| {i} | {times} | {r['pieces']} | {r['chars']} | {r['parses']} | {r['finish']} |")
    medians = {c: statistics.median(r[c] for r in rows) for c in cols if all(c in r for r in rows)}
    print(f"plain decode, tok/s (median of 3): {plain['before']:.1f} before the calls, "
          f"{plain['after']:.1f} after")  # fmt: skip
    print(json.dumps({"model": str(args.model), "max_tokens": args.max_tokens, "rows": rows,
                      "median_ms": medians, "plain_tokens_per_s": plain}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
