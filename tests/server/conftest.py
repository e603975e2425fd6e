"""The `server` fixture: one tiny random Laneformer behind a real uvicorn on 127.0.0.1.

In its own folder so that only the server tests import the serving stack (openai, uvicorn): the
GPU session runs the kernel and graph tests on a machine that has neither.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import openai
import pytest
import torch
from serverkit import CTX, NAME

from expresslane.cli.serve import serving
from expresslane.engine import Engine
from expresslane.serve import create_app
from expresslane.tokenizer import Tokenizer


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
