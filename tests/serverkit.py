"""The served tiny model shared by the server test files, and their small helpers.

One tiny random Laneformer behind a real uvicorn on 127.0.0.1, driven by the `openai` client;
references come from a second Engine over the same weights (its own cache), run only while the
server is idle.
"""

from __future__ import annotations

import time
from functools import partial
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from expresslane.cli.serve import serving
from expresslane.config import SamplingParams
from expresslane.engine import Engine
from expresslane.serve import create_app
from expresslane.serve.metrics import parse_metrics
from expresslane.textgen import generate_text
from expresslane.tokenizer import Tokenizer

CTX = 256
NAME = "tiny"


@pytest.fixture(scope="module")
def server(random_laneformer_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one intra-op thread is fastest for a tiny model
    engine = Engine.from_pretrained(
        str(random_laneformer_dir), device="cpu", dtype="float32", max_model_len=CTX, progress=False
    )
    tok = Tokenizer.from_dir(random_laneformer_dir)
    app = create_app(engine, tok, served_model_name=NAME)
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="dummy", max_retries=0, timeout=60)
        cmpl = partial(client.completions.create, model=NAME)
        chat = partial(client.chat.completions.create, model=NAME)
        ref = Engine(engine.model, max_model_len=CTX)  # its own cache: used while server idles
        yield SimpleNamespace(url=url, app=app, engine=engine, tok=tok, ref=ref, client=client,
                              cmpl=cmpl, chat=chat)  # fmt: skip
    torch.set_num_threads(threads)


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
