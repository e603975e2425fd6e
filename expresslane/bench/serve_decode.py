"""Decode speed through the server, alone and beside a busy neighbour, against `run`.

    python -m expresslane.bench.serve_decode [MODEL] [--tokens 256] [--repeats 3]

A user meets the engine through `serve` as often as through `run`, and a server lives through
whatever else the machine runs. This starts `expresslane serve MODEL` in its own process, once
with no flags but the port (the thread count revised before each request: step/threads.py
`ThreadGovernor`) and once with `--threads` fixed at the usable cores. Each is timed alone, then
with a neighbour (a process spinning on one core) started beside it: `--repeats` greedy chat
requests (`--tokens` tokens, `ignore_eos`; the decode speed the server reports in `timings`),
each phase after one untimed request (the first request after a change runs on the count the
last interval chose). Then `expresslane run MODEL --json` of the same chat, alone, `--repeats`
times. MODEL: a checkpoint folder or GGUF file (default SmolLM2-135M-Instruct's Q4_1 GGUF,
fetched once). Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack

from ..errors import ExpressLaneError
from ..gguf.fetch import model_or_smollm2
from ..step.threads import usable_cores
from .agent import _post, _stop, start_server

CHAT = "Write a long story about a dragon."
SPIN = "while True: pass"


def server_decode(url: str, tokens: int) -> dict:
    body = {"model": "agent", "messages": [{"role": "user", "content": CHAT}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
    timings = _post(url + "/v1/chat/completions", body)["timings"]
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        line = next(x for x in r.read().decode().splitlines() if x.startswith(
            "expresslane:cpu_threads"))  # fmt: skip
    return {"tokens_per_s": timings["decode_tokens_per_s"], "threads": int(float(line.split()[-1]))}


def run_decode(model: str, tokens: int, flags: tuple[str, ...] = (), preexec=None) -> dict:
    """`expresslane run MODEL --json` of the chat, with `flags`; `preexec` runs in the child
    before it starts (bench/cpu_quota.py moves it into a cgroup there)."""
    cmd = [sys.executable, "-m", "expresslane", "run", model, "--chat", CHAT, "--max-tokens",
           str(tokens), "--ignore-eos", "--temperature", "0", "--json", *flags]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, preexec_fn=preexec)
    if proc.returncode != 0:
        raise ExpressLaneError(f"`{' '.join(cmd)}` failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"tokens_per_s": out["decode_tokens_per_s"], "threads": out.get("threads")}


def _summary(rows: list[dict]) -> dict:
    speeds = [r["tokens_per_s"] for r in rows]
    return {"median": statistics.median(speeds), "min": min(speeds),
            "threads": sorted({r["threads"] for r in rows})}  # fmt: skip


def phase(url: str, tokens: int, repeats: int) -> dict:
    server_decode(url, 8)  # untimed: first-use costs, and a revision of the thread count
    return _summary([server_decode(url, tokens) for _ in range(repeats)])


def measure(model: str, tokens: int, repeats: int) -> dict:
    out = {}
    for name, threads in (("serve", None), (f"serve --threads {usable_cores()}", usable_cores())):
        with ExitStack() as stack:
            flags = argparse.Namespace(device="auto", dtype="auto", max_model_len=None,
                                       threads=threads)  # fmt: skip
            url = start_server(stack, model, True, flags)
            row = {"alone": phase(url, tokens, repeats)}
            spin = subprocess.Popen([sys.executable, "-c", SPIN])
            stack.callback(_stop, spin)
            time.sleep(1.0)
            row["busy"] = phase(url, tokens, repeats)
        out[name] = row
    out["run"] = {"alone": _summary([run_decode(model, tokens) for _ in range(repeats)])}
    return out


def model_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a bench run as `python -m expresslane.bench.<module>`: MODEL (a checkpoint
    folder or GGUF file; default SmolLM2's GGUF) and --repeats."""
    ap = argparse.ArgumentParser(prog=f"python -m expresslane.bench.{module}",
                                 description=doc.split("\n\n")[0])  # fmt: skip
    ap.add_argument("model", nargs="?", default=None, help="checkpoint folder or GGUF file")
    ap.add_argument("--repeats", type=int, default=3)
    return ap


def measured(name: str, args: argparse.Namespace, problem: str | None, measure):
    """`measure(model)` with the bench's MODEL (SmolLM2's GGUF where none was given), or None
    once a bad flag (`problem`) or the measurement's error is printed as `name: why` (the bench
    then exits 2). `args.model` is left as the model measured."""
    try:
        if problem:
            raise ExpressLaneError(problem)
        args.model = model_or_smollm2(args.model)
        return measure(args.model)
    except ExpressLaneError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("serve_decode", __doc__)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    bad = args.tokens < 2 or args.repeats < 1
    problem = "--tokens: at least 2; --repeats: at least 1" if bad else None
    res = measured("serve_decode", args, problem,
                   lambda model: measure(model, args.tokens, args.repeats))  # fmt: skip
    if res is None:
        return 2
    print("| way | alone: decode tok/s, median (min) | threads | one core busy: tok/s | threads |")
    print("|---|---|---|---|---|")
    for name, row in res.items():
        cells = []
        for key in ("alone", "busy"):
            r = row.get(key)
            cells += [f"{r['median']:.1f} ({r['min']:.1f})", "/".join(map(str, r["threads"]))] \
                if r else ["-", "-"]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(json.dumps({"model": str(args.model), "tokens": args.tokens, "cores": usable_cores(),
                      **res}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
