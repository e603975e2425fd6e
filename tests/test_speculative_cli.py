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


def test_bench_rows_compare_plain_and_speculative(random_laneformer_dir):
    from dataclasses import replace

    from expresslane.bench.spec_workloads import MERGE, Workload
    from expresslane.bench.speculative import prompt_ids, run_speculative_bench, spec_table
    from expresslane.checkpoint import load_model
    from expresslane.engine import Engine
    from expresslane.sampling.params import SamplingParams
    from expresslane.speculative.drafting import SpeculativeConfig
    from expresslane.tokenizer import Tokenizer

    model = load_model(random_laneformer_dir, device="cpu", dtype="float32", progress=False)
    tok = Tokenizer.from_dir(random_laneformer_dir)
    copy = Workload("copy", "edit", f"Reprint:\n{MERGE}", 24)
    # its prediction: the random model's own answer (the bench's edits predict the file)
    ids = prompt_ids(tok, copy)
    answer = tok.decode(list(Engine(model).generate(ids, SamplingParams(max_tokens=24))))
    work = (replace(copy, prediction=answer), Workload("free", "free", "hi", 24))
    rows, by_kind, cost = run_speculative_bench(
        model, tok, SpeculativeConfig(4, 3, 1), workloads=work, decode="graph"
    )  # as `run` builds the engines on a CPU: the packed step, the packed verify
    assert [r["workload"] for r in rows] == ["copy", "free"]
    for r in rows:
        assert r["identical"] and r["tokens"] > 1
        assert r["speedup"] == r["spec_tok_s"] / r["plain_tok_s"]
        assert r["draft_tokens"] >= r["accepted_tokens"] >= 0
    copy, free = rows
    assert copy["pred_identical"] and "pred_tok_s" not in free  # a prediction where one is given
    assert copy["pred_speedup"] == copy["pred_tok_s"] / copy["plain_tok_s"]
    assert copy["accepted_prediction_tokens"] + copy["rejected_prediction_tokens"] > 0
    assert set(by_kind) == {"edit", "free"} and "pred_speedup" in by_kind["edit"]
    assert cost["path"].startswith("packed") and cost["rows"] == [1, 2, 3, 4, 5]  # one step
    assert len(cost["relative"]) == 5 and all(r > 0 for r in cost["relative"])
    text = spec_table(rows, by_kind, cost)
    assert "copy" in text and "geometric mean speedup: edit" in text and "per extra row" in text


def test_bench_needs_a_tokenizer_for_its_text_workloads(capsys):
    assert main(["bench", "--preset", "llama-tiny", "--speculative-config", CONFIG]) == 2
    assert "checkpoint folder with a tokenizer" in capsys.readouterr().err


def test_bench_quantization_belongs_to_the_speculative_bench(capsys):
    assert main(["bench", "--preset", "llama-tiny", "--quantization", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--quantization" in err and "--speculative-config" in err
