"""Which sampling settings show the embedded model at its best: how `make run`'s were chosen.

For each setting, every request below is answered with seeds 0..4 through the chat template (the
format the model was chat-tuned on), and three things are counted per answer: it parses as
Python (`ast.parse` after dedent), it ended with the end-of-turn token, it repeats a line (the
same non-blank line twice: greedy decoding's failure), and it fell into a run of 12 or more
spaces (sampling's). One table, then one JSON line.

    PYTHONPATH=. python scripts/sampling_survey.py [--seeds 5] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import textwrap

import torch

from expresslane.assets import default_model_dir
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.tokenizer import Tokenizer

REQUESTS = [
    "Write a Python function `def add(a, b)` that does this: Return the sum of a and b.",
    "Write a Python function `def is_even(n)` that does this: Return True if n is even.",
    "Write a Python function `def close(self)` that does this: Close the connection.",
    "Write a Python function `def __repr__(self)` that does this: Return repr(self).",
    "Write a Python function `def read_lines(path)` that does this: Return the lines of the "
    "file at path.",
    "Write a function that returns the sum of a list.",
]
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "t0.6 top-k 10": dict(temperature=0.6, top_k=10),
    "t0.8 top-p 0.8": dict(temperature=0.8, top_p=0.8),
    "t0.7 min-p 0.1": dict(temperature=0.7, min_p=0.1),
    "t0.8 min-p 0.2": dict(temperature=0.8, min_p=0.2),
    "t1.0 min-p 0.2": dict(temperature=1.0, min_p=0.2),
    "t1.0 min-p 0.3": dict(temperature=1.0, min_p=0.3),
}


def parses(text: str) -> bool:
    try:
        ast.parse(textwrap.dedent(text.strip("\n")))
        return True
    except (SyntaxError, ValueError):
        return False


def repeats_a_line(text: str) -> bool:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return len(set(lines)) < len(lines)


def survey(engine: Engine, tok: Tokenizer, seeds: int, max_tokens: int) -> list[dict]:
    eos = set(engine.cfg.eos_token_ids)
    rows = []
    for name, knobs in SETTINGS.items():
        counts = {"answers": 0, "parse": 0, "end_of_turn": 0, "repeats": 0, "space_runs": 0}
        for request in REQUESTS:
            ids = tok.encode(
                tok.apply_chat_template([{"role": "user", "content": request}]),
                add_special_tokens=False,
            )
            for seed in range(1 if knobs["temperature"] == 0 else seeds):
                params = SamplingParams(max_tokens=max_tokens, seed=seed, **knobs)
                out = list(engine.generate(ids, params))
                text = tok.decode([t for t in out if t not in eos], skip_special_tokens=True)
                counts["answers"] += 1
                counts["parse"] += parses(text)
                counts["end_of_turn"] += out[-1] in eos
                counts["repeats"] += repeats_a_line(text)
                counts["space_runs"] += bool(re.search(r" {12,}", text))
        rows.append({"setting": name, **counts})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = str(default_model_dir())
    engine = Engine.from_pretrained(path, device="cpu", progress=False)
    rows = survey(engine, Tokenizer.from_dir(path), args.seeds, args.max_tokens)
    head = ("setting", "answers", "parse", "end of turn", "repeats", "space runs")
    print(f"{head[0]:<16}" + "".join(f"{h:>12}" for h in head[1:]))
    for r in rows:
        vals = (r["answers"], r["parse"], r["end_of_turn"], r["repeats"], r["space_runs"])
        print(f"{r['setting']:<16}" + "".join(f"{v:>12}" for v in vals))
    print(json.dumps({"seeds": args.seeds, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
