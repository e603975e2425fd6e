"""Decode speed under a cgroup CPU quota: the thread count chosen from it against a fixed one.

    python -m expresslane.bench.cpu_quota [MODEL] [--quota 1] [--tokens 256] [--repeats 3]

A container started with `docker run --cpus N` on a bigger host sees every core of the host
but may use N cores' worth of time. A thread count taken from the cores alone oversubscribes
the quota, and the kernel throttles the threads at every period while the others wait at the
product's barrier. step/threads.py `usable_cores` caps the count at the quota. This creates a
cgroup with a quota of `--quota` cores (cgroup v2 `cpu.max`, or v1 `cpu.cfs_quota_us`; it needs
root), and runs `expresslane run MODEL --json` in it `--repeats` times each way: the default
count, `--threads` at every usable core (as before the cap, and as a user who passes the host's
core count does) and `--threads` at the quota. Then the same without a quota. MODEL: a checkpoint
folder or GGUF file (default SmolLM2-135M-Instruct's Q4_1 GGUF, fetched once). Prints one
table, then one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

from ..errors import ExpressLaneError
from ..step.threads import CGROUP, usable_cores
from .serve_decode import _summary, measured, model_parser, run_decode

PERIOD_US = 100_000


@contextmanager
def quota_cgroup(cores: float):
    """A fresh cgroup allowing `cores` cores' worth of time; yields the function that moves a
    process into it (for `preexec_fn`), and removes the cgroup after."""
    v2 = os.path.exists(os.path.join(CGROUP, "cgroup.controllers"))
    base = CGROUP if v2 else os.path.join(CGROUP, "cpu")
    path = os.path.join(base, f"expresslane-quota-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as e:
        raise ExpressLaneError(f"cannot create a cgroup at {path} ({e.strerror}): run as root "
                               "on a Linux host with the cpu controller") from e  # fmt: skip
    try:
        quota = max(1000, int(cores * PERIOD_US))
        if v2:
            _write(os.path.join(path, "cpu.max"), f"{quota} {PERIOD_US}")
        else:
            _write(os.path.join(path, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota))
        yield lambda: _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))
    finally:
        remove_cgroup(path)


def remove_cgroup(path: str) -> None:
    os.rmdir(path)  # a cgroup's files are the kernel's: rmdir takes them with it


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise ExpressLaneError(f"cannot write {path}: {e.strerror}") from e


def measure(model: str, quota: float, tokens: int, repeats: int) -> dict:
    cores, capped = usable_cores(), max(1, int(quota))
    ways = {"default": (), f"--threads {cores}": ("--threads", str(cores)),
            f"--threads {capped}": ("--threads", str(capped))}  # fmt: skip
    out: dict = {}
    with quota_cgroup(quota) as enter:
        for name, flags in ways.items():
            out[name] = {"quota": _summary([run_decode(model, tokens, flags, enter)
                                            for _ in range(repeats)])}  # fmt: skip
    for name, flags in ways.items():
        out[name]["none"] = _summary([run_decode(model, tokens, flags) for _ in range(repeats)])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = model_parser("cpu_quota", __doc__)
    ap.add_argument("--quota", type=float, default=1.0, help="cores' worth of CPU time")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args(argv)
    bad = args.tokens < 2 or args.repeats < 1 or args.quota <= 0
    problem = "--tokens: at least 2; --repeats: at least 1; --quota: > 0" if bad else None
    res = measured("cpu_quota", args, problem,
                   lambda model: measure(model, args.quota, args.tokens, args.repeats))  # fmt: skip
    if res is None:
        return 2
    print(f"| threads | quota {args.quota:g} cores: tok/s, median (min) | threads | "
          "no quota: tok/s | threads |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, row in res.items():
        cells = [f"{row[k]['median']:.1f} ({row[k]['min']:.1f}) | "
                 + "/".join(map(str, row[k]["threads"])) for k in ("quota", "none")]  # fmt: skip
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(json.dumps({"model": str(args.model), "quota": args.quota, "tokens": args.tokens,
                      "cores": usable_cores(), **res}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
