"""bench/free_grammar.py on the embedded model: each convention's free grammar leaves greedy and
sampled free text as it is without one; its dry run (the GPU stage's plumbing) on random
weights; bad flags exit 2."""

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
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in line["rows"])
    assert line["same_tokens"]


def test_the_dry_run_times_every_convention_on_random_weights(capsys):
    assert free_grammar.main(["--dry-run"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["model"].endswith("(random weights)") and line["max_tokens"] == 8
    assert len(line["rows"]) == 4 and all(r["tokens_per_s"] > 0 for r in line["rows"])


def test_bad_flags_exit_2(capsys):
    assert free_grammar.main(["--max-tokens", "1"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert free_grammar.main(["--preset", "no-such-preset"]) == 2
    assert "no-such-preset" in capsys.readouterr().err


def test_a_preset_head_is_cut_to_the_borrowed_tokenizers_vocabulary():
    """--preset with the embedded model's 4,096-token tokenizer: every id the model can pick
    is a token (a larger head would make most random picks ids no text has)."""
    from expresslane.bench.structured import random_engine

    engine = random_engine("llama-tiny", "cpu", "float32", 8, vocab=64)
    assert engine.cfg.vocab_size == 64 and all(t < 64 for t in engine.cfg.eos_token_ids)
    assert engine.prefill([1, 2, 3]).shape[-1] == 64
    assert random_engine("llama-tiny", "cpu", "float32", 8).cfg.vocab_size > 64
