"""The edges a hostile test found (issue 28), each against a real uvicorn (serverkit.py).

Covered: finite numbers beyond fp32 (temperature 1e39) are a 400 naming the field, streamed or
not; a large reply is serialised off the event loop (/health answers while it is); special
tokens hidden unless `skip_special_tokens` is false; CORS preflights asking for any header (the
OpenAI JS SDK's x-stainless-*) pass by default and `--allowed-headers` narrows them; a chat
template whose output is no text is a 400; HEAD wherever GET; the schema states the rules the
server enforces (token ids >= 0, /tokenize's prompt or messages, chat roles) and strict
booleans.
"""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import httpx
import pytest
from serverkit import CTX, NAME, metric, metrics
from test_server_hostile import CH, USER, C, Post, own_server

from expresslane.cli.serve import serving
from expresslane.engine import Engine
from expresslane.serve import attach, create_app
from expresslane.serve.guards import ServeLimits


# --- numbers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "field", "value"), [
    (C, "temperature", 1e39), (CH, "temperature", 1e39), (C, "temperature", -1e39),
    (CH, "top_p", 1e39), (C, "min_p", -1e300),
])  # fmt: skip
def test_finite_numbers_beyond_fp32_are_400_naming_the_field(server, stream, path, field, value):
    body = {"prompt": "a"} if path == C else {"messages": USER}
    r = httpx.post(
        server.url + path, json={**body, field: value, "max_tokens": 2, "stream": stream}
    )
    assert r.status_code == 400, r.text  # was a 500 (or a 200 then an error event when streamed)
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_fp32_temperature_still_samples(server):
    # near-uniform draws: without ignore_eos, EOS ended one run in about 1/vocab per token
    body = {"prompt": "a", "temperature": 3e38, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(server.url + C, json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# --- a large reply off the loop ---------------------------------------------------------------
class GatedIds(list):
    """Token ids whose serialisation waits for `release`: iterating or slicing them is the
    serialiser's work (json's C encoder and FastAPI's jsonable_encoder iterate a list subclass;
    a long list may be encoded a slice at a time)."""

    def __init__(self, ids, entered: threading.Event, release: threading.Event):
        super().__init__(ids)
        self.entered, self.release = entered, release

    def _gate(self) -> None:
        self.entered.set()
        assert self.release.wait(30)

    def __iter__(self):
        self._gate()
        return super().__iter__()

    def __getitem__(self, index):
        self._gate()
        return super().__getitem__(index)


class LargeReply:
    """The tokenizer, except that encoding returns GatedIds (690k ids: the issue's 4 MB reply)."""

    def __init__(self, tok):
        self.tok, self.entered, self.release = tok, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, add_special_tokens=True):
        ids = self.tok.encode(text, add_special_tokens)
        if text.startswith("LARGE"):
            return GatedIds(ids * (690_000 // len(ids) + 1), self.entered, self.release)
        return ids


def test_health_answers_while_a_large_reply_is_serialised(server):
    tok = LargeReply(server.tok)
    with own_server(server, tok=tok) as s:
        req = Post(s.url + "/tokenize", json={"prompt": "LARGE reply"})
        assert tok.entered.wait(30)
        # The reply is being serialised and stays so until released: on the event loop, this
        # /health would time out instead of answering.
        try:
            health = httpx.get(s.url + "/health", timeout=10)
        finally:
            tok.release.set()
        assert health.status_code == 200 and req.is_alive()
        req.join(60)
    assert req.response.status_code == 200
    assert req.response.json()["count"] >= 690_000


def test_very_long_texts_are_tokenized_in_a_helper_process(server, monkeypatch):
    """Past OFFLOAD_CHARS, /tokenize's ids come from a helper process (the server's GIL stays
    free: BENCHMARKS.md's /health figures): the same reply as the server's own tokenizer."""
    from expresslane.serve import offload

    monkeypatch.setattr(offload, "OFFLOAD_CHARS", 200)
    text = "héllo wörld, def f(x): return x ** 2\n" * 40
    with own_server(server) as s:
        body = {"prompt": text, "return_token_strs": True}
        prompt = httpx.post(s.url + "/tokenize", json=body, timeout=120)
        chat = httpx.post(
            s.url + "/tokenize", json={"messages": [{"role": "user", "content": text}]}, timeout=120
        )
        short = httpx.post(s.url + "/tokenize", json={"prompt": "hi"})
        helper = s.app.state.service.preparer.offload
        assert helper.offloaded == 2  # the short one stayed in the server
    ids = server.tok.encode(text)
    assert prompt.json()["tokens"] == ids and prompt.json()["count"] == len(ids)
    assert prompt.json()["token_strs"] == [server.tok.id_to_piece(i) for i in ids]
    chat_ids = server.tok.encode_chat([{"role": "user", "content": text}],
                                      add_generation_prompt=True)  # fmt: skip
    assert chat.json()["tokens"] == chat_ids
    assert short.json()["tokens"] == server.tok.encode("hi")


# --- special tokens ---------------------------------------------------------------------------
class Favour:
    """The model, except that token `token` always has the highest logit."""

    def __init__(self, model, token: int = 1):
        self.model, self.token = model, token

    def __call__(self, *args, **kw):
        logits = self.model(*args, **kw).clone()
        logits[..., self.token] = logits.max() + 10
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_special_tokens_hidden_unless_asked_for(server):
    bos = server.tok.id_to_piece(1)
    assert 1 in server.tok.special_ids and 1 not in server.tok.eos_ids
    body = {"prompt": "a", "max_tokens": 3, "temperature": 0}
    with own_server(server, model=Favour) as s:
        hidden = httpx.post(s.url + C, json=body).json()
        shown = httpx.post(s.url + C, json={**body, "skip_special_tokens": False}).json()
        tight_body = {**body, "skip_special_tokens": False, "spaces_between_special_tokens": False}
        tight = httpx.post(s.url + C, json=tight_body).json()
        chat = httpx.post(s.url + CH, json={"messages": USER, "max_tokens": 3}).json()
        scored = httpx.post(s.url + C, json={**body, "logprobs": 0}).json()["choices"][0]
        streamed = httpx.post(s.url + C, json={**body, "stream": True}).text
    assert hidden["usage"]["completion_tokens"] == 3 and hidden["choices"][0]["text"] == ""
    assert shown["choices"][0]["text"] == bos * 3 == tight["choices"][0]["text"]
    assert chat["choices"][0]["message"]["content"] == ""
    assert scored["text"] == "" and scored["logprobs"]["text_offset"] == [0, 0, 0]
    assert bos not in streamed and "[DONE]" in streamed


def test_every_end_id_of_the_tokenizer_stops_generation(server):
    """An end id the tokenizer declares (tokenizer_config.json, GGUF end markers) stops as the
    config's EOS does, unless ignore_eos."""
    tok = copy.copy(server.tok)
    tok.eos_ids = (*server.tok.eos_ids, 1)
    assert 1 not in server.engine.cfg.eos_token_ids
    body = {"prompt": "a", "max_tokens": 3, "temperature": 0, "skip_special_tokens": False}
    with own_server(server, tok=tok, model=Favour) as s:
        stopped = httpx.post(s.url + C, json=body).json()
        ignored = httpx.post(s.url + C, json={**body, "ignore_eos": True}).json()
    choice = stopped["choices"][0]
    assert stopped["usage"]["completion_tokens"] == 1 and choice["text"] == ""
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert ignored["usage"]["completion_tokens"] == 3


# --- CORS, HEAD -------------------------------------------------------------------------------
SDK_HEADERS = "authorization, content-type, x-stainless-os, x-stainless-lang, openai-beta"


def _preflight(url: str, headers: str) -> httpx.Response:
    return httpx.options(url + C, headers={"Origin": "https://ok.example",
                                           "Access-Control-Request-Method": "POST",
                                           "Access-Control-Request-Headers": headers})  # fmt: skip


def test_cors_allows_every_header_by_default_and_allowed_headers_narrows(server):
    origins = ("https://ok.example",)
    with own_server(server, limits=ServeLimits(allowed_origins=origins)) as s:
        sdk = _preflight(s.url, SDK_HEADERS)
    narrow = ServeLimits(allowed_origins=origins, allowed_headers=("Content-Type",))
    with own_server(server, limits=narrow) as s:
        refused = _preflight(s.url, SDK_HEADERS)
        plain = _preflight(s.url, "content-type")
    assert sdk.status_code == 200, sdk.text  # the OpenAI JS SDK from a browser app
    assert sdk.headers["access-control-allow-origin"] == "https://ok.example"
    assert "x-stainless-os" in sdk.headers["access-control-allow-headers"].lower()
    assert refused.status_code == 400 and plain.status_code == 200


@pytest.mark.parametrize(
    "path", ["/health", "/ping", "/version", "/metrics", "/v1/models", "/tokenizer_info", "/"]
)
def test_head_works_where_get_does(server, path):
    get, head = httpx.get(server.url + path), httpx.head(server.url + path)
    assert get.status_code == 200 and head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


# --- templates --------------------------------------------------------------------------------
def test_template_output_that_is_no_text_is_400(server):
    tok = copy.copy(server.tok)
    tok.chat_templates = {"default": "{{ '\\ud800' }}{{ messages[0]['content'] }}"}
    with own_server(server, tok=tok) as s:
        chat = httpx.post(s.url + CH, json={"messages": USER, "max_tokens": 2})
        tokenize = httpx.post(s.url + "/tokenize", json={"messages": USER})
    for r in (chat, tokenize):
        assert r.status_code == 400, r.text  # was a 500 from the tokenizer
        err = r.json()["error"]
        assert err["param"] == "messages" and "not valid text" in err["message"]
        assert str(server.tok.folder) not in err["message"]


def test_documents_reach_the_template(server):
    """vLLM's `documents` (RAG templates: Command-R's, Granite's) are the template's variable
    of that name; a malformed list is a 400 naming the field."""
    tok = copy.copy(server.tok)
    tok.chat_templates = {"default": "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]"
                                     "{% endfor %}{{ messages[0]['content'] }}"}  # fmt: skip
    docs = [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]
    with own_server(server, tok=tok) as s:
        with_docs = httpx.post(s.url + CH, json={"messages": USER, "documents": docs,
                                                 "max_tokens": 1})  # fmt: skip
        plain = httpx.post(s.url + CH, json={"messages": USER, "max_tokens": 1})
        bad = httpx.post(s.url + CH, json={"messages": USER, "documents": ["x"], "max_tokens": 1})
    rendered = "[a: first][b: second]" + USER[0]["content"]
    want = len(tok.encode(rendered, add_special_tokens=False))
    assert with_docs.json()["usage"]["prompt_tokens"] == want, with_docs.text
    alone = len(tok.encode(USER[0]["content"], add_special_tokens=False))
    assert plain.json()["usage"]["prompt_tokens"] == alone
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"


# --- what the schema says, the server enforces ------------------------------------------------
@pytest.mark.parametrize(("path", "body", "param"), [
    (C, {"prompt": "a", "echo": "yes"}, "echo"),
    (C, {"prompt": "a", "stream": 1}, "stream"),
    (C, {"prompt": "a", "skip_special_tokens": "false"}, "skip_special_tokens"),
    (CH, {"messages": [{"role": "bot", "content": "hi"}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": None}]}, "messages"),
    (CH, {"messages": [{"role": "tool", "tool_call_id": "a"}]}, "messages"),
    (CH, {"messages": [*USER, {"role": "assistant", "tool_calls": ["get_weather"]}]}, "messages"),
    (CH, {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "a"}]}]}, "messages"),
    (CH, {"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/detokenize", {"tokens": [-3]}, "tokens"),
    ("/tokenize", {"add_special_tokens": True}, "prompt"),
])  # fmt: skip
def test_schema_rules_are_enforced(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_schema_states_the_rules(server):
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    message = schemas["ChatMessage"]["properties"]["role"]
    assert set(message["enum"]) >= {"system", "user", "assistant", "tool"}
    detok = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert detok["minimum"] == 0
    assert {"prompt", "messages"} <= {
        name for alt in schemas["TokenizeRequest"]["anyOf"] for name in alt["required"]
    }
    completion = schemas["CompletionRequest"]["properties"]
    # OpenAI's "boolean or null": null is the default (protocol.NULL_IS_DEFAULT)
    assert {t["type"] for t in completion["echo"]["anyOf"]} == {"boolean", "null"}
    assert completion["skip_special_tokens"]["default"] is True


def test_schema_offers_only_the_neutral_values_of_unsupported_fields(server):
    """A body valid by the schema is never refused for an unsupported field (the fuzzer once
    sent function_call: [""]): each is declared with its neutral values, which the server takes,
    and a value beyond them is the 400 naming the field."""
    from expresslane.serve import unsupported

    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    for model, table in (("CompletionRequest", unsupported.COMPLETIONS),
                         ("ChatCompletionRequest", unsupported.CHAT)):  # fmt: skip
        props = schemas[model]["properties"]
        for name, neutral in table.items():
            alts = props[name].get("anyOf", [props[name]])
            consts = [a["const"] for a in alts if "const" in a]
            assert any(a.get("type") == "null" for a in alts), (model, name)
            assert all(neutral(v) for v in consts), (model, name, consts)
    body = {"messages": USER, "max_tokens": 1, "function_call": "auto", "best_of": 1}
    assert httpx.post(server.url + CH, json=body).status_code == 200
    bad = httpx.post(server.url + CH, json={**body, "function_call": [""]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "function_call"


# --- the CPU's thread count -------------------------------------------------------------------
def test_the_thread_count_is_revised_on_the_engine_thread_before_each_request(server):
    """serve's ThreadGovernor (step/threads.py) is asked before every request, on the thread
    that runs the step (torch keeps the count per thread), and /metrics shows its answer."""
    asked = []

    class Governor:
        def revise(self) -> int:
            asked.append(threading.current_thread().name)
            return 3

    app = create_app(served_model_name=NAME)
    attach(app, Engine(server.engine.model, max_model_len=CTX), server.tok, Governor())
    with serving(app) as url:
        for _ in range(2):
            r = httpx.post(url + C, json={"prompt": "a", "max_tokens": 2})
            assert r.status_code == 200, r.text
        shown = metric(metrics(SimpleNamespace(url=url)), "cpu_threads")
    assert asked == ["expresslane-engine"] * 2 and shown == 3
