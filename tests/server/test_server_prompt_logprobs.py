"""vLLM's `prompt_logprobs` through the server: each prompt token's logprob, its rank in the
vocabulary and the top n, against the model's own log-softmax; per choice on completions, once
at the top on chat; refused with stream, and above the logprobs limit."""

from __future__ import annotations

import pytest
import torch
from serverkit import NAME, post

from expresslane.serve.logprobs import TokenText


def reference(server, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return server.engine.model(torch.tensor([ids]))[0].float().log_softmax(-1)  # (S, V)


def check_rows(server, ids: list[int], rows: list, n: int) -> None:
    lp = reference(server, ids)
    assert len(rows) == len(ids) and rows[0] is None
    for i in range(1, len(ids)):
        row, tok = lp[i - 1], ids[i]
        got = rows[i]
        own = got[str(tok)]
        assert own["logprob"] == pytest.approx(float(row[tok]), abs=1e-4)
        assert own["rank"] == int((row > row[tok]).sum()) + 1
        assert own["decoded_token"] == TokenText(server.tok)(tok)[0]  # as logprobs name it
        top = sorted((v for k, v in got.items() if v["rank"] <= n), key=lambda v: v["rank"])
        want = row.topk(n).values.tolist() if n else []
        assert [v["logprob"] for v in top][:n] == pytest.approx(want, abs=1e-4)
        assert n <= len(got) <= n + 1  # the top n, and the prompt's token where it is not in them


@pytest.mark.parametrize("n", [0, 3])
def test_completion_prompt_logprobs_equal_the_model(server, n):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(3, 512, (17,), generator=g).tolist()
    body = dict(model=NAME, prompt=ids, max_tokens=2, temperature=0, prompt_logprobs=n, n=2)
    out = post(server, "/v1/completions", body)
    assert len(out["choices"]) == 2
    for choice in out["choices"]:  # vLLM's place: each choice
        check_rows(server, ids, choice["prompt_logprobs"], n)


def test_chat_prompt_logprobs_once_at_the_top(server):
    messages = [{"role": "user", "content": "Name three colours."}]
    body = dict(model=NAME, messages=messages, max_tokens=2, prompt_logprobs=2, n=2)
    out = post(server, "/v1/chat/completions", body)
    ids = server.tok.encode(server.tok.apply_chat_template(messages), add_special_tokens=False)
    check_rows(server, ids, out["prompt_logprobs"], 2)
    assert all("prompt_logprobs" not in c for c in out["choices"])
    plain = post(server, "/v1/chat/completions", dict(model=NAME, messages=messages, max_tokens=2))
    assert "prompt_logprobs" not in plain  # only when asked


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"stream": True, "prompt_logprobs": 1}, "stream"),
        ({"prompt_logprobs": 21}, "less than or equal to 20"),
    ],
)
def test_refusals_name_the_field(server, extra, says):
    body = dict(model=NAME, prompt="hi", max_tokens=2, **extra)
    r = post(server, "/v1/completions", body)
    assert r["error"]["param"] == "prompt_logprobs" and says in r["error"]["message"], r
