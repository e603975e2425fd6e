"""A scripted agent conversation through the server: time to first token per turn, with and
without prefix reuse, in one run.

An agent loop sends its whole history every turn: a system prompt with tool definitions, the
task, then for every step the model's answer and the tool's output (file listings, source
files, test logs, grep hits, git history: generated here from a fixed seed, sized with the
model's tokenizer so that the last prompt is about `--target-tokens` long). Two servers run in
their own processes (`expresslane serve`): one reuses the cached prefix, one
(`--no-prefix-reuse`) prefills every prompt whole. Every turn goes to both, in alternating
order, greedy; both continue from the reusing server's answer, and the table says whether the
other's answer was the same. TTFT is the server's own figure (request arrival to first token,
tokenization and queueing included, as in /metrics). `--engine` drives two Engines in this
process instead (TTFT from the request's start in the engine), where `--no-ring-snapshot`
measures what the rings' snapshot (prefix.py) brings.

    python -m expresslane.bench.agent MODEL [--turns 10] [--target-tokens 3000] [--engine]
                                         [--api responses|messages]

`--api responses` sends the reusing server's turns through OpenAI's Responses API, each with
only its new messages and the last answer's `previous_response_id`; `--api messages` through
Anthropic's Messages API, the whole conversation each time.

Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack

import torch

from ..assets import default_model_dir
from ..checkpoint import load_model
from ..engine import Engine
from ..errors import ConfigError, ExpressLaneError
from ..parallel.launch import free_port
from ..sampling.params import SamplingParams
from ..textgen import generate_text
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
# A sender takes the messages and max_tokens and returns the answer's text and figures.
Send = Callable[[list[dict], int], dict]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the server's own words (a prompt too long, ...)
        detail = json.loads(e.read()).get("error", {}).get("message", e.reason)
        raise ConfigError(f"the server answered {e.code}: {detail}") from None


def http_sender(url: str) -> Send:
    """Greedy chat completions from a server; TTFT and cached tokens as it reports them."""

    def send(messages: list[dict], max_tokens: int) -> dict:
        body = dict(model="agent", messages=messages, max_tokens=max_tokens, temperature=0)
        out = _post(url + "/v1/chat/completions", body)
        usage = out["usage"]
        return {"text": out["choices"][0]["message"]["content"],
                "ttft_ms": out["timings"]["ttft_ms"], "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}  # fmt: skip

    return send


def responses_sender(url: str) -> Send:
    """Greedy turns through the Responses API, as an agent on it sends them: a turn that
    continues the last one sends only its new messages, with `previous_response_id` (the
    server keeps the conversation); any other starts afresh."""
    last: dict = {"id": None, "conversation": None}

    def send(messages: list[dict], max_tokens: int) -> dict:
        prev = last["conversation"]
        goes_on = prev is not None and messages[: len(prev)] == prev
        body = dict(model="agent", input=messages[len(prev) :] if goes_on else messages,
                    max_output_tokens=max_tokens, temperature=0)  # fmt: skip
        if goes_on:
            body["previous_response_id"] = last["id"]
        out = _post(url + "/v1/responses", body)
        text = "".join(part["text"] for item in out["output"] if item["type"] == "message"
                       for part in item["content"])  # fmt: skip
        last.update(id=out["id"], conversation=[*messages, {"role": "assistant", "content": text}])
        usage = out["usage"]
        return {"text": text, "ttft_ms": out["timings"]["ttft_ms"],
                "prompt_tokens": usage["input_tokens"],
                "cached_tokens": usage["input_tokens_details"]["cached_tokens"]}  # fmt: skip

    return send


def messages_sender(url: str) -> Send:
    """Greedy turns through Anthropic's Messages API, as Claude Code sends them: the whole
    conversation every turn (the API keeps nothing), `system` apart."""

    def send(messages: list[dict], max_tokens: int) -> dict:
        system = "".join(m["content"] for m in messages if m["role"] == "system")
        turns = [m for m in messages if m["role"] != "system"]
        body = dict(model="agent", system=system, messages=turns, max_tokens=max_tokens,
                    temperature=0)  # fmt: skip
        out = _post(url + "/v1/messages", body)
        usage = out["usage"]
        return {"text": "".join(b["text"] for b in out["content"] if b["type"] == "text"),
                "ttft_ms": out["timings"]["ttft_ms"], "prompt_tokens": usage["input_tokens"],
                "cached_tokens": usage["cache_read_input_tokens"]}  # fmt: skip

    return send


def engine_sender(engine: Engine, tok: Tokenizer) -> Send:
    """The same request straight to an Engine: TTFT from the request's start in the engine."""

    def send(messages: list[dict], max_tokens: int) -> dict:
        ids = tok.encode_chat(messages)
        params = SamplingParams(max_tokens=max_tokens)
        text = "".join(t for t, _ in generate_text(engine, tok, ids, params))
        st = engine.stats
        return {"text": text, "ttft_ms": round(st.ttft_s * 1e3, 3), "prompt_tokens": len(ids),
                "cached_tokens": st.cached_tokens or 0}  # fmt: skip

    return send


def converse(send: dict[bool, Send], tok: Tokenizer, args: argparse.Namespace) -> list[dict]:
    """The scripted conversation, every turn to both senders (True: reusing, False: cold)."""
    messages = [{"role": "system", "content": system_prompt()}, {"role": "user", "content": TASK}]
    fixed = len(tok.encode_chat(messages))
    for s in send.values():  # one-time costs (first forward, allocations) stay out
        s([{"role": "user", "content": "hello"}], 2)
    rows, answer = [], ""
    for turn in range(1, args.turns + 1):
        if turn > 1:  # the prompt grows evenly from `fixed` to the target
            plan = fixed + (args.target_tokens - fixed) * (turn - 1) // (args.turns - 1)
            done = [*messages, {"role": "assistant", "content": answer}]

            def fits(text: str, done=done, plan=plan) -> bool:
                return len(tok.encode_chat([*done, {"role": "user", "content": text}])) <= plan

            messages = [*done, {"role": "user", "content": tool_output(turn, fits)}]
        order = (True, False) if turn % 2 else (False, True)
        got = {reuse: send[reuse](messages, args.answer_tokens) for reuse in order}
        answer = got[True]["text"]
        hot, cold = got[True], got[False]
        rows.append({
            "turn": turn,
            "prompt_tokens": hot["prompt_tokens"],
            "cached_tokens": hot["cached_tokens"],
            "new_tokens": hot["prompt_tokens"] - hot["cached_tokens"],
            "ttft_ms_reuse": hot["ttft_ms"],
            "ttft_ms_cold": cold["ttft_ms"],
            "speedup": round(cold["ttft_ms"] / hot["ttft_ms"], 2),
            "same_answer": hot["text"] == cold["text"],
        })  # fmt: skip
    return rows


def start_server(stack: ExitStack, path: str, reuse: bool, args: argparse.Namespace,
                 extra: tuple[str, ...] = ()) -> str:  # fmt: skip
    """`expresslane serve` in its own process (stopped when `stack` closes); its base URL.
    `extra`: more of serve's flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "expresslane", "serve", path, "--port", str(port),
           "--served-model-name", "agent", "--log-level", "warning", "--device", args.device,
           "--dtype", args.dtype]  # fmt: skip
    for flag, value in (("--max-model-len", args.max_model_len), ("--threads", args.threads)):
        if value is not None:
            cmd += [flag, str(value)]
    if not reuse:
        cmd.append("--no-prefix-reuse")
    cmd += extra
    log = stack.enter_context(tempfile.TemporaryFile())
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(_stop, proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return url
        except OSError:  # not listening yet, or 503 while the model loads
            time.sleep(0.5)
    log.seek(0)
    raise ConfigError(f"`{' '.join(cmd)}` did not come up: {log.read().decode()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def run(args: argparse.Namespace) -> dict:
    path = args.model or str(default_model_dir())
    tok = Tokenizer.from_dir(path)
    out = {"model": path, "mode": "engine" if args.engine else "server", "turns": args.turns,
           "answer_tokens": args.answer_tokens}  # fmt: skip
    with ExitStack() as stack:
        if args.engine:
            if args.threads:
                torch.set_num_threads(args.threads)
            model = load_model(path, device=args.device, dtype=args.dtype, progress=False)
            engines = {r: Engine(model, args.max_model_len, prefix_reuse=r) for r in (True, False)}
            if args.no_ring_snapshot:  # what the snapshot brings: rings resume only as they are
                engines[True].prefix.snapshot = None
            send = {r: engine_sender(e, tok) for r, e in engines.items()}
            max_len = engines[True].max_len
            out.update(device=str(engines[True].device), threads=torch.get_num_threads(),
                       ring_snapshot=not args.no_ring_snapshot)  # fmt: skip
        else:
            urls = {r: start_server(stack, path, r, args) for r in (True, False)}
            # --api responses / messages: the reusing server gets that API's turns (the Responses
            # API only the new messages each time), the other whole chat histories
            hot = {"responses": responses_sender, "messages": messages_sender}.get(
                args.api, http_sender
            )
            send = {r: (hot if r else http_sender)(u) for r, u in urls.items()}
            out["api"] = args.api
            with urllib.request.urlopen(urls[True] + "/v1/models", timeout=60) as r:
                max_len = json.loads(r.read())["data"][0]["max_model_len"]
        if args.target_tokens + args.answer_tokens >= max_len:
            raise ConfigError(f"--target-tokens {args.target_tokens} + --answer-tokens "
                              f"{args.answer_tokens}: over the context of {max_len}")  # fmt: skip
        out["rows"] = converse(send, tok, args)
        if args.engine:
            out["snapshot_hits"] = engines[True].prefix.snapshot_hits
    return out


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
    p.add_argument("--engine", action="store_true",
                   help="drive two Engines in this process instead of two servers")  # fmt: skip
    p.add_argument(
        "--api",
        choices=("chat", "responses", "messages"),
        default="chat",
        help="the reusing server's API (responses: previous_response_id turns; messages: "
        "Anthropic's, the whole conversation every turn)",
    )
    p.add_argument("--no-ring-snapshot", action="store_true",
                   help="with --engine: the reusing engine keeps no ring snapshot")  # fmt: skip
    args = p.parse_args(argv)
    if args.turns < 1 or args.answer_tokens < 1 or args.target_tokens < 1:
        print("error: --turns, --answer-tokens and --target-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.api != "chat" and args.engine:
        print(f"error: --api {args.api} needs the servers (not --engine)", file=sys.stderr)
        return 2
    if args.no_ring_snapshot and not args.engine:
        print("error: --no-ring-snapshot needs --engine (a server has no such knob)",
              file=sys.stderr)  # fmt: skip
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
