"""The reasoning parsers (structured/reasoning.py): the split of a whole output, and the streamed
split of any chunking of it adding up to the same (reasoning, content)."""

from __future__ import annotations

import random

import pytest

from expresslane.structured.reasoning import (
    END,
    PARSERS,
    ReasoningStream,
    split,
    thought_end,
    thought_tokens,
)

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


@pytest.mark.parametrize("parser", PARSERS)
def test_the_thought_ends_where_split_cuts(parser):
    """thought_end: the text before it holds the whole reasoning, the answer is what follows."""
    rng = random.Random(11)
    pieces = ["<think>", "</think>", "</", " ", "\n", "a", "b", "</thi", "nk>"]
    texts = [t for t, _, _ in CASES]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12))) for _ in range(300)]
    for text in texts:
        end, (thought, answer) = thought_end(text, parser), split(text, parser)
        if thought is None:
            assert end == 0, text
            continue
        assert split(text[:end], parser)[0] == thought, text
        assert (text[end:].lstrip() if text[:end].endswith(END) else "") == answer, text


@pytest.mark.parametrize("parser", PARSERS)
def test_reasoning_tokens_are_those_before_the_tag_is_whole(parser):
    """The thought's tokens, counted against the first token after which the text holds
    </think>, over random token cuts (a token may be "", its bytes completed by the next)."""
    rng = random.Random(5)
    for text in ["<think>\nsome steps</think>\n\nThe answer.", "  <think>a</think>b",
                 "<think>never ends", "<think></think>x"]:  # fmt: skip
        for _ in range(40):
            cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randrange(1, 12)))
            toks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            closed = [k for k in range(len(toks) + 1) if END in "".join(toks[:k])]
            want = closed[0] if closed else len(toks)
            assert thought_tokens(toks, parser) == want, toks
    assert thought_tokens(["steps", "</think>", "x"], "deepseek_r1") == 2
    assert thought_tokens(["steps", "</think>", "x"], "qwen3") == 0  # no <think>: no thought
    assert thought_tokens([], parser) == 0
