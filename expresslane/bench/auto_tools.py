"""`tool_choice: auto` through the server: decode speed, and whether the calls the model opens
parse and match their schemas.

    python -m expresslane.bench.auto_tools [MODEL] [--max-tokens 256] [--repeats 3]
                                          [--temperature 0.0] [--convention hermes]

This starts `expresslane serve MODEL` in its own process and sends a set of chat requests, each
with two tools (get_weather, get_time) and `tool_choice: "auto"`, `--repeats` times (greedy, or
sampled at `--temperature` with seeds 0, 1, ...: a row per seed).
Since serve/tools.py's free grammar, such a request decodes free text checked a token at a time
and a call held to its schema once `<tool_call>` opens it; before, nothing held it. Per
request: the decode tokens/s the server reports (median), the tokens, a hash of the answer (the
same text with and without the grammar: compare two trees' runs), whether a call was opened,
the calls returned and whether each names a tool with arguments its schema takes (`jsonschema`
where installed). To time the tree before the grammar, run this file there (a worktree, with
PYTHONPATH set to it). MODEL: a checkpoint folder or GGUF file (default SmolLM2-135M-Instruct's
Q4_1 GGUF, fetched once). Prints one table, then one JSON line.

`--convention mistral|llama3` serves the model with a ChatML template of this file's that
renders the tools and asks for calls in that convention (`[TOOL_CALLS] [...]`, or a bare
`{"name", "parameters"}` answer), with vLLM's `--tool-call-parser` for it: the free grammar of
that convention at work on a model whose own template has no tools (SmolLM2's markers are plain
text). `hermes` (the default) keeps the model's template and the generic prompt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack

from .agent import _post, start_server
from .serve_decode import measured, model_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
     "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                    "required": ["zone"]}}},
]  # fmt: skip
ASKS = [
    "Write a long story about a dragon.",
    "Explain how a hash map works.",
    "What is the weather in Paris right now?",
    "What time is it in Tokyo?",
    "List ten fruits and their colours.",
    "Write a Python function that reverses a list.",
    "Reply only with a tool call to get_time for UTC.",
]


ASK_FOR = {
    "mistral": 'To call functions, answer only [TOOL_CALLS] [{"name": <function name>, '
               '"arguments": <arguments object>}]',
    "llama3": 'To call a function, answer only {"name": <function name>, "parameters": '
              "<parameters object>}",
}  # fmt: skip
PARSER = {"mistral": "mistral", "llama3": "llama3_json"}
CHATML = ("{% if tools %}<|im_start|>system\nFunctions: {{ tools | tojson }}\n{ask}<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
          "<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip
MARKER = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "{"}


def serve_flags(convention: str, folder: str) -> tuple[str, ...]:
    """serve's flags for a convention: a template file written into `folder`, and the parser."""
    if convention == "hermes":
        return ()
    path = f"{folder}/{convention}.jinja"
    with open(path, "w") as f:
        f.write(CHATML.replace("{ask}", ASK_FOR[convention]))
    return ("--chat-template", path, "--tool-call-parser", PARSER[convention])


def ask(url: str, question: str, max_tokens: int, temperature: float = 0.0, seed: int = 0,
        model: str = "agent", convention: str = "hermes") -> dict:  # fmt: skip
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
    }
    out = _post(url + "/v1/chat/completions", body)
    msg, timings = out["choices"][0]["message"], out["timings"]
    calls = msg.get("tool_calls") or []
    text = (msg.get("content") or "") + json.dumps(calls and [c["function"] for c in calls])
    return {"tps": timings["decode_tokens_per_s"], "tokens": out["usage"]["completion_tokens"],
            "hash": hashlib.sha256(text.encode()).hexdigest()[:12],
            "opened": _opened(msg.get("content") or "", convention) or bool(calls),
            "calls": len(calls), "valid": all(_valid(c) for c in calls),
            "finish": out["choices"][0]["finish_reason"]}  # fmt: skip


def _opened(content: str, convention: str) -> bool:
    """A call begun in the text (one the parse did not return)."""
    marker = MARKER[convention]
    return content.lstrip().startswith(marker) if convention == "llama3" else marker in content


def _valid(call: dict) -> bool:
    fn = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    schema = fn.get(call["function"]["name"])
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:
        return schema is not None and isinstance(args, dict)
    return schema is not None and jsonschema.Draft202012Validator(schema).is_valid(args)


def measure(model: str, max_tokens: int, repeats: int, temperature: float = 0.0,
            convention: str = "hermes") -> list[dict]:  # fmt: skip
    with ExitStack() as stack:
        flags = argparse.Namespace(device="auto", dtype="auto", max_model_len=None, threads=None)
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        url = start_server(stack, model, True, flags, serve_flags(convention, folder))
        ask(url, ASKS[0], 8)  # untimed: first-use costs (the grammar's compile among them)
        rows = []
        for q in ASKS:
            runs = [ask(url, q, max_tokens, temperature, seed, convention=convention)
                    for seed in range(repeats)]  # fmt: skip
            if temperature == 0:  # the same answer each time: one row, the median speed
                runs = [{**runs[-1], "tps": statistics.median(r["tps"] for r in runs)}]
            rows += [{"ask": q, **r} for r in runs]
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("auto_tools", __doc__)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--convention", choices=sorted(MARKER), default="hermes")
    args = ap.parse_args(argv)
    bad = args.max_tokens < 1 or args.repeats < 1
    problem = "--max-tokens and --repeats: at least 1" if bad else None
    rows = measured("auto_tools", args, problem, lambda model: measure(
        model, args.max_tokens, args.repeats, args.temperature, args.convention))  # fmt: skip
    if rows is None:
        return 2
    print(
        "| request | tokens | decode tok/s | answer hash | call opened | calls | valid | finish |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['ask']} | {r['tokens']} | {r['tps']:.1f} | {r['hash']} | {r['opened']} | "
            f"{r['calls']} | {r['valid']} | {r['finish']} |"
        )
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["tokens"] / r["tps"] for r in rows if r["tps"])
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                      "temperature": args.temperature, "convention": args.convention, "rows": rows,
                      "tokens_per_s": tokens / seconds if seconds else 0.0}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
