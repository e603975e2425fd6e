"""`POST /v1/embeddings` (serve/embeddings.py) through a real uvicorn and the `openai` client.

The reference is the model itself, without a cache: the LM head's input (Laneformer.head_input)
of the whole input in one forward, at its last position (or every position's mean), then
normalised. The route prefills the engine's own cache chunk by chunk, so the two agree within
fp32 rounding; text and token-id inputs give the same vector, and generation after an
embedding request is what it was before.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import tiny
import torch
import torch.nn.functional as F
from serverkit import CTX, NAME, greedy, post
from test_server_hostile import own_server

from expresslane.engine import Engine
from expresslane.errors import ConfigError
from expresslane.generation import reference_generate
from expresslane.sampling.params import SamplingParams
from expresslane.serve.guards import ServeLimits
from expresslane.step.native import native_step_built
from expresslane.step.pooling import pooled
from expresslane.step.prefill import StepPrefill

EM = "/v1/embeddings"
TEXTS = ["The quick brown fox", "jumps over the lazy dog, twice.", "x"]


def reference(s, ids: list[int], how: str = "last", normalize: bool = True) -> torch.Tensor:
    return raw_reference(s.engine.model, ids, how, normalize)


def raw_reference(model, ids: list[int], how: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        z = model.head_input(model.hidden(torch.tensor([ids])))[0].float()  # (S, E)
    v = z.mean(0) if how == "mean" else z[-1]
    return F.normalize(v, dim=0) if normalize else v


def vectors(out: dict) -> list[torch.Tensor]:
    return [torch.tensor(d["embedding"]) for d in sorted(out["data"], key=lambda d: d["index"])]


def test_openai_client_gets_the_models_vectors(server):
    """The client's default (base64, decoded by it) and floats: the same vectors, the
    reference's within fp32 rounding, unit length, usage counting the input tokens."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    got = client.embeddings.create(model=NAME, input=TEXTS)
    ids = [server.tok.encode(t, True) for t in TEXTS]
    assert [d.index for d in got.data] == [0, 1, 2] and got.model == NAME
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    floats = vectors(post(server, EM, {"model": NAME, "input": TEXTS}))
    for d, want, f in zip(got.data, ids, floats, strict=True):
        v = torch.tensor(d.embedding)
        assert v.shape == (server.engine.model.head_width,)
        assert torch.equal(v, f)  # base64 float32 and JSON floats: the same numbers
        assert torch.allclose(v, reference(server, want), atol=1e-5)
        assert abs(v.norm().item() - 1) < 1e-5


def test_token_ids_truncation_and_raw_vectors(server):
    ids = server.tok.encode(TEXTS[1], True)
    text = vectors(post(server, EM, {"input": TEXTS[1]}))[0]
    (by_ids, nested) = vectors(post(server, EM, {"input": [ids, ids[2:]]}))
    assert torch.equal(by_ids, text)
    assert torch.equal(vectors(post(server, EM, {"input": ids}))[0], text)  # one list of ids
    cut = vectors(post(server, EM, {"input": ids, "truncate_prompt_tokens": len(ids) - 2}))[0]
    assert torch.equal(cut, nested)
    raw = vectors(post(server, EM, {"input": TEXTS[1], "normalize": False}))[0]
    assert torch.allclose(raw, reference(server, ids, normalize=False), atol=1e-4, rtol=1e-5)
    assert torch.allclose(F.normalize(raw, dim=0), text, atol=1e-6)
    width = server.engine.model.head_width
    assert post(server, EM, {"input": "a", "dimensions": width})["data"][0]["index"] == 0


@pytest.mark.skipif(not native_step_built(), reason="the C step is not built")
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_packed_engines_two_ways_agree(kind):
    """On a CPU with the packed step, a short input goes through its C layers and a long one
    (beyond StepPrefill's bound) through the model's layers: the same vectors, the model's
    own, and the cache then holds the input (a ring that wrapped, for mistral)."""
    over = {"llama": dict(sliding_window=None),
            "mistral": dict(layer_types=["sliding_attention", "full_attention"])}[kind]  # fmt: skip
    model = tiny.laneformer(seed=7, model_type=kind, num_lanes=1, num_hidden_layers=2, **over)
    engine = Engine(model, max_model_len=128, decode="graph")
    pre = engine.prefill_forward
    assert isinstance(pre, StepPrefill)
    ids = [3 + (7 * i) % 60 for i in range(37)]
    fast = pooled(engine, ids, "mean", None)
    assert engine.cache.tokens == ids and engine.cache.length == len(ids)
    pre.max_tokens = 4  # the input is now longer than the C layers' bound
    slow = pooled(engine, ids, "mean", None)
    want = raw_reference(model, ids, "mean", False)
    assert torch.allclose(fast, want, atol=1e-5) and torch.allclose(slow, want, atol=1e-5)
    assert not torch.equal(pooled(engine, ids, "last", None), fast)
    params = SamplingParams(max_tokens=6)  # greedy after it: the reference's tokens
    assert list(engine.generate(ids[:20], params)) == reference_generate(model, ids[:20], params)


def test_mean_pooling(server):
    with own_server(server, limits=ServeLimits(pooling="mean")) as s:
        s.tok = server.tok
        for t in TEXTS:
            got = vectors(post(s, EM, {"input": t}))[0]
            assert torch.allclose(got, reference(s, s.tok.encode(t, True), "mean"), atol=1e-5)


def test_generation_after_an_embedding_is_unchanged(server):
    """The embedding's prefill leaves the cache holding its input, as a scoring prefill does:
    the next request reuses what it shares with it and generates what the reference does."""
    prompt = server.tok.encode(TEXTS[0], True)
    want = greedy(server, prompt, 12)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    for emb in (TEXTS[0] + " and more", TEXTS[2]):
        post(server, EM, {"input": emb})
        assert post(server, "/v1/completions", body)["choices"][0]["text"] == want


@pytest.mark.parametrize(
    "body,param,words",
    [({"input": ""}, "input", "non-empty"),
     ({"input": []}, "input", "non-empty"),
     ({"input": ["a", ""]}, "input", "non-empty"),
     ({"input": [[]]}, "input", "non-empty"),
     ({"input": 5}, "input", "non-empty"),
     ({"input": [10**6]}, "input", "outside the vocabulary"),
     ({"input": [1] * (CTX + 1)}, "input", "maximum context length"),
     ({"input": ["a"] * 2049}, "input", "more than 2048"),
     ({"input": "a", "dimensions": 7}, "dimensions", "Matryoshka"),
     ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'int8'"),
     ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
     ({"input": "a", "normalize": "yes"}, "normalize", "boolean")],
)  # fmt: skip
def test_bad_requests_are_400s_naming_the_field(server, body, param, words):
    r = httpx.post(server.url + EM, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_an_unknown_pooling_is_refused():
    with pytest.raises(ConfigError, match="--pooling median"):
        ServeLimits(pooling="median").validate()


def test_unknown_model_is_a_404(server):
    r = httpx.post(server.url + EM, json={"model": "nope", "input": "a"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
