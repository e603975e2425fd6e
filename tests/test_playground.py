"""The playground page in headless Chromium (Playwright): stream, live tokens/s, Stop.

The engine speculates (prompt lookup), so the live drafts-kept figure shows beside tokens/s.

Types a chat message, waits for streamed text, the live tokens/s figure and the server's own
figures, saves a screenshot to docs/playground.png, runs the raw prompt box ("Complete"), then
starts a long generation and presses Stop: the server must drop the request (running gauge back
to 0, an `abort` finish counted). With `--reasoning-parser`, a thinking model's reasoning shows
in its own block above the answer. Skipped when Playwright or a system Chromium (/usr/bin/chromium;
browsers are never downloaded) is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from expresslane.cli.serve import serving
from expresslane.engine import Engine
from expresslane.serve import create_app, worker
from expresslane.serve.metrics import parse_metrics
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.tokenizer import Tokenizer

CHROMIUM = os.environ.get("EXPRESSLANE_CHROMIUM", "/usr/bin/chromium")
# The screenshot under docs/ is refreshed only on request, so test runs leave the tree clean.
SCREENSHOT = (
    Path(__file__).resolve().parents[1] / "docs" / "playground.png"
    if os.environ.get("EXPRESSLANE_UPDATE_DOCS") == "1"
    else Path(tempfile.gettempdir()) / "expresslane-playground.png"
)
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="playwright is not installed (pip install playwright)",
    ),
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) or shutil.which("chromium")),
        reason=f"no system Chromium at {CHROMIUM} (apt-get install chromium)",
    ),
]
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--no-first-run",
    "--disable-extensions",
    "--disable-breakpad",
    "--disable-domain-reliability",
    "--metrics-recording-only",
]


def gauge(url: str, name: str, **labels) -> float:
    labels = sorted({**labels, "model_name": "tiny"}.items())
    key = f"expresslane:{name}{{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
    return parse_metrics(httpx.get(url + "/metrics").text).get(key, 0.0)


def slowed(stream_text, delay: float = 0.01):
    """`stream_text` with a pause per token, so Stop lands mid-generation on any machine."""

    def slow(*args, **kwargs):
        for item in stream_text(*args, **kwargs):
            time.sleep(delay)
            yield item

    return slow


def test_playground_streams_shows_speed_and_stops(random_laneformer_dir, monkeypatch):
    from playwright.sync_api import expect, sync_playwright

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(
        str(random_laneformer_dir), device="cpu", dtype="float32", max_model_len=512,
        progress=False, speculative=SpeculativeConfig(4, 3, 1),
    )  # fmt: skip
    app = create_app(engine, Tokenizer.from_dir(random_laneformer_dir), served_model_name="tiny")
    exe = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    try:
        with serving(app) as url, sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url + "/")
            expect(page.locator("#model-name")).to_contain_text("tiny")
            page.fill("#max_tokens", "48")
            page.fill("#prompt", "Write a Python function that adds two numbers.")
            page.click("#send")
            reply = page.locator("#messages .message.assistant").last
            expect(reply).not_to_be_empty()
            expect(page.locator("#live-tps")).to_have_text(re.compile(r"^\d+(\.\d+)?$"))
            expect(page.locator("#srv-tps")).to_contain_text("tok/s", timeout=30_000)
            expect(page.locator("#live-spec")).to_contain_text("drafts kept")  # speculation
            expect(page.locator("#status")).to_have_text("done")
            # A code block as the model would write it: rendered as code, with a copy button.
            page.evaluate("""() => {
                const div = document.createElement('div');
                div.className = 'message assistant';
                div.innerHTML = renderText('Here it is:\\n```python\\n'
                    + 'def add(a, b):\\n    return a + b  # sum\\n```\\n');
                document.getElementById('messages').append(div);
            }""")
            expect(page.locator(".code .copy").last).to_be_visible()
            expect(page.locator(".code .kw").first).to_have_text("def")
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT))

            page.click("button[data-mode=complete]")  # the raw prompt box
            page.fill("#max_tokens", "8")
            page.fill("#prompt", "def fib(n):")
            page.click("#send")
            expect(page.locator("#status")).to_have_text("done")
            expect(page.locator("#output")).to_contain_text("def fib(n):")
            assert len(page.inner_text("#output")) > len("def fib(n):")
            page.click("button[data-mode=chat]")

            # The long generation must still be running when Stop is pressed: a random model
            # may sample its end-of-text token at temperature 1, and 200 tokens of a tiny model
            # take well under a second, so the request ignores EOS and each token is paced.
            monkeypatch.setattr(worker, "stream_text", slowed(worker.stream_text))
            page.route(
                "**/v1/chat/completions",
                lambda route: route.continue_(
                    post_data=json.dumps({**route.request.post_data_json, "ignore_eos": True})
                ),
            )
            aborted = gauge(url, "request_success_total", finished_reason="abort")
            page.fill("#max_tokens", "200")
            page.fill("#temperature", "1")
            page.fill("#prompt", "Tell me a long story.")
            page.click("#send")
            expect(page.locator("#messages .message.assistant").last).not_to_be_empty()
            page.click("#stop")
            expect(page.locator("#status")).to_have_text("stopped")
            deadline = time.monotonic() + 5
            while gauge(url, "num_requests_running") != 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gauge(url, "num_requests_running") == 0
            assert gauge(url, "request_success_total", finished_reason="abort") == aborted + 1
            browser.close()
    finally:
        torch.set_num_threads(threads)


def test_playground_shows_a_thinking_models_reasoning_apart(random_laneformer_dir):
    """With `--reasoning-parser`, the reasoning streams into a dimmed block above the answer.
    The tiny model cannot think: a regex (added to the page's request) makes it write the tags,
    and the page must show what the chat route answers for the same request."""
    from playwright.sync_api import expect, sync_playwright

    from expresslane.serve.guards import ServeLimits

    engine = Engine.from_pretrained(str(random_laneformer_dir), device="cpu", dtype="float32",
                                    max_model_len=512, progress=False)  # fmt: skip
    app = create_app(engine, Tokenizer.from_dir(random_laneformer_dir), served_model_name="tiny",
                     limits=ServeLimits(reasoning_parser="deepseek_r1"))  # fmt: skip
    # thinking off: the regex alone is the grammar (it writes the tags itself)
    forced = {"structured_outputs": {"regex": r"<think>[a-z ]{6,14}</think>\n\n[a-z]{2,8}"},
              "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    exe = CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium")
    with serving(app) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=ARGS, headless=True)
        page = browser.new_page()
        sent = []

        def force(route):
            sent.append({**route.request.post_data_json, **forced})
            route.continue_(post_data=json.dumps(sent[-1]))

        page.route("**/v1/chat/completions", force)
        page.goto(url + "/")
        expect(page.locator("#model-name")).to_contain_text("tiny")
        page.fill("#max_tokens", "60")
        page.fill("#prompt", "Why?")
        page.click("#send")
        expect(page.locator("#status")).to_have_text("done")
        bubble = page.locator("#messages .message.assistant").last
        again = {k: v for k, v in sent[-1].items() if k not in ("stream", "stream_options")}
        r = httpx.post(url + "/v1/chat/completions", json=again, timeout=60)
        want = r.json()["choices"][0]["message"]
        assert want["reasoning_content"] and want["content"]
        expect(bubble.locator(".thinking")).to_have_text(want["reasoning_content"])
        assert bubble.inner_text().rstrip().endswith(want["content"])
        browser.close()
