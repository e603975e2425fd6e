"""A scripted agent conversation through the server: time to first token per turn, with and
without prefix reuse, in one run.

An agent loop sends its whole history every turn: a system prompt with tool definitions, the
task, then for every step the model's answer and the tool's output (file listings, source
files, test logs, grep hits, git history: generated here from a fixed seed, sized with the
model's tokenizer so that the last prompt is about `--target-tokens` long). Two servers run in
this process on one set of weights, each with its own engine and KV cache: one reuses the
cached prefix, one (`--no-prefix-reuse`) prefills every prompt whole. Every turn goes to both,
in alternating order, greedy; both continue from the reusing server's answer, and the table
says whether the other's answer was the same. TTFT is the server's own figure (request arrival
to first token, tokenization and queueing included, as in /metrics).

    python -m expresslane.bench.agent MODEL [--turns 10] [--target-tokens 3000]

Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack

import torch

from ..assets import default_model_dir
from ..checkpoint import load_model
from ..engine import Engine
from ..errors import ConfigError, ExpressLaneError
from ..tokenizer import Tokenizer

TOOLS = {
    "run_shell": "Run a shell command in the repository root; returns stdout and stderr.",
    "read_file": "Return the text of a file, with line numbers.",
    "write_file": "Replace a file's text. Arguments: path, text.",
    "search": "grep -rn a regular expression over the repository.",
    "run_tests": "Run pytest on the given paths; returns the report.",
}
SYSTEM = (
    "You are DevAgent, an autonomous software engineer working in a Python repository. Work "
    "in small steps: think briefly, then call exactly one tool per message by writing a JSON "
    'object {"tool": NAME, "arguments": {...}}. Read files before changing them, keep edits '
    "minimal, run the tests after every change, and stop when they pass. Never invent file "
    "contents or test results: ask a tool.\n\nTools:\n"
)
TASK = (
    "The test `tests/test_parser.py::test_nested_groups` fails since the last release. Find "
    "the cause and fix it without breaking the other tests."
)
WORDS = ("parse token group node scan emit stack frame buffer cursor span merge split lex "
         "reduce shift match rule state table cache index width depth").split()  # fmt: skip


# --- the script: tool outputs of every kind, sized in tokens -------------------------------
def _name(rng: random.Random, n: int = 2) -> str:
    return "_".join(rng.choice(WORDS) for _ in range(n))


def _listing(rng: random.Random) -> str:
    kind = rng.choice(("-rw-r--r--", "drwxr-xr-x"))
    return f"{kind} 1 dev dev {rng.randint(80, 48000):>6} Nov {rng.randint(1, 22):>2} " \
           f"{rng.randint(0, 23):02}:{rng.randint(0, 59):02} {_name(rng)}.py"  # fmt: skip


def _code(rng: random.Random) -> str:
    f, a, b = _name(rng), rng.choice(WORDS), rng.choice(WORDS)
    return rng.choice((
        f"def {f}({a}, {b}=None):\n    \"\"\"{a.title()} the {b} of a {rng.choice(WORDS)}.\"\"\"",
        f"    if {a} is None or len({a}) < {rng.randint(1, 9)}:\n        return []",
        f"    for i, {b} in enumerate(self.{a}s):\n        out.append(self.{f}({b}, i))",
        f"    {a} = {b}.{f}(start={rng.randint(0, 99)}, end=-1)  # keep the trailing {b}",
        f"class {a.title()}{b.title()}({rng.choice(WORDS).title()}Base):",
    ))  # fmt: skip


def _test_log(rng: random.Random) -> str:
    name = f"tests/test_{rng.choice(WORDS)}.py::test_{_name(rng)}"
    return rng.choice((f"{name} PASSED", f"{name} PASSED", f"{name} FAILED",
                       f"E       AssertionError: assert {rng.randint(0, 9)} == "
                       f"{rng.randint(10, 99)}", f"src/pkg/{rng.choice(WORDS)}.py:"
                       f"{rng.randint(1, 400)}: in {_name(rng)}"))  # fmt: skip


def _grep(rng: random.Random) -> str:
    return f"src/pkg/{rng.choice(WORDS)}.py:{rng.randint(1, 500)}:    {_code(rng).splitlines()[0]}"


def _git_log(rng: random.Random) -> str:
    return f"{rng.getrandbits(28):07x} {rng.choice(WORDS)}: {_name(rng, 3).replace('_', ' ')}"


KINDS = [("ls -la src/pkg", _listing), ("cat src/pkg/{}.py", _code), ("pytest -x -q", _test_log),
         ("grep -rn {} src", _grep), ("git log --oneline -n 40", _git_log)]  # fmt: skip


def tool_output(turn: int, fits: Callable[[str], bool], seed: int = 0) -> str:
    """The tool's answer at `turn`: lines of one kind of output while `fits(text)` holds."""
    rng = random.Random(seed * 1000 + turn)
    command, line = KINDS[turn % len(KINDS)]
    text = f"Tool output ($ {command.format(rng.choice(WORDS))}):\n{line(rng)}"
    while fits(longer := f"{text}\n{line(rng)}"):
        text = longer
    return text


def system_prompt() -> str:
    return SYSTEM + "\n".join(f"- {name}: {doc}" for name, doc in TOOLS.items())


# --- the run --------------------------------------------------------------------------------
def chat(url: str, messages: list[dict], max_tokens: int) -> dict:
    body = dict(model="agent", messages=messages, max_tokens=max_tokens, temperature=0)
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the server's own words (a prompt too long, ...)
        detail = json.loads(e.read()).get("error", {}).get("message", e.reason)
        raise ConfigError(f"the server answered {e.code}: {detail}") from None


def run(args: argparse.Namespace) -> dict:
    from ..cli.run import set_cpu_threads
    from ..cli.serve import serving
    from ..serve import create_app

    path = args.model or str(default_model_dir())
    model = load_model(path, device=args.device, dtype=args.dtype, progress=False)
    tok = Tokenizer.from_dir(path)
    engines = {
        reuse: Engine(model, max_model_len=args.max_model_len, prefix_reuse=reuse)
        for reuse in (True, False)
    }
    set_cpu_threads(engines[True], args.threads)
    if args.no_ring_snapshot:  # what the snapshot brings: rings resume only as they are
        engines[True].prefix.snapshot = None
    system = system_prompt()
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TASK}]
    fixed = len(tok.encode_chat(messages))
    if args.target_tokens + args.answer_tokens >= engines[True].max_len:
        raise ConfigError(
            f"--target-tokens {args.target_tokens} + --answer-tokens "
            f"{args.answer_tokens}: over the context of {engines[True].max_len}"
        )
    rows = []
    with ExitStack() as stack:
        urls = {
            reuse: stack.enter_context(serving(create_app(eng, tok, served_model_name="agent")))
            for reuse, eng in engines.items()
        }
        for url in urls.values():  # one-time costs (first forward, allocations) stay out
            chat(url, [{"role": "user", "content": "hello"}], 2)
        answer = ""
        for turn in range(1, args.turns + 1):
            if turn > 1:  # the prompt grows evenly from `fixed` to the target
                plan = fixed + (args.target_tokens - fixed) * (turn - 1) // (args.turns - 1)
                done = [*messages, {"role": "assistant", "content": answer}]

                def fits(text: str, done=done, plan=plan) -> bool:
                    return len(tok.encode_chat([*done, {"role": "user", "content": text}])) <= plan

                messages = [*done, {"role": "user", "content": tool_output(turn, fits)}]
            order = (True, False) if turn % 2 else (False, True)
            got = {reuse: chat(urls[reuse], messages, args.answer_tokens) for reuse in order}
            answer = got[True]["choices"][0]["message"]["content"]
            rows.append(_row(turn, got))
    return {"model": path, "device": str(engines[True].device),
            "dtype": str(engines[True].dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "turns": args.turns,
            "answer_tokens": args.answer_tokens, "rows": rows,
            "snapshot_hits": engines[True].prefix.snapshot_hits,
            "ring_snapshot": not args.no_ring_snapshot}  # fmt: skip


def _row(turn: int, got: dict) -> dict:
    hot, cold = got[True], got[False]
    prompt = hot["usage"]["prompt_tokens"]
    cached = hot["usage"]["prompt_tokens_details"]["cached_tokens"]
    t_hot, t_cold = hot["timings"]["ttft_ms"], cold["timings"]["ttft_ms"]
    return {
        "turn": turn,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "new_tokens": prompt - cached,
        "ttft_ms_reuse": t_hot,
        "ttft_ms_cold": t_cold,
        "speedup": round(t_cold / t_hot, 2),
        "same_answer": hot["choices"][0]["message"]["content"]
        == cold["choices"][0]["message"]["content"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m expresslane.bench.agent", description=__doc__)
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: embedded)")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--target-tokens", type=int, default=3000, help="prompt length at the end")
    p.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of every answer")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (as `run`)")
    p.add_argument(
        "--no-ring-snapshot",
        action="store_true",
        help="the reusing server keeps no snapshot of its sliding-window rings",
    )
    args = p.parse_args(argv)
    if args.turns < 1 or args.answer_tokens < 1 or args.target_tokens < 1:
        print("error: --turns, --answer-tokens and --target-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        out = run(args)
    except ExpressLaneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'new':>6} {'TTFT reuse ms':>14} "
          f"{'TTFT cold ms':>13} {'x':>6}  same answer")  # fmt: skip
    for r in out["rows"]:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} "
              f"{r['new_tokens']:>6} {r['ttft_ms_reuse']:>14.1f} {r['ttft_ms_cold']:>13.1f} "
              f"{r['speedup']:>6.2f}  {r['same_answer']}")  # fmt: skip
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
