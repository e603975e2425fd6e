"""The server under hostile and heavy use, against a real uvicorn (serverkit.py): issue 16.

Covered: /health answering while a request is tokenized or templated (the work is off the event
loop), 12 MB bodies refused (413 while reading; a prompt proven too long before tokenizing)
with /health answering meanwhile and memory not growing, tiny temperature / top_p equal to
greedy, Allow on 405, 415 for bodies not sent as JSON, 400 naming unimplemented fields,
--max-queue (503 + Retry-After) and --max-n, WWW-Authenticate on 401, no server paths or Python
names in errors, text_offset indexing the echoed text, CORS, and the OpenAPI schema validating
real requests and responses (schemathesis, a few examples per route).
"""

from __future__ import annotations

import contextlib
import threading
import time
from argparse import Namespace
from types import SimpleNamespace

import httpx
import pytest
from serverkit import CTX, NAME, greedy, metric, metrics, wait_idle

from expresslane.cli.serve import _names, serving
from expresslane.engine import Engine
from expresslane.serve import create_app
from expresslane.serve.guards import ServeLimits
from expresslane.serve.protocol import INTERNAL_ERROR

C, CH = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BIG = 12 * 10**6  # the 12 MB body


@contextlib.contextmanager
def own_server(server, tok=None, model=None, **kw):
    """A server of its own over the fixture's weights (its own engine and cache)."""
    engine = Engine(server.engine.model, max_model_len=CTX)
    if model is not None:
        engine.model = model(engine.model)
    app = create_app(engine, tok or server.tok, served_model_name=NAME, **kw)
    with serving(app) as url:
        yield SimpleNamespace(url=url, app=app, engine=engine)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


class Gate:
    """The tokenizer, except that encoding or templating a text with MARK waits for release."""

    MARK = "GATED"

    def __init__(self, tok):
        self.tok, self.entered, self.release = tok, threading.Event(), threading.Event()
        self.encoded: list[int] = []  # lengths of the texts encoded

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def _wait(self, text: str) -> None:
        if self.MARK in text:
            self.entered.set()
            assert self.release.wait(30)

    def encode(self, text, add_special_tokens=True):
        self.encoded.append(len(text))
        self._wait(text)
        return self.tok.encode(text, add_special_tokens)

    def apply_chat_template(self, messages, **kw):
        self._wait(str(messages))
        return self.tok.apply_chat_template(messages, **kw)


class Post(threading.Thread):
    """A request in a thread of its own; `.response` once it is answered."""

    def __init__(self, url: str, **kw):
        super().__init__(daemon=True)
        self.url, self.kw, self.response, self.done_at = url, kw, None, None
        self.start()

    def run(self):
        with contextlib.suppress(httpx.HTTPError):
            self.response = httpx.post(self.url, **{"timeout": 60, **self.kw})
        self.done_at = time.monotonic()


def wait_for(s, name: str, value: float = 1) -> None:
    """Until the gauge `name` reaches `value` (or fail after 30 s)."""
    deadline = time.monotonic() + 30
    while metric(metrics(s), name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


# --- nothing blocks ---------------------------------------------------------------------------
def test_health_answers_while_a_request_is_tokenized_or_templated(server):
    gate = Gate(server.tok)
    with own_server(server, tok=gate) as s:
        bodies = [
            (C, {"prompt": f"{Gate.MARK} hello", "max_tokens": 2}),
            (CH, {"messages": [{"role": "user", "content": Gate.MARK}], "max_tokens": 2}),
        ]
        for path, body in bodies:  # fmt: skip
            gate.entered.clear(), gate.release.clear()
            req = Post(s.url + path, json=body)
            assert gate.entered.wait(30)
            # The request is inside the tokenizer and stays there until released: were that on
            # the event loop, this /health would time out instead of answering.
            health = httpx.get(s.url + "/health", timeout=10)
            assert health.status_code == 200 and req.is_alive()
            gate.release.set()
            req.join(60)
            assert req.response.status_code == 200, req.response.text


def _refused_while_health_polled(url: str, body: bytes, paced: bool = False):
    """POST `body` to completions while polling /health; (response, health answers, end).

    Paced, the body goes as a chunked stream whose rest waits until /health has answered after
    its first MiB was sent: an answer then comes while the server reads the body, whatever the
    scheduling (unpaced, on a loaded 2-core machine the refusal can beat the first poll).
    """
    answered, first = threading.Event(), 1 << 20

    def stream():
        yield body[:first]
        assert answered.wait(30), "/health did not answer while the body was being sent"
        for at in range(first, len(body), first):
            yield body[at : at + first]

    content = stream() if paced else body
    req = Post(url + C, content=content, headers={"Content-Type": "application/json"})
    answers = []
    while req.is_alive():
        answers.append((httpx.get(url + "/health", timeout=10).status_code, time.monotonic()))
        answered.set()
    req.join()
    return req.response, answers, req.done_at


def test_12mb_body_refused_while_health_answers_and_memory_stays(server):
    body = b'{"prompt": "' + b"x" * BIG + b'", "max_tokens": 4}'
    gate = Gate(server.tok)
    cases = [(ServeLimits(), 413, "too large"),
             (ServeLimits(max_request_bytes=64 << 20), 400, "context")]  # fmt: skip
    for limits, status, words in cases:
        with own_server(server, tok=gate, limits=limits) as s:
            r, answers, end = _refused_while_health_polled(s.url, body, paced=True)
            assert r is not None and r.status_code == status, r
            assert words in r.json()["error"]["message"]
            assert answers and all(code == 200 for code, _ in answers)
            assert any(t < end for _, t in answers)  # answered while the body was refused
            before = rss_bytes()
            for _ in range(4):  # declared by Content-Length: refused before it is read
                r, answers, _ = _refused_while_health_polled(s.url, body)
                assert r.status_code == status and all(code == 200 for code, _ in answers)
            grown = rss_bytes() - before
            m = metrics(s)
        assert grown < 48 << 20, f"RSS grew {grown >> 20} MB over 4 bodies of 12 MB"
        assert max(gate.encoded, default=0) < 1000  # the 12 MB text was never tokenized
        assert metric(m, "generation_tokens_total") == 0
        too_large = metric(m, "request_rejected_total", reason="too_large")
        assert too_large == (5 if status == 413 else 0)


# --- wrong answers ----------------------------------------------------------------------------
def test_tiny_temperature_or_top_p_equals_greedy(server):
    prompt = "def add(a, b):"
    want = greedy(server, server.tok.encode(prompt), 6, ignore_eos=True)
    for kw in (dict(temperature=1e-38), dict(temperature=1.0, top_p=1e-46)):
        body = {"prompt": prompt, "max_tokens": 6, "seed": 1, "ignore_eos": True, **kw}
        out = httpx.post(server.url + C, json=body, timeout=60).json()
        assert out["choices"][0]["text"] == want, kw


def test_echo_text_offset_indexes_the_returned_text(server):
    assert server.tok.add_bos  # the tokens begin with <s>, which the echoed text does not hold
    for prompt in ("hello world, héllo\n  x", [5, 17, 42, 300, 7]):
        body = {"prompt": prompt, "max_tokens": 5, "echo": True, "logprobs": 1, "temperature": 0}
        choice = httpx.post(server.url + C, json=body, timeout=60).json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
        offsets = lp["text_offset"]
        assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] <= len(text)
        for tok, off in zip(lp["tokens"], offsets, strict=True):
            if tok.strip() and not (tok.startswith("<") and tok.endswith(">")):  # <s>, <0x0A>
                # a stretch's first token may have lost its leading space to the decoder
                assert text[off:].startswith((tok, tok.lstrip())), (tok, off, text)


# --- HTTP conventions -------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", C, "POST"), ("PUT", CH, "POST"), ("POST", "/health", "GET, HEAD"),
    ("DELETE", "/v1/models", "GET, HEAD"), ("GET", "/tokenize", "POST"),
    ("POST", "/playground/", "GET, HEAD"), ("OPTIONS", C, "POST"),
])  # fmt: skip
def test_405_says_what_is_allowed(server, method, path, allow):
    r = httpx.request(method, server.url + path)
    assert (r.status_code, r.headers.get("allow")) == (405, allow)
    assert "access-control-allow-origin" not in r.headers  # no CORS unless configured


@pytest.mark.parametrize("path", [C, CH, "/tokenize", "/detokenize"])
@pytest.mark.parametrize("ctype", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_body_not_sent_as_json_is_415(server, path, ctype):
    before = metrics(server)
    headers = {"Content-Type": ctype} if ctype else {}
    body = b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "tokens": [5]}'
    r = httpx.post(server.url + path, content=body, headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == 415
    assert metric(metrics(server), "generation_tokens_total") == metric(
        before, "generation_tokens_total"
    )


UNIMPLEMENTED = [(C, "suffix", "end"), (C, "best_of", 3), (CH, "web_search_options", {"a": 1}),
                 (CH, "functions", [{"name": "f"}]), (CH, "chat_template", "{{ 1 }}")]  # fmt: skip
# the logits adjustments out of range or malformed: a 400 naming each (test_penalties.py has
# what they do)
BAD_ADJUSTMENTS = [(C, "logit_bias", {"50": 100.5}), (C, "logit_bias", {"x": 1}),
                   (C, "logit_bias", {"99999999": 1}), (C, "presence_penalty", 2.5),
                   (CH, "frequency_penalty", "much"), (CH, "repetition_penalty", 0),
                   (CH, "min_tokens", -1), (C, "min_tokens", 5), (C, "prompt_logprobs", -1),
                   (CH, "prediction", {"type": "content", "content": 5})]  # fmt: skip


@pytest.mark.parametrize(("path", "field", "value"), UNIMPLEMENTED + BAD_ADJUSTMENTS)
def test_unimplemented_fields_and_bad_adjustments_are_400_naming_them(server, path, field, value):
    base = {"prompt": "x"} if path == C else {"messages": USER}
    r = httpx.post(server.url + path, json={**base, field: value, "max_tokens": 1})
    err = r.json()["error"]
    assert (r.status_code, err["param"]) == (400, field) and field in err["message"]


def test_neutral_values_of_unimplemented_fields_are_accepted(server):
    neutral = {"logit_bias": {}, "presence_penalty": None, "frequency_penalty": 0.0, "best_of": 1,
               "repetition_penalty": None, "min_tokens": 0,
               "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
               "user": "me", "some_unknown_field": [1]}  # fmt: skip
    r = httpx.post(server.url + CH, json={"messages": USER, "max_tokens": 1, **neutral})
    assert r.status_code == 200, r.text


def test_401_names_the_scheme(server):
    with own_server(server, api_key="sekret") as s:
        bare = httpx.get(s.url + "/v1/models")
        wrong = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer nope"})
        good = httpx.get(s.url + "/v1/models", headers={"Authorization": "Bearer sekret"})
        tok = httpx.post(s.url + "/tokenize", json={"prompt": "x"})
        tok_ok = httpx.post(s.url + "/tokenize", json={"prompt": "x"},
                            headers={"Authorization": "Bearer sekret"})  # fmt: skip
        info = httpx.get(s.url + "/tokenizer_info")
    assert tok.status_code == 401 and tok_ok.status_code == 200 and info.status_code == 200
    assert (bare.status_code, bare.headers["www-authenticate"]) == (401, "Bearer")
    assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert good.status_code == 200


def test_cors_only_for_allowed_origins(server):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    with own_server(server, limits=ServeLimits(allowed_origins=("https://ok.example",))) as s:
        ok = httpx.options(s.url + C, headers={"Origin": "https://ok.example", **pre})
        bad = httpx.options(s.url + C, headers={"Origin": "https://evil.example", **pre})
        get = httpx.get(s.url + "/health", headers={"Origin": "https://ok.example"})
    assert (
        ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://ok.example"
    )
    assert "access-control-allow-origin" not in bad.headers
    assert get.headers["access-control-allow-origin"] == "https://ok.example"


# --- no leaks ---------------------------------------------------------------------------------
def test_errors_show_no_paths_nor_python_names(server, random_laneformer_dir):
    from expresslane.tokenizer import Tokenizer

    folder = str(random_laneformer_dir)
    tok = Tokenizer.from_dir(folder)
    tok.chat_templates = {"default": "{% for i in range(10**9) %}{% endfor %}"}  # OverflowError
    names, aliases = _names(Namespace(served_model_name=None, model=folder))
    assert aliases == [folder] and folder not in names
    with own_server(server, tok=tok, aliases=aliases, root=names[0]) as s:
        templ = httpx.post(s.url + CH, json={"messages": USER})
        unknown = httpx.post(s.url + C, json={"prompt": "x", "model": "gpt-9"})
        by_path = httpx.post(s.url + C, json={"prompt": "x", "model": folder, "max_tokens": 1})
        seed = httpx.post(s.url + C, json={"prompt": "x", "seed": 2**64})
        listed = httpx.get(s.url + "/v1/models").json()["data"]
        s.app.state.service.preparer.completion = lambda body: {}["secret_key"]  # a bug
        bug = httpx.post(s.url + C, json={"prompt": "x"})
    assert templ.status_code == 400 and "Range too big" in templ.json()["error"]["message"]
    assert unknown.status_code == 404 and by_path.status_code == 200
    assert "18446744073709551615" in seed.json()["error"]["message"]
    assert [m["id"] for m in listed] == [NAME] and listed[0]["root"] == names[0]
    assert bug.status_code == 500 and bug.json()["error"]["message"] == INTERNAL_ERROR
    for r in (templ, unknown, seed, bug):
        assert folder not in r.text and "secret_key" not in r.text and "Error:" not in r.text


# --- backpressure -----------------------------------------------------------------------------
class Slow:
    """The model at a fixed pace, so that requests overlap for sure."""

    def __init__(self, model, seconds: float = 0.02):
        self.model, self.seconds = model, seconds

    def __call__(self, *args, **kw):
        time.sleep(self.seconds)
        return self.model(*args, **kw)


def test_max_queue_503_with_retry_after_and_max_n(server):
    long = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    limits = ServeLimits(max_queue=1, max_n=2)
    with own_server(server, model=Slow, limits=limits) as s:
        running = Post(s.url + C, json=long, timeout=1.5)  # 200 tokens at 50/s: 4 s
        wait_for(s, "num_requests_running")
        waiting = Post(s.url + C, json=long, timeout=1.5)
        wait_for(s, "num_requests_waiting")
        full = httpx.post(s.url + C, json={"prompt": "y", "max_tokens": 1})
        tok = httpx.post(s.url + "/tokenize", json={"prompt": "y"})  # the same queue
        m = metrics(s)
        running.join(), waiting.join()  # both clients give up: their jobs are cancelled
        wait_idle(s, 10)
        many = httpx.post(s.url + C, json={"prompt": "y", "n": 3})
        two = httpx.post(s.url + C, json={"prompt": "y", "n": 2, "max_tokens": 1})
    assert full.status_code == 503 and full.json()["error"]["code"] == 503
    assert 1 <= int(full.headers["retry-after"]) <= 60 and "--max-queue" in full.text
    assert tok.status_code == 503
    assert metric(m, "request_rejected_total", reason="queue_full") == 2
    assert (many.status_code, many.json()["error"]["param"]) == (400, "n")
    assert two.status_code == 200 and len(two.json()["choices"]) == 2


def test_limit_flags_parse_and_refuse_nonsense():
    from expresslane.cli.serve import _origins
    from expresslane.errors import ConfigError

    assert _origins('["https://a.example", "http://b:8080"]') == (
        "https://a.example",
        "http://b:8080",
    )
    assert _origins("https://a.example, http://b") == ("https://a.example", "http://b")
    with pytest.raises(ConfigError, match="--max-n"):
        ServeLimits(max_n=0).validate()
    with pytest.raises(ConfigError, match="--max-queue"):
        create_app(None, None, limits=ServeLimits(max_queue=0))


def test_priority_scheduling_serves_the_lowest_first(server):
    """vLLM's --scheduling-policy priority: while a request runs, a later one of priority -1
    is served before an earlier one of priority 5. Under fcfs (the default) a priority other
    than 0 is a 400 naming it."""
    r = httpx.post(server.url + C, json={"prompt": "x", "max_tokens": 1, "priority": 3})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "priority")
    from concurrent.futures import ThreadPoolExecutor

    with own_server(server, limits=ServeLimits(scheduling_policy="priority")) as s:
        worker, gate = s.app.state.service.worker, threading.Event()
        steps = s.engine.generate_steps

        def held(*args, **kw):  # the first request holds the engine until the others queue
            gate.wait(30)
            yield from steps(*args, **kw)

        s.engine.generate_steps = held

        def until(cond):
            deadline = time.monotonic() + 30
            while not cond() and time.monotonic() < deadline:
                time.sleep(0.005)

        def ask(priority):
            body = {"prompt": "x", "max_tokens": 2, "temperature": 0, "priority": priority}
            return httpx.post(s.url + C, json=body, timeout=60).status_code

        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(ask, 0)
            until(lambda: len(worker.served) == 1)  # running, held
            late = pool.submit(ask, 5)
            until(lambda: worker.queued() == 1)
            urgent = pool.submit(ask, -1)
            until(lambda: worker.queued() == 2)
            gate.set()
            assert [f.result() for f in (first, late, urgent)] == [200, 200, 200]
        a, b, c = sorted(worker.served)  # arrival numbers: first, late, urgent
        assert list(worker.served) == [a, c, b]
