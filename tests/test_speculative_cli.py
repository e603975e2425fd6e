"""`--speculative-config` on run, serve and bench: figures in `run --json`, exit 2 on bad input."""

from __future__ import annotations

import json

import pytest

from expresslane.__main__ import main

CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'  # noqa: E501


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_run_json_reports_acceptance_and_the_plain_tokens(random_laneformer_dir, capsys):
    argv = ["run", str(random_laneformer_dir), "--prompt", "def add(a, b):\n    return a + b\n"
            "def add(a, b):\n", "--max-tokens", "40", "--json"]  # fmt: skip
    plain = run_json(capsys, *argv)
    got = run_json(capsys, *argv, "--speculative-config", CONFIG)
    assert got["token_ids"] == plain["token_ids"] and got["text"] == plain["text"]
    fig = got["speculative"]
    assert "speculative" not in plain
    assert fig["verify_steps"] > 0 and fig["accepted_tokens"] > 0
    assert fig["mean_accepted_per_verify"] == round(fig["accepted_tokens"] / fig["verify_steps"], 4)


@pytest.mark.parametrize("command", ["run", "serve", "bench"])
@pytest.mark.parametrize(
    "value, names",
    [("{oops", "not valid JSON"), ('{"num_speculative_tokens": 99}', "num_speculative_tokens=99")],
)
def test_bad_config_exits_2_naming_it(command, value, names, capsys, random_laneformer_dir):
    argv = [command, str(random_laneformer_dir), "--speculative-config", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and names in err and len(err.strip().splitlines()) == 1


def test_parallel_engine_refuses_to_speculate(random_laneformer_dir, capsys):
    argv = ["run", str(random_laneformer_dir), "--devices", "2", "--speculative-config", CONFIG]
    assert main(argv) == 2
    assert "--devices" in capsys.readouterr().err
