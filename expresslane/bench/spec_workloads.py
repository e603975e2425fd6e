"""The workloads of the speculative decoding benchmark: chat messages, each with its kind.

"edit": code edits whose answer reprints a file with a small change (type hints, a rename, a
one-line fix), where prompt lookup should shine; "quote": answers that quote their input;
"free": free generation, the control where drafts are rare and must cost (almost) nothing.
Edits and quotes carry a `prediction`: the text their answer reprints, as a client of OpenAI's
Predicted Outputs would send it (the original file, the quoted lines).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "edit", "quote" or "free"
    message: str  # one user message, rendered with the model's chat template
    max_tokens: int = 384
    prediction: str | None = None  # what the answer reprints (OpenAI's Predicted Outputs)


MERGE = """def merge_counts(first, second, minimum):
    result = {}
    for key, value in first.items():
        if value >= minimum:
            result[key] = value
    for key, value in second.items():
        if key in result:
            result[key] += value
        elif value >= minimum:
            result[key] = value
    return result
"""

INVENTORY = """import json


def load(path):
    with open(path) as f:
        data = json.load(f)
    return data


def total_value(data):
    total = 0
    for item in data:
        total += item["price"] * item["quantity"]
    return total


def low_stock(data, limit):
    return [item["name"] for item in data if item["quantity"] < limit]


def report(path):
    data = load(path)
    print("items:", len(data))
    print("value:", total_value(data))
    print("low:", ", ".join(low_stock(data, 5)))
"""

STATS = """def mean(values):
    return sum(values) / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def average_gap(times):
    gaps = [b - a for a, b in zip(times, times[1:])]
    return sum(gaps) / len(times)


def summary(values):
    return {"mean": mean(values), "variance": variance(values)}
"""

LOG = """2026-11-20 10:00:01 INFO server started on port 8080
2026-11-20 10:00:02 INFO loaded 12 routes
2026-11-20 10:00:07 WARNING slow request GET /items took 812 ms
2026-11-20 10:00:09 ERROR database connection refused (host=db, port=5432)
2026-11-20 10:00:10 INFO retrying database connection
2026-11-20 10:00:12 INFO database connected
2026-11-20 10:01:40 ERROR KeyError: 'price' in total_value (inventory.py:12)
2026-11-20 10:01:41 INFO request POST /report returned 500
2026-11-20 10:02:03 INFO request GET /health returned 200
2026-11-20 10:02:30 ERROR timeout after 30 s waiting for worker 3
"""

PARAGRAPH = (
    "The cache keeps the keys and values of every token the model has already read, so that "
    "each new token only needs one pass through the network. Sliding-window layers keep only "
    "the most recent tokens in a ring buffer, and the positions stored beside each slot tell "
    "attention which keys are still visible."
)

WORKLOADS = (
    Workload(
        "type-hints",
        "edit",
        f"Add type hints to this function. Reply with the whole function.\n\n```python\n{MERGE}```",
        prediction=f"```python\n{MERGE}```",
    ),
    Workload(
        "rename",
        "edit",
        "Rename the variable `data` to `records` everywhere in this file. Reply with the whole "
        f"file.\n\n```python\n{INVENTORY}```",
        prediction=f"```python\n{INVENTORY}```",
    ),
    Workload(
        "fix-line",
        "edit",
        "In this file, `average_gap` divides by the wrong length: it should divide by "
        "`len(gaps)`. Fix that line and print the whole file again.\n\n"
        f"```python\n{STATS}```",
        prediction=f"```python\n{STATS}```",
    ),
    Workload(
        "quote-log",
        "quote",
        f"Here is a server log:\n\n```\n{LOG}```\n\nQuote every ERROR line exactly, then say "
        "what went wrong.",
        prediction="\n".join(line for line in LOG.splitlines() if " ERROR " in line),
    ),
    Workload(
        "quote-text",
        "quote",
        f"Repeat this paragraph word for word, then explain it in one sentence.\n\n{PARAGRAPH}",
        prediction=PARAGRAPH,
    ),
    Workload("story", "free", "Write a short story about a lighthouse keeper and a map.", 256),
    Workload("explain", "free", "Explain how a hash table works, with a small example.", 256),
)
KINDS = ("edit", "quote", "free")


def main(argv: list[str] | None = None) -> int:
    """`python -m expresslane.bench.spec_workloads NAME [--prediction]`: a workload's message (or
    its prediction) on stdout, for `run --chat "$(...)"` and `run --prediction FILE`."""
    import argparse

    by_name = {w.name: w for w in WORKLOADS}
    p = argparse.ArgumentParser(prog="python -m expresslane.bench.spec_workloads")
    p.add_argument("name", choices=list(by_name))
    p.add_argument("--prediction", action="store_true", help="its prediction, not its message")
    args = p.parse_args(argv)
    w = by_name[args.name]
    if args.prediction and w.prediction is None:
        p.error(f"{w.name}: a {w.kind} workload has no prediction")
    sys.stdout.write(w.prediction if args.prediction else w.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
