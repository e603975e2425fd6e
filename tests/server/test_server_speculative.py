"""A speculating server: same text as plain decoding, acceptance figures in every response's
timings, live in streamed chunks, and on /metrics (vLLM's spec_decode counter names)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from expresslane.cli.serve import serving
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.serve import create_app
from expresslane.serve.metrics import parse_metrics
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.textgen import generate_text
from expresslane.tokenizer import Tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def spec_server(random_laneformer_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(
        str(random_laneformer_dir), device="cpu", dtype="float32", max_model_len=256,
        progress=False, speculative=SpeculativeConfig(4, 3, 1),
    )  # fmt: skip
    tok = Tokenizer.from_dir(random_laneformer_dir)
    with serving(create_app(engine, tok, served_model_name="tiny")) as url:
        yield url, engine, tok
    torch.set_num_threads(threads)


def spec_metrics(url: str) -> dict[str, float]:
    m = parse_metrics(httpx.get(url + "/metrics").text)
    return {k.split("{")[0]: v for k, v in m.items() if ":spec_decode_" in k}


def test_completion_equals_plain_decoding_and_reports_acceptance(spec_server):
    url, engine, tok = spec_server
    before = spec_metrics(url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    plain = Engine(engine.model, max_model_len=256)
    ids = tok.encode(PROMPT)
    want = "".join(t for t, _ in generate_text(plain, tok, ids, SamplingParams(max_tokens=48)))
    assert r["choices"][0]["text"] == want
    fig = r["timings"]["speculative"]
    assert fig["verify_steps"] > 0 and fig["draft_tokens"] >= fig["accepted_tokens"] > 0
    after = spec_metrics(url)
    name = "expresslane:spec_decode_num_{}_total"
    assert (
        after[name.format("drafts")] - before.get(name.format("drafts"), 0) == fig["verify_steps"]
    )
    for field, key in (("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted_tokens")):
        assert after[name.format(key)] - before.get(name.format(key), 0) == fig[field]


def test_streamed_chunks_carry_live_figures(spec_server):
    url, _, _ = spec_server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
    seen = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "speculative" in chunk:
                    seen.append(chunk["speculative"]["accepted_tokens"])
    assert seen and seen == sorted(seen) and seen[-1] > 0  # growing as the answer streams
