"""The speculative replay (bench/spec_replay.py): recorded acceptance times measured step costs.

The arithmetic against a hand count, the rows found wherever a bench's JSON line holds them,
the committed trace readable, and a dry run of the whole command on the CPU (a tiny preset's
packed step: the same DecodeGraph widths the GPU times)."""

from __future__ import annotations

import json

import pytest

from expresslane.bench import spec_replay


def test_replay_counts_plain_tokens_and_verify_steps():
    rows = [{"workload": "w", "kind": "edit", "tokens": 11, "verify_steps": 2,
             "accepted_tokens": 6}]  # fmt: skip
    (r,) = spec_replay.replay(rows, t1=1.0, tv=1.5)
    # 10 decoded: 2 verifies give 2 + 6 tokens, 2 plain steps; 2 * 1.0 + 2 * 1.5 = 5.0 ms
    assert (r["decoded"], r["verify_steps"], r["kept"]) == (10, 2, 6)
    assert r["speedup"] == pytest.approx(10 / 5.0)
    (free,) = spec_replay.replay([{**rows[0], "verify_steps": 0, "accepted_tokens": 0}], 1.0, 9.0)
    assert free["speedup"] == pytest.approx(1.0)  # no drafts: plain steps only
    kinds = spec_replay.by_kind([r, {**r, "speedup": 8.0}])
    assert kinds["edit"] == pytest.approx(4.0)  # geometric mean of 2 and 8


def test_rows_are_found_anywhere_in_the_json_line():
    row = {"workload": "a", "kind": "free", "tokens": 5, "verify_steps": 1, "accepted_tokens": 0}
    line = {"bench": "x", "speculative": {"rows": [row, {**row, "workload": "b"}]}, "other": [1]}
    assert [r["workload"] for r in spec_replay.trace_rows(line)] == ["a", "b"]
    assert spec_replay.trace_rows({"rows": [{"engine": "no"}]}) == []


def test_the_committed_trace_has_every_kind():
    line = spec_replay.DEFAULT_TRACE.read_text().strip().splitlines()[-1]
    rows = spec_replay.trace_rows(json.loads(line))
    assert {r["kind"] for r in rows} == {"edit", "quote", "free"}
    assert all(r["identical"] for r in rows)  # greedy speculation kept the plain output


def test_dry_run_prints_the_table_then_one_json_line(capsys, tmp_path):
    assert spec_replay.main(["--dry-run", "--k", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert res["bench"] == "spec_replay" and set(res["verify_ms"]) == {"2", "3", "4"}
    assert all(r["speedup"] and r["speedup"] > 0 for r in res["rows"])
    bad = tmp_path / "t.json"
    bad.write_text('{"rows": []}\n')
    assert spec_replay.main(["--dry-run", "--trace", str(bad)]) == 2


def test_bad_arguments_exit_2_naming_the_problem(capsys):
    from expresslane.bench import structured, ttft

    for main, argv, word in [
        (spec_replay.main, ["--preset", "no-such-preset"], "no-such-preset"),
        (spec_replay.main, ["--reps", "0"], "--reps"),
        (structured.main, ["--preset", "no-such-preset"], "no-such-preset"),
        (structured.main, ["--schemas", "0"], "--schemas"),
        (ttft.main, ["--preset", "no-such-preset", "--no-peer"], "no-such-preset"),
    ]:
        assert main(argv) == 2, argv
        assert word in capsys.readouterr().err, argv
