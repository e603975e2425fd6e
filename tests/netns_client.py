"""An HTTP client inside a namespace "host", for tests/test_hosts.py; one JSON line per event.

- `stream URL N`: wait until URL/health says 200, stream one completion of N tokens; print
  {"chunks": 5} after the fifth chunk (the test then kills a rank), every error event, and
  {"end": chunks} at the end.
- `loop URL N STATS REPLICA...`: wait until HAProxy's STATS page shows every replica UP, then N
  sequential completions through URL, printing {"i", "status", "server"} for each; finally
  each replica's finished-request counter from its /metrics (null when it is down).
"""

from __future__ import annotations

import json
import sys
import time

import httpx

BODY = {"model": "expresslane", "prompt": "def fib(n):", "ignore_eos": True}


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def wait_for(check, what: str, timeout: float = 180.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    say(gave_up=what)
    sys.exit(3)


def stream(url: str, n: int) -> None:
    wait_for(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, "health")
    chunks, t_kill = 0, None
    body = {**BODY, "max_tokens": n, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        say(status=r.status_code)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                since = None if t_kill is None else time.monotonic() - t_kill
                say(error=data["error"], since_kill_s=since)
                continue
            chunks += 1
            if chunks == 5:
                t_kill = time.monotonic()
                say(chunks=chunks)
    say(end=chunks)


def up(stats: str, names: list[str]) -> bool:
    rows = [ln.split(",") for ln in httpx.get(stats, timeout=2).text.splitlines()]
    status = {r[1]: r[17] for r in rows if len(r) > 17}  # svname -> status
    return all(status.get(n) == "UP" for n in names)


def finished(replica: str) -> float | None:
    try:
        text = httpx.get(f"http://{replica}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    return sum(
        float(ln.rpartition(" ")[2])
        for ln in text.splitlines()
        if ln.startswith("expresslane:request_success_total{")
    )


def loop(url: str, n: int, stats: str, replicas: list[str]) -> None:
    names = [f"r{i + 1}" for i in range(len(replicas))]
    wait_for(lambda: up(stats, names), "replicas UP in haproxy")
    for i in range(n):
        r = httpx.post(url + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=60)
        say(i=i, status=r.status_code, server=r.headers.get("x-served-by"))
    say(metrics={rep: finished(rep) for rep in replicas})


if __name__ == "__main__":
    mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "stream":
        stream(url, n)
    else:
        loop(url, n, sys.argv[4], sys.argv[5:])
