"""A one-shot `run` sizes its KV cache to its request (cli/run.py run_context): the prompt,
--max-tokens and what a forward writes ahead, in whole blocks; --max-model-len wins; a request
the model's own context cannot beat keeps that context. The tokens are the full context's."""

from __future__ import annotations

import json

import pytest

from expresslane.__main__ import main
from expresslane.cli import run
from expresslane.engine import Engine
from expresslane.tokenizer import Tokenizer

PROMPT = "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add(a, b):"


@pytest.fixture
def made(monkeypatch):
    """The max_len of every engine `run` makes."""
    lens: list[int] = []
    real = Engine.__init__

    def spy(self, *a, **kw):
        real(self, *a, **kw)
        lens.append(self.max_len)

    monkeypatch.setattr(Engine, "__init__", spy)
    return lens


def _run(capsys, model, *flags) -> dict:
    argv = ["run", str(model), "--prompt", PROMPT, "--ignore-eos", "--json", *flags]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_cache_holds_the_prompt_the_tokens_and_a_forward_ahead(
    random_laneformer_dir, capsys, made
):
    n = len(Tokenizer.from_dir(random_laneformer_dir).encode(PROMPT))
    res = _run(capsys, random_laneformer_dir, "--max-tokens", "40")
    want = -(-(n + 40 + run.RUN_AHEAD) // run.RUN_BLOCK) * run.RUN_BLOCK
    assert res["prompt_tokens"] == n and made == [want] and want < 1024  # the model's: 1,024
    _run(capsys, random_laneformer_dir, "--max-tokens", "40", "--max-model-len", "300")
    assert made[-1] == 300  # the flag wins
    _run(capsys, random_laneformer_dir, "--max-tokens", "900")
    assert made[-1] == 1024  # no smaller than the model's: its own


@pytest.mark.parametrize("spec", [None, '{"method": "ngram", "num_speculative_tokens": 8}'])
def test_a_sized_cache_gives_the_full_contexts_tokens(random_laneformer_dir, capsys, made, spec):
    """Up to the cache's last block (speculation drafting 8 ahead of the last token, where a
    repeated prompt gives its drafts), the same tokens as in the model's whole context."""
    n = len(Tokenizer.from_dir(random_laneformer_dir).encode(PROMPT))
    fill = run.RUN_BLOCK - n - run.RUN_AHEAD  # the request ends one forward short of the end
    flags = ["--max-tokens", str(fill), *(["--speculative-config", spec] if spec else [])]
    sized = _run(capsys, random_laneformer_dir, *flags)
    full = _run(capsys, random_laneformer_dir, *flags, "--max-model-len", "1024")
    assert made == [run.RUN_BLOCK, 1024]
    assert sized["completion_tokens"] == fill and sized["token_ids"] == full["token_ids"]
