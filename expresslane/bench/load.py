"""From a GGUF file (or a checkpoint folder) to its first token, in a fresh process: seconds and
peak memory, against llama.cpp.

    python -m expresslane.bench.load FILE... [--repeats 3] [--threads 2] [--no-peer]
                                     [--checkout DIR]

What a user of `llama-cli -m FILE` meets before any answer: the interpreter and the library
starting, the file read and packed, a short prompt and one token. Each round is a new process:
`expresslane run FILE --prompt ... --max-tokens 1`, and llama-cpp-python's `Llama(FILE)` with one
completion token (its defaults: the file mapped, a 512-token context). Timed from spawn to exit;
the peak is the process's largest resident set (`os.wait4`), the file's pages it touched
included. The OS's page cache is warm after a first, untimed round of each. `--checkout DIR`
runs another checkout's `expresslane` (its PYTHONPATH) in place of this one: before and after a
change, on the same files. Prints one table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "The capital of France is"
PEER = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), verbose=False)
llm.create_completion(sys.argv[3], max_tokens=1, temperature=0.0)
"""


def spawn(cmd: list[str], checkout: str | None = None) -> tuple[float, float]:
    """(seconds from spawn to exit, peak resident MB) of one process, run in `checkout` (its
    package first on the path) if given; an error if it fails."""
    env = None if checkout is None else {**os.environ, "PYTHONPATH": checkout}
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=checkout)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-1500:]
            raise RuntimeError(f"`{' '.join(cmd[:6])} ...` exited {proc.returncode}: {tail}")
    return seconds, usage.ru_maxrss / 1024  # KB on Linux


def commands(path: str, threads: int) -> dict[str, list[str]]:
    ours = [sys.executable, "-m", "expresslane", "run", path, "--prompt", PROMPT,
            "--max-tokens", "1", "--temperature", "0", "--threads", str(threads)]  # fmt: skip
    return {"ours": ours, "llama.cpp": [sys.executable, "-c", PEER, path, str(threads), PROMPT]}


def measure(path: str, threads: int, repeats: int, peer: bool, checkout: str | None) -> dict:
    files = [Path(path)] if os.path.isfile(path) else list(Path(path).glob("*.safetensors"))
    row: dict = {"file": Path(path).name,
                 "mb": round(sum(f.stat().st_size for f in files) / 2**20, 1)}  # fmt: skip
    path = str(Path(path).resolve())  # a checkout runs in its own folder
    for name, cmd in commands(path, threads).items():
        if name != "ours" and not peer:
            continue
        where = checkout if name == "ours" else None
        try:
            spawn(cmd, where)  # the page cache warm, as for every timed round
            runs = [spawn(cmd, where) for _ in range(repeats)]
        except RuntimeError as e:
            row[name] = {"error": str(e)}
            continue
        row[name] = {"seconds": statistics.median(s for s, _ in runs),
                     "seconds_min": min(s for s, _ in runs),
                     "peak_mb": max(m for _, m in runs)}  # fmt: skip
    return row


def _cell(r: dict) -> str:
    if r is None:
        return "- | -"
    if "error" in r:
        return f"error: {r['error'][:60]} | -"
    return f"{r['seconds']:.2f} ({r['seconds_min']:.2f}) | {r['peak_mb']:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.load",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("files", nargs="+", help="GGUF files (or checkpoint folders, with --no-peer)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true", help="ours alone")
    ap.add_argument("--checkout", default=None, help="another checkout's expresslane")
    args = ap.parse_args(argv)
    missing = [f for f in args.files if not os.path.exists(f)]
    problem = (f"{missing[0]}: no such file" if missing else "--repeats and --threads: at least 1"
               if min(args.repeats, args.threads) < 1 else None)  # fmt: skip
    if args.checkout and not (Path(args.checkout) / "expresslane" / "__init__.py").is_file():
        problem = f"--checkout {args.checkout}: no expresslane package there"
    args.checkout = args.checkout and str(Path(args.checkout).resolve())
    if problem:
        print(f"load: {problem}", file=sys.stderr)
        return 2
    peer = not args.no_peer
    rows = [measure(f, args.threads, args.repeats, peer, args.checkout) for f in args.files]
    print("| file | MB | ours: s, median (min) | peak MB | llama.cpp: s | peak MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['file']} | {r['mb']} | {_cell(r['ours'])} | {_cell(r.get('llama.cpp'))} |")
    print(json.dumps({"threads": args.threads, "repeats": args.repeats,
                      "checkout": args.checkout, "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
