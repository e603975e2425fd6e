"""What huge pages give one weight stream: the same bytes read on 4 KB pages and on 2 MB ones.

    python -m expresslane.bench.hugepages [--mb 1024] [--threads 1] [--repeats 5]

A buffer of `--mb` MB (far past the caches) is allocated twice: by torch (4 KB pages where the
kernel's THP setting is "madvise", the common default) and in weights/hugepages.py's arena (2 MB
pages where the kernel grants them). Each is read by two readers, best of `--repeats` after one
untimed pass: torch's sum over it as fp32, and the C decode step's fp32 product of it as a
(rows, 1024) matrix with one token (csrc/cpu_matmul.c: the rows a decode step streams, with
their prefetch). GB/s is the buffer's bytes over the time. Prints one table, then one JSON line.
The decode step's own figures with and without huge pages are `expresslane bench`'s
(`EXPRESSLANE_HUGE_PAGES=0` for without; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..step.native import available, native_matmul
from ..weights import hugepages
from ..weights.quant import QTensor

K = 1024  # the product's row length: 4 KB of fp32, a few rows per 4 KB page's worth of stream


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def readers(buf: torch.Tensor) -> dict:
    """The ways of reading `buf` (fp32, a multiple of K values) timed here."""
    w = buf.view(-1, K)
    x = torch.ones(1, K)  # the product is then the rows' sums: checkable
    out = {"torch sum": lambda: buf.sum()}
    if available("float32"):
        out["C fp32 product"] = lambda: native_matmul(QTensor("float32", w), x)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.hugepages")
    ap.add_argument("--mb", type=int, default=1024, help="the buffer's size (MB)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.mb < 4 or args.threads < 1 or args.repeats < 1:
        print("hugepages: --mb at least 4; --threads, --repeats at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    nbytes = args.mb * 2**20
    room = hugepages.arena(nbytes)
    if room is None:
        why = f"THP setting {hugepages.thp_mode()!r}" if hugepages.thp_mode() else "no THP"
        print(f"hugepages: no huge-page arena here ({why}, or turned off)", file=sys.stderr)
        return 2
    pages = {"4 KB (torch)": torch.ones(nbytes // 4), "2 MB (arena)": room.view(torch.float32)}
    pages["2 MB (arena)"].fill_(1.0)
    rows = []
    for page, buf in pages.items():
        for reader, fn in readers(buf).items():
            rows.append({"pages": page, "reader": reader,
                         "gb_s": nbytes / _best(fn, args.repeats) / 1e9})  # fmt: skip
    print("| pages | reader | GB/s |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['pages']} | {r['reader']} | {r['gb_s']:.1f} |")
    print(json.dumps({"bench": "hugepages", "mb": args.mb, "threads": args.threads,
                      "thp": hugepages.thp_mode(), "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
