"""The HTTP client of tests/test_hosts.py, run inside a namespace "host"; one JSON line per event.

`python netns_client.py LEAD PROXY STATS REPLICA...` (base URLs; REPLICA as host:port):

1. wait until HAProxy's STATS page shows every replica UP;
2. 4 completions through PROXY: {"i", "status", "server"} each (X-Served-By);
3. one streamed completion straight from LEAD (a replica whose ranks span two hosts), of half
   its context (a refused one: {"refused": body}, and the client exits 4); after the fifth
   chunk {"chunks": 5} (the test then kills a rank of it), then every error event and
   {"end": chunks};
4. 6 more completions through PROXY;
5. {"metrics": {replica: finished requests in its /metrics, or null when it is down}}.
"""

from __future__ import annotations

import json
import sys
import time

import httpx

BODY = {"model": "expresslane", "prompt": "def fib(n):", "ignore_eos": True}


def say(**kw) -> None:
    print(json.dumps(kw), flush=True)


def up(stats: str, names: list[str]) -> bool:
    try:
        rows = [ln.split(",") for ln in httpx.get(stats, timeout=2).text.splitlines()]
    except httpx.HTTPError:
        return False
    status = {r[1]: r[17] for r in rows if len(r) > 17}  # svname -> status
    return all(status.get(n) == "UP" for n in names)


def through(proxy: str, first: int, n: int) -> None:
    for i in range(first, first + n):
        r = httpx.post(proxy + "/v1/completions", json={**BODY, "max_tokens": 4}, timeout=120)
        say(i=i, status=r.status_code, server=r.headers.get("x-served-by"))


def stream(lead: str, n: int) -> None:
    chunks = 0
    with httpx.stream(
        "POST", lead + "/v1/completions", json={**BODY, "max_tokens": n, "stream": True},
        timeout=120,
    ) as r:  # fmt: skip
        say(status=r.status_code)
        if r.status_code != 200:  # nothing to kill mid-way: the test stops here
            say(refused=r.read().decode(errors="replace")[:500])
            sys.exit(4)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                say(error=data["error"])
                continue
            chunks += 1
            if chunks == 5:
                say(chunks=chunks)
    say(end=chunks)


def finished(replica: str) -> float | None:
    try:
        text = httpx.get(f"http://{replica}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    prefix = "expresslane:request_success_total{"
    return sum(float(ln.rpartition(" ")[2]) for ln in text.splitlines() if ln.startswith(prefix))


def main(lead: str, proxy: str, stats: str, replicas: list[str]) -> None:
    names = [f"r{i + 1}" for i in range(len(replicas))]
    t0 = time.monotonic()
    while not up(stats, names):
        if time.monotonic() - t0 > 240:
            say(gave_up="replicas UP in haproxy")
            sys.exit(3)
        time.sleep(0.2)
    through(proxy, 0, 4)
    context = httpx.get(lead + "/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    stream(lead, context // 2)  # long enough to be killed mid-way; beyond the context: a 400
    through(proxy, 4, 6)
    say(metrics={rep: finished(rep) for rep in replicas})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
