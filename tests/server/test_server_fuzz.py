"""A bounded fuzz of the server from its own /openapi.json that reaches generation (issue 28).

Schemathesis generates requests from the schema, against a real uvicorn over the tiny random
Laneformer (serverkit.py): bodies the schema calls valid for /v1/chat/completions and
/v1/completions must get a 200 (so the schema states every rule the server enforces), unless
the refusal is one no schema can state (the prompt longer than the context, a token id outside
this model's vocabulary, the model's chat template refusing the conversation); invalid bodies
must get a 4xx; nothing anywhere gets a 5xx. Bounded: a few dozen examples, max_tokens capped,
no deadline, derandomized (the same examples every run). Every operation of the schema, too:
a few generated requests each, the answers checked against the schema.
"""

from __future__ import annotations

import copy
import re
from collections import Counter

import httpx
import pytest
from test_server_hostile import CH, C, own_server

from expresslane.serve.guards import ServeLimits

schemathesis = pytest.importorskip("schemathesis", reason="needs schemathesis (PyPI)")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

MAX_TOKENS = 3  # generation is what is fuzzed, not its length
# The tiny model's template takes user and assistant only; this one takes every role of the
# schema, so that generated conversations reach generation
EVERY_ROLE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
# Refusals of schema-valid bodies that depend on the model, the prompt or the server's flags,
# not on the schema
SEMANTIC = re.compile(
    r"maximum context length|outside the vocabulary|chat template|'max_(completion_)?tokens' is "
    r"too large|continue_final_message|at least one token|no room to generate|"
    r"serves in arrival order \(fcfs\)"  # a priority, where the server's policy takes none
)


# Fields the server reads from a body's extras though its schema does not declare them (the
# structured-output and tool names of vLLM, llama.cpp and OpenAI: serve/structured.py, tested
# in test_structured.py and server/test_server_structured.py). The fuzz draws extra keys at
# random, and one run drew `"grammar": {...}`, a 400 ("must be a non-empty grammar text") for a
# body the schema allows.
UNDECLARED = ("response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar", "json_schema", "grammar", "tools",
              "tool_choice")  # fmt: skip


def _bounded(body, vocab: int):
    """A positive body made to reach generation: max_tokens capped (min_tokens to it), and
    token ids (a prompt's, stop_token_ids, logit_bias's) taken into the vocabulary. The schema
    allows any id, and which ids a model refuses is its own (a semantic 400). Hypothesis's
    examples differ between runs and with the test's source (derandomize fixes a seed, not what
    it explores): one CI run drew 15 of 20 prompts with an id out of range, and generation was
    reached 5 times; 30 examples a generating route since the penalties' fields joined the
    schema (20 then reached chat generation 9 times, the rest semantic 400s)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if _is_id(body.get(key)):  # an int, or a float JSON may give for one
                body[key] = min(int(body[key]), MAX_TOKENS)
        if body.get("max_tokens") is None:  # null is the schema's too: the context's rest
            body["max_tokens"] = MAX_TOKENS
        for key in UNDECLARED:  # read beyond the schema: a random value there is its own 400
            body.pop(key, None)
        if _is_id(body.get("min_tokens")):  # at most max_tokens: a relation, not a schema rule
            limits = [int(body[k]) for k in ("max_tokens", "max_completion_tokens")
                      if _is_id(body.get(k))]  # fmt: skip
            body["min_tokens"] = min([int(body["min_tokens"]), *limits])
        if isinstance(body.get("logit_bias"), dict):  # its ids into the vocabulary, as a prompt's
            body["logit_bias"] = {str(int(k) % vocab): v for k, v in body["logit_bias"].items()}
        for key in ("prompt", "stop_token_ids"):
            if key in body:
                body[key] = _in_vocab(body[key], vocab)
    return body


def _is_id(t) -> bool:
    integral = isinstance(t, float) and t.is_integer() and abs(t) < 2**53
    return (isinstance(t, int) and not isinstance(t, bool)) or integral


def _in_vocab(prompt, vocab: int):
    """Token ids (a list, or a list of lists) modulo the vocabulary; text as it is."""
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [int(t) % vocab for t in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return [_in_vocab(p, vocab) for p in prompt]
    return prompt


def _run(op, url: str, mode, examples: int, seen: Counter, failures: list, vocab: int) -> None:
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def check(case):
        if mode == GenerationMode.POSITIVE and op.path in (C, CH):
            case.body = _bounded(case.body, vocab)
        r = case.call(base_url=url, timeout=60)
        seen[(op.path, mode.value, r.status_code)] += 1
        body = repr(case.body)[:300]
        if r.status_code >= 500:
            failures.append(f"{op.path} {mode.value}: {r.status_code} for {body}: {r.text[:200]}")
        elif mode == GenerationMode.NEGATIVE and r.status_code == 200 and op.path in (C, CH):
            pass  # the negative generator may produce a valid body (an extra key, say)
        elif mode == GenerationMode.POSITIVE and op.path in (C, CH) and r.status_code != 200:
            if not SEMANTIC.search(r.text):
                failures.append(f"{op.path}: {r.status_code} for a valid body {body}: {r.text}")

    check()


def test_fuzz_from_the_schema_reaches_generation_and_never_5xx(server):
    limits = ServeLimits(max_n=2)
    seen: Counter = Counter()
    failures: list[str] = []
    tok = copy.copy(server.tok)
    tok.chat_templates = {"default": EVERY_ROLE}
    with own_server(server, tok=tok, limits=limits) as s:
        schema = schemathesis.openapi.from_dict(httpx.get(s.url + "/openapi.json").json())
        for result in schema.get_all_operations():
            op = result.ok()
            generating = op.path in (C, CH)
            vocab = s.engine.cfg.vocab_size
            _run(op, s.url, GenerationMode.POSITIVE, 30 if generating else 3, seen, failures, vocab)
            if op.method.upper() == "POST":
                _run(op, s.url, GenerationMode.NEGATIVE, 5 if generating else 3, seen, failures,
                     vocab)  # fmt: skip
    assert not failures, "\n".join(failures[:10])
    for path in (C, CH):  # generation was reached, many times
        assert seen[(path, "positive", 200)] >= 10, seen
    assert not [k for k in seen if k[2] >= 500]


# --- the schema -------------------------------------------------------------------------------
def test_openapi_schema_validates_real_requests_and_responses(server):
    limits = ServeLimits(max_n=2)
    with own_server(server, limits=limits) as s:
        raw = httpx.get(s.url + "/openapi.json").json()
        assert httpx.get(s.url + "/docs").status_code == 200
        assert httpx.get(s.url + "/redoc").status_code == 200
        body = raw["paths"][C]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": "#/components/schemas/CompletionRequest"}
        assert raw["components"]["schemas"]["CompletionRequest"]["properties"]["n"]["maximum"] == 2
        schema = schemathesis.openapi.from_dict(raw)
        ran = []
        for result in schema.get_all_operations():
            _schemathesis_check(result.ok(), s.url, ran)()
    assert {C, CH, "/tokenize", "/detokenize", "/health"} <= {r.split(" ")[1] for r in ran}


def _schemathesis_check(op, url: str, ran: list):
    """A few generated requests to one operation, each answer checked against the schema."""
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    # Schema-valid requests may still be refused (a token id outside the vocabulary, a prompt
    # longer than the context): everything else is checked, no 5xx above all.
    @given(case=op.as_strategy())
    @settings(max_examples=4, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    def check(case):
        if isinstance(case.body, dict) and "max_tokens" not in case.body:
            case.body["max_tokens"] = 4  # keep the run short; other values still come
        case.call_and_validate(base_url=url, excluded_checks=[positive_data_acceptance])
        ran.append(op.label)

    return check
