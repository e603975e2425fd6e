"""The model creator's sampling defaults (sampling/defaults.py), vLLM's --generation-config.

Read from a generation_config.json and from a GGUF file's general.sampling.* keys, with vLLM's
exceptions (transformers' top_k 50 dropped, do_sample and max_new_tokens not read, odd values
ignored); a request's own fields win over them field by field; a server given them samples as
the engine does with the merged settings; the CLI flag's three forms.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from expresslane.checkpoint import sampling_defaults
from expresslane.cli.serve import generation_defaults, serving
from expresslane.engine import Engine
from expresslane.errors import ConfigError
from expresslane.sampling.defaults import SamplingDefaults
from expresslane.sampling.params import SamplingParams
from expresslane.serve import create_app
from expresslane.serve.guards import ServeLimits
from expresslane.serve.protocol import ChatCompletionRequest, parse
from expresslane.textgen import generate_text
from expresslane.tokenizer import Tokenizer

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1,
         "max_new_tokens": 2048}  # fmt: skip


def test_a_generation_config_gives_what_it_names():
    got = SamplingDefaults.from_generation_config(QWEN3)
    assert got.given() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert got.describe() == "temperature 0.6, top_p 0.95, top_k 20"
    # transformers' own top_k (vLLM drops it), and values no request could send
    odd = {
        "top_k": 50,
        "temperature": -1,
        "top_p": "high",
        "min_p": True,
        "repetition_penalty": 1.1,
    }
    assert SamplingDefaults.from_generation_config(odd).given() == {"repetition_penalty": 1.1}
    assert SamplingDefaults.from_generation_config({"do_sample": False}).given() == {}


def test_a_gguf_file_gives_its_general_sampling_keys(tmp_path):
    pytest.importorskip("gguf")
    from gguf_kit import write_gguf
    from test_gguf_errors import _meta, _tensors

    meta = {**_meta(), "general.sampling.temp": 0.7, "general.sampling.top_k": 40,
            "general.sampling.penalty_repeat": 1.05}  # fmt: skip
    path = write_gguf(tmp_path / "m.gguf", "llama", meta, _tensors())
    got = sampling_defaults(path).given()
    assert got == pytest.approx({"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.05})
    bare = write_gguf(tmp_path / "n.gguf", "llama", _meta(), _tensors())
    assert sampling_defaults(bare) == SamplingDefaults()
    # keys in the file win; a file without them takes the generation_config.json beside it
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    assert sampling_defaults(bare) == SamplingDefaults.from_generation_config(QWEN3)
    assert sampling_defaults(path).given()["top_k"] == 40


def test_a_folder_gives_its_generation_config(tmp_path):
    assert sampling_defaults(tmp_path) == SamplingDefaults()  # no file: none
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    assert sampling_defaults(tmp_path) == SamplingDefaults.from_generation_config(QWEN3)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json: not valid JSON"):
        sampling_defaults(tmp_path)


def test_the_request_wins_field_by_field():
    model = SamplingDefaults.from_generation_config({**QWEN3, "repetition_penalty": 1.1})
    silent = parse(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert model.over(silent) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                  "repetition_penalty": 1.1}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0, "top_k": 0,
            "repetition_penalty": None}  # fmt: skip
    spoke = parse(ChatCompletionRequest, json.dumps(body).encode())
    assert model.over(spoke) == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
                                 "repetition_penalty": 1.0}  # fmt: skip
    # no model defaults: OpenAI's, as before
    assert SamplingDefaults().over(silent) == {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                               "min_p": 0.0, "repetition_penalty": 1.0}  # fmt: skip


def test_a_server_with_the_models_defaults_samples_with_them(random_laneformer_dir):
    """The model says greedy (temperature 0): a request that is silent, or sends null (OpenAI's
    "or null": the default), decodes greedy; one that sends its own temperature and seed
    samples as the engine does with them."""
    path = str(random_laneformer_dir)
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", max_model_len=256,
                                    progress=False)  # fmt: skip
    tok = Tokenizer.from_dir(path)
    limits = ServeLimits(sampling_defaults=SamplingDefaults(temperature=0.0, top_k=5))
    ref = Engine(engine.model, max_model_len=256)

    def want(**kw) -> str:
        params = SamplingParams(max_tokens=8, ignore_eos=True, **kw)
        return "".join(t for t, _ in generate_text(ref, tok, tok.encode("Once upon"), params))

    body = {"prompt": "Once upon", "max_tokens": 8, "ignore_eos": True}
    with serving(create_app(engine, tok, served_model_name="tiny", limits=limits)) as url:
        silent = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
        nulls = dict.fromkeys(("temperature", "top_p", "top_k", "min_p", "n", "stream", "echo"))
        nulled = httpx.post(url + "/v1/completions", json={**body, **nulls})  # OpenAI's "or null"
        sampled = httpx.post(url + "/v1/completions", json={**body, "temperature": 1.0,
                             "seed": 1234}).json()["choices"][0]["text"]  # fmt: skip
    assert silent == want(temperature=0.0, top_k=5) == nulled.json()["choices"][0]["text"]
    assert sampled == want(temperature=1.0, top_k=5, seed=1234)


def test_the_flags_three_forms(random_laneformer_dir, tmp_path):
    args = SimpleNamespace(model=str(random_laneformer_dir), generation_config="auto")
    assert generation_defaults(args) == sampling_defaults(random_laneformer_dir)
    assert generation_defaults(SimpleNamespace(model=None, generation_config="vllm")) == (
        SamplingDefaults()
    )
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    folder = SimpleNamespace(model=None, generation_config=str(tmp_path))
    assert generation_defaults(folder).given()["top_k"] == 20
    with pytest.raises(ConfigError, match="--generation-config"):
        generation_defaults(SimpleNamespace(model=None, generation_config=str(tmp_path / "no")))
