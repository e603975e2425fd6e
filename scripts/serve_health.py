"""/health latency while the server is busy: refusing 12 MB bodies, preparing, generating.

A server that tokenizes on its event loop stops answering everything while it does (a 12 MB
prompt froze /health for 31 s). This starts `expresslane serve MODEL` in a process of its own
(as a user runs it: the clients here never share its GIL), on a free port, once per phase,
polls /health from one client while another keeps the server busy, and reports the latencies
per phase:

- idle: nothing else happening;
- 413: 12 MB completions bodies, beyond --max-request-bytes;
- too long: the same bodies under a raised limit, refused by the prompt-length bound;
- prepare + generate: long prompts that fit, tokenized and then generated, one after another;
- 4 MB /tokenize: a text of 4 MB tokenized, its reply (some 700k ids) serialised and sent.

One table, then one JSON line last.

    PYTHONPATH=. python scripts/serve_health.py HuggingFaceTB/SmolLM2-135M-Instruct \
        --seconds 5 --threads 1

A script, not a module of expresslane/bench/: it drives the server, which sits above bench/ in
the layers of docs/architecture.md.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

BIG = 12 * 10**6


def _poll(url: str, stop: threading.Event) -> list[float]:
    out = []
    with httpx.Client(timeout=120) as c:
        while not stop.is_set():
            t = time.perf_counter()
            assert c.get(url + "/health").status_code == 200
            out.append(time.perf_counter() - t)
            time.sleep(0.005)
    return out


class _server:
    """`expresslane serve PATH FLAGS` on a free port, until it answers /health; stopped after."""

    def __init__(self, path: str, flags: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "expresslane", "serve", path, "--port", str(self.port),
               "--log-level", "warning", *flags]  # fmt: skip
        # its banner and logs stay out of the table
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> str:
        url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode})")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the server did not answer /health in 60 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _phase(url: str, seconds: float, load) -> tuple[list[float], int]:
    """Health latencies while `load(client)` runs again and again for `seconds`."""
    stop, lat, runs = threading.Event(), [], [0]

    def busy():
        with httpx.Client(base_url=url, timeout=600) as c:
            t_end = time.monotonic() + seconds
            while time.monotonic() < t_end:
                load(c)
                runs[0] += 1
        stop.set()

    worker = threading.Thread(target=busy)
    poller = threading.Thread(target=lambda: lat.extend(_poll(url, stop)))
    worker.start(), poller.start()
    worker.join(), poller.join()
    return lat, runs[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "model", help="checkpoint folder, .gguf file, or org/name (HF cache, else downloaded)"
    )
    p.add_argument("--seconds", type=float, default=5.0, help="per phase")
    p.add_argument("--prompt-chars", type=int, default=6000, help="the fitting prompts' length")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)

    from expresslane.checkpoint import resolve_model_dir

    path = str(resolve_model_dir(args.model))  # org/name: from the Hugging Face cache
    big = b'{"prompt": "' + b"x" * BIG + b'", "max_tokens": 4}'
    words = ("def add(a, b):\n    return a + b\n" * args.prompt_chars)[: args.prompt_chars]
    fits = {"prompt": words, "max_tokens": args.max_tokens, "ignore_eos": True}
    json_ct = {"Content-Type": "application/json"}
    large = {"prompt": ("def add(a, b): return a + b " * (4 << 20))[: (4 << 20) - 64]}  # no escapes
    raised = ["--max-request-bytes", str(64 << 20)]
    phases = [
        ("idle", [], lambda c: time.sleep(0.05)),
        ("413 (12 MB body)", [], lambda c: c.post("/v1/completions", content=big,
                                                    headers=json_ct)),
        ("too long (12 MB prompt)", raised,
         lambda c: c.post("/v1/completions", content=big, headers=json_ct)),
        ("prepare + generate", [], lambda c: c.post("/v1/completions", json=fits)),
        ("4 MB /tokenize", [], lambda c: c.post("/tokenize", json=large).raise_for_status()),
    ]  # fmt: skip
    threads = ["--threads", str(args.threads)] if args.threads else []
    rows = []
    for name, flags, load in phases:
        with _server(path, threads + flags) as url:
            lat, runs = _phase(url, args.seconds, load)
        ms = sorted(x * 1e3 for x in lat)
        rows.append({"phase": name, "requests": runs, "polls": len(ms),
                     "p50_ms": round(statistics.median(ms), 2),
                     "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2),
                     "max_ms": round(ms[-1], 2)})  # fmt: skip
    print(f"{'phase':<26}{'requests':>9}{'polls':>7}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for r in rows:
        print(f"{r['phase']:<26}{r['requests']:>9}{r['polls']:>7}{r['p50_ms']:>9}"
              f"{r['p99_ms']:>9}{r['max_ms']:>9}")  # fmt: skip
    print(json.dumps({"model": args.model, "phases": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
