"""The reasoning parsers (structured/reasoning.py): the split of a whole output, and the streamed
split of any chunking of it adding up to the same (reasoning, content)."""

from __future__ import annotations

import random

import pytest

from expresslane.structured.reasoning import PARSERS, ReasoningStream, split

CASES = [  # (text, deepseek_r1's split, qwen3's split)
    ("<think>\nsteps</think>\n\nThe answer.", ("\nsteps", "The answer."),
     ("\nsteps", "The answer.")),
    ("steps</think>answer", ("steps", "answer"), (None, "steps</think>answer")),
    ("  <think>a</think>  b", ("a", "b"), ("a", "b")),
    ("<think>cut short by max_tokens", ("cut short by max_tokens", ""),
     ("cut short by max_tokens", "")),
    ("no tags at all", ("no tags at all", ""), (None, "no tags at all")),
    ("<thi", ("<thi", ""), (None, "<thi")),
    ("<think></think>", ("", ""), ("", "")),
    ("a</think>b</think>c", ("a", "b</think>c"), (None, "a</think>b</think>c")),
    ("", ("", ""), (None, "")),
]  # fmt: skip


@pytest.mark.parametrize("text,deepseek,qwen3", CASES)
def test_split(text, deepseek, qwen3):
    assert split(text, "deepseek_r1") == deepseek
    assert split(text, "qwen3") == qwen3


def streamed(text: str, parser: str, cuts: list[int]) -> tuple[str | None, str]:
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = stream.push(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    return (reasoning + r) or None, content + c


@pytest.mark.parametrize("parser", PARSERS)
def test_any_chunking_streams_the_split(parser):
    rng = random.Random(7)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", " ", "\n", "a", "b", "</thi"]
    texts = [t for t, _, _ in CASES]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12))) for _ in range(300)]
    for text in texts:
        thought, answer = split(text, parser)
        want = thought or None, answer  # no reasoning and an empty one read alike
        for _ in range(6):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(4))))
            assert streamed(text, parser, cuts) == want, (text, cuts)
        assert streamed(text, parser, list(range(1, len(text)))) == want, text  # by character
