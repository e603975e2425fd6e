"""bench/serve_decode.py: the server timed alone and beside a spinning neighbour, with its own
thread count and with --threads fixed, against `run`; one table, then a JSON line. Bad
arguments and a missing model exit 2."""

from __future__ import annotations

import json

from expresslane.bench import serve_decode


def test_rows_and_json(random_laneformer_dir, capsys):
    args = [str(random_laneformer_dir), "--tokens", "4", "--repeats", "1"]
    assert serve_decode.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    fixed = f"serve --threads {report['cores']}"
    assert set(report) >= {"serve", fixed, "run"}
    for way in ("serve", fixed):
        for phase in ("alone", "busy"):
            row = report[way][phase]
            assert row["median"] >= row["min"] > 0 and row["threads"], (way, phase)
    assert report[fixed]["alone"]["threads"] == [report["cores"]]  # --threads is kept
    assert report["run"]["alone"]["min"] > 0 and out[0].startswith("| way |")


def test_bad_arguments_and_a_missing_model_exit_2(tmp_path, capsys):
    assert serve_decode.main(["--tokens", "1"]) == 2
    assert serve_decode.main([str(tmp_path / "none"), "--tokens", "4", "--repeats", "1"]) == 2
    assert "none" in capsys.readouterr().err
