"""bench/free_grammar.py on the embedded model: each convention's free grammar leaves greedy and
sampled free text as it is without one (the bench raises otherwise); bad flags exit 2."""

from __future__ import annotations

import json

import pytest

from expresslane.assets import default_model_dir
from expresslane.bench import free_grammar

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: restores the thread count


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_every_convention_keeps_the_free_text(capsys, temperature):
    argv = [str(default_model_dir()), "--max-tokens", "12", "--repeats", "1",
            "--temperature", temperature]  # fmt: skip
    assert free_grammar.main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["grammar"] for r in line["rows"]] == ["none", *free_grammar.CONVENTIONS]
    assert line["same_tokens"] and all(r["tokens_per_s"] > 0 for r in line["rows"])


def test_bad_flags_exit_2(capsys):
    assert free_grammar.main(["--max-tokens", "1"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
