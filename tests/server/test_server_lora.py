"""`serve MODEL --lora-modules NAME=PATH` through a real uvicorn: the adapter merged at load and
served as NAME alone (its card's root the base's name); the base's name is a 404 naming what is
served; the answer is the merged engine's."""

from __future__ import annotations

import httpx
import pytest

from expresslane.cli.run import load_engine
from expresslane.cli.serve import add_arguments, model_card, serving
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.serve import create_app


def test_an_adapter_served_under_its_name(smollm2_gguf, tmp_path):
    import argparse

    pytest.importorskip("gguf")
    from expresslane.bench.lora import write_adapter
    from expresslane.checkpoint import load_config
    from expresslane.gguf import variants

    base = str(variants.ensure("F32"))
    adapter = tmp_path / "lora.gguf"
    write_adapter(adapter, load_config(variants.ensure("F32")), rank=8, alpha=64.0)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([base, "--device", "cpu", "--lora-modules", f"sql={adapter}"])
    engine, tok = load_engine(args)
    card = model_card(args)
    assert card["served_model_name"] == ["sql"] and card["root"] == variants.ensure("F32").name
    with serving(create_app(engine, tok, **card)) as url:
        models = httpx.get(url + "/v1/models").json()["data"]
        assert [(m["id"], m["root"]) for m in models] == [("sql", card["root"])]
        ask = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        got = httpx.post(url + "/v1/completions", json={"model": "sql", **ask}, timeout=60).json()
        base_name = httpx.post(url + "/v1/completions", json={"model": card["root"], **ask},
                               timeout=60)  # fmt: skip
    ref = Engine.from_pretrained(base, device="cpu", progress=False, lora=((str(adapter), 1.0),))
    ids = tok.encode(ask["prompt"])
    want = tok.decode(list(ref.generate(ids, SamplingParams(max_tokens=8))))
    assert got["choices"][0]["text"] == want
    assert base_name.status_code == 404 and "sql" in base_name.json()["error"]["message"]
