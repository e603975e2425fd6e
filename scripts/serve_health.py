"""/health latency while the server is busy: refusing 12 MB bodies, preparing, generating.

A server that tokenizes on its event loop stops answering everything while it does (a 12 MB
prompt froze /health for 31 s). This serves MODEL in-process on a free port, polls /health
from one client while another keeps the server busy, and reports the latencies per phase:

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
import statistics
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

    import torch

    from expresslane.checkpoint import resolve_model_dir
    from expresslane.cli.serve import serving
    from expresslane.engine import Engine
    from expresslane.serve import create_app
    from expresslane.serve.guards import ServeLimits
    from expresslane.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(resolve_model_dir(args.model))  # org/name: from the Hugging Face cache
    engine = Engine.from_pretrained(path, progress=False)
    tok = Tokenizer.from_dir(path)
    big = b'{"prompt": "' + b"x" * BIG + b'", "max_tokens": 4}'
    words = ("def add(a, b):\n    return a + b\n" * args.prompt_chars)[: args.prompt_chars]
    fits = {"prompt": words, "max_tokens": args.max_tokens, "ignore_eos": True}
    json_ct = {"Content-Type": "application/json"}
    large = {"prompt": ("def add(a, b): return a + b " * (4 << 20))[: (4 << 20) - 64]}  # no escapes
    phases = [
        ("idle", ServeLimits(), lambda c: time.sleep(0.05)),
        ("413 (12 MB body)", ServeLimits(), lambda c: c.post("/v1/completions", content=big,
                                                                headers=json_ct)),
        ("too long (12 MB prompt)", ServeLimits(max_request_bytes=64 << 20),
         lambda c: c.post("/v1/completions", content=big, headers=json_ct)),
        ("prepare + generate", ServeLimits(), lambda c: c.post("/v1/completions", json=fits)),
        ("4 MB /tokenize", ServeLimits(), lambda c: c.post("/tokenize", json=large)
         .raise_for_status()),
    ]  # fmt: skip
    rows = []
    for name, limits, load in phases:
        app = create_app(engine, tok, served_model_name="bench", limits=limits)
        with serving(app) as url:
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
    print(json.dumps({"model": args.model, "device": str(engine.device), "phases": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
