"""The command line the CPU benches share (bench/cpu_prefill.py, bench/cpu_products.py): GGUF
files or checkpoint folders (by default SmolLM2 in some of llama.cpp's own types, written once by
gguf/variants.py), a list of token counts, repeats and threads, each count >= 1; and a missing
or malformed file as its message and exit code 2, not a traceback.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..errors import ExpressLaneError


def arguments(doc: str, counts: str, default, repeats: int, threads: int):
    """The parser: files, --<counts> (token counts), --repeats, --threads; more can be added."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("files", nargs="*", help="GGUF files or checkpoint folders")
    ap.add_argument(f"--{counts}", type=int, nargs="+", default=list(default))
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--threads", type=int, default=threads)
    return ap


def files(prog: str, args, counts: str, types) -> list[str] | None:
    """The files to measure (the named ones, else `types` from gguf/variants.py) with torch's
    threads set; None, after a message, where a count is below 1."""
    if min(getattr(args, counts)) < 1 or args.repeats < 1 or args.threads < 1:
        print(f"{prog}: --{counts}, --repeats and --threads must be >= 1", file=sys.stderr)
        return None
    torch.set_num_threads(args.threads)
    if args.files:
        return args.files
    from ..gguf.variants import ensure

    return [str(ensure(t)) for t in types]


def measure_all(prog: str, paths: list[str], measure) -> list[dict] | None:
    """measure(path)'s rows for every path, as the engine runs (inference mode); None, after the
    message, for a missing or malformed file."""
    rows = []
    try:
        with torch.inference_mode():
            for path in paths:
                rows += measure(path)
    except ExpressLaneError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
    return rows
