"""Small helpers of the server test files (their `server` fixture is in conftest.py here).

One tiny random Laneformer behind a real uvicorn on 127.0.0.1, driven by the `openai` client;
references come from a second Engine over the same weights (its own cache), run only while the
server is idle.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import torch

from expresslane.sampling.params import SamplingParams
from expresslane.serve.metrics import parse_metrics
from expresslane.textgen import generate_text

CTX = 256
NAME = "tiny"


def greedy(s, ids: list[int], n: int, **kw) -> str:
    params = SamplingParams(max_tokens=n, **kw)
    return "".join(text for text, _ in generate_text(s.ref, s.tok, ids, params))


def metrics(s) -> dict[str, float]:
    return parse_metrics(httpx.get(s.url + "/metrics").text)


def post(s, path: str, body: dict, **kw) -> dict:
    return httpx.post(s.url + path, json=body, timeout=kw.pop("timeout", 60), **kw).json()


def metric(m: dict, name: str, **labels) -> float:
    labels = sorted({**labels, "model_name": NAME}.items())  # the exposition sorts labels
    lab = ",".join(f'{k}="{v}"' for k, v in labels)
    return m.get(f"expresslane:{name}{{{lab}}}", 0.0)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def wait_idle(s, timeout: float = 5.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = metrics(s)
        if metric(m, "num_requests_running") == 0 and metric(m, "num_requests_waiting") == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError("the engine did not become idle")


@contextmanager
def embedded_server(api_key: str | None = None, tokenizer=None) -> Iterator[str]:
    """The embedded model (a context of 1024, for tool prompts) behind a real uvicorn, one
    intra-op thread; its base URL. Models bigger than the tiny random one for structured output
    and tool calls (test_server_structured.py, _responses.py, _messages.py). `tokenizer`: a
    folder of another tokenizer of the same vocabulary (marker_kit.py's)."""
    from expresslane.assets import default_model_dir
    from expresslane.cli.serve import serving
    from expresslane.engine import Engine
    from expresslane.serve import create_app
    from expresslane.tokenizer import Tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = default_model_dir()
    engine = Engine.from_pretrained(str(path), device="cpu", dtype="float32", progress=False)
    tok = Tokenizer.from_dir(tokenizer or path)
    app = create_app(engine, tok, served_model_name=NAME, api_key=api_key)
    try:
        with serving(app) as url:
            yield url
    finally:
        torch.set_num_threads(threads)
