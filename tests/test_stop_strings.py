"""Stop strings over streamed text (tokenizer/stream.py's StopStringMatcher): a table of edge
cases, and random texts and cuts against str.find. Nothing emitted is ever taken back."""

from __future__ import annotations

import random

import pytest

from expresslane.tokenizer import StopStringMatcher

STOP_CASES = [
    # (stops, pushes, emitted text, stopped)
    (["STOP"], ["ab", "cS", "T", "O", "Pxyz"], "abc", True),
    (["aab"], ["a", "a", "a", "b", "more"], "a", True),
    (["abcd", "bc"], ["a", "b", "c", "d"], "a", True),
    (["xyz", "b"], ["abcxyz"], "a", True),
    (["Hi"], ["Hi there"], "", True),
    (["\n\n"], ["line\n", "\nnext"], "line", True),
    (["END"], ["the E", "N", "d"], "the ENd", False),
    (["END"], ["xEN"], "xEN", False),
    ([], ["free ", "text"], "free text", False),
    ([""], ["empty stops are ignored"], "empty stops are ignored", False),
]


@pytest.mark.parametrize("stops,pushes,expected,stopped", STOP_CASES)
def test_stop_string_table(stops, pushes, expected, stopped):
    matcher, out, done = StopStringMatcher(stops), "", False
    for text in pushes:
        emit, done = matcher.push(text)
        out += emit
    out += matcher.flush()
    assert (out, done) == (expected, stopped)


def test_stop_strings_random_against_find():
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randrange(0, 25)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        expected = text[: min(hits)] if hits else text
        matcher, out, cut = StopStringMatcher(stops), "", sorted(rng.sample(range(26), 4))
        for a, b in zip([0] + cut, cut + [len(text)], strict=True):
            emit, done = matcher.push(text[a:b])
            out += emit
            assert expected.startswith(out)  # nothing emitted is ever taken back
        assert (out + matcher.flush(), done) == (expected, bool(hits))


def test_a_non_ascii_stop_string_cut_anywhere():
    """A stop string of several non-ASCII characters, the text cut in two at every position:
    the answer is the text before the stop, whatever the cut."""
    text, stop = "naïve café → fin, ça", "é → f"
    expected = text[: text.find(stop)]
    for cut in range(len(text) + 1):
        matcher = StopStringMatcher([stop])
        out, done = matcher.push(text[:cut])
        if not done:
            more, done = matcher.push(text[cut:])
            out += more
        assert (out + matcher.flush(), done) == (expected, True), cut
