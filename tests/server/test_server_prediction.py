"""Predicted Outputs through the server: the `openai` client's `prediction`, the same text as
without one, OpenAI's `completion_tokens_details` counts (streamed too), and 400s that name the
field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from serverkit import NAME

PROMPT = "def add(a, b):\n    return a + b\n"


def test_chat_prediction_keeps_the_text_and_reports_counts(server):
    messages = [{"role": "user", "content": PROMPT}]
    plain = server.chat(messages=messages, max_tokens=40, temperature=0)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # no prediction, no details
    assert text
    got = server.chat(messages=messages, max_tokens=40, temperature=0,
                      prediction={"type": "content", "content": text})  # fmt: skip
    assert got.choices[0].message.content == text
    details = got.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens <= 40
    # an unrelated prediction: the same text, its drafts rejected
    other = server.chat(messages=messages, max_tokens=40, temperature=0,
                        prediction={"type": "content", "content": "zzzz qqqq " * 20})  # fmt: skip
    assert other.choices[0].message.content == text
    assert other.usage.completion_tokens_details.accepted_prediction_tokens < 5


def test_completion_prediction_in_parts_and_streamed_usage(server):
    plain = server.cmpl(prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    half = len(plain) // 2
    parts = [{"type": "text", "text": plain[:half]}, {"type": "text", "text": plain[half:]}]
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "prediction": {"type": "content", "content": parts}}  # fmt: skip
    text, usage = [], None
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += [c["text"] for c in chunk["choices"]]
                usage = chunk.get("usage") or usage
    assert "".join(text) == plain
    assert usage["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(
    "prediction, extra, says",
    [
        ({"type": "file", "content": "x"}, {}, "prediction.type"),
        ({"type": "content"}, {}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url"}]}, {}, "image_url"),
        ({"type": "content", "content": "x" * 200_000}, {}, "maximum context length"),
    ],
)
def test_bad_predictions_are_400s_naming_the_field(server, prediction, extra, says):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat(messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                    prediction=prediction, **extra)  # fmt: skip
    err = e.value.body
    assert err["param"] == "prediction" and says in err["message"], err
