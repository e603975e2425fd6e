"""The `expresslane` command: one subcommand per module in expresslane/cli/.

Each module there defines `HELP`, `add_arguments(parser)` and `main(args) -> int`. User errors
(ExpressLaneError) print one line on stderr and exit 2 (or their `exit_code`: 1 for a process
group that lost a rank); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import ExpressLaneError

COMMANDS = {
    "run": "expresslane.cli.run",
    "serve": "expresslane.cli.serve",
    "bench": "expresslane.cli.bench",
    "ceiling": "expresslane.cli.ceiling",
    "train": "expresslane.cli.train",
    "eval": "expresslane.cli.eval",
    "fetch": "expresslane.cli.fetch",
}


def _available() -> dict:
    mods = {}
    for name, path in COMMANDS.items():
        try:
            mods[name] = importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name != path:  # a real missing dependency, not an unbuilt command
                raise
    return mods


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse already exits 2; keep its one-line style
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="expresslane", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, mod in _available().items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._main(args) or 0
    except ExpressLaneError as e:
        print(f"expresslane {args.command}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
