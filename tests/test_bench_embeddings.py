"""bench/embeddings.py: one table, then a JSON line whose rows time both ways; a missing model
exits 2 with its message."""

from __future__ import annotations

import json

from expresslane.bench import embeddings


def test_rows_and_json(random_laneformer_dir, capsys):
    args = [str(random_laneformer_dir), "--lengths", "3", "9", "--repeats", "1"]
    assert embeddings.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert [r["tokens"] for r in report["rows"]] == [3, 9]
    for r in report["rows"]:
        assert r["embedding_ms"] > 0 and r["prefill_ms"] > 0
        assert abs(r["ratio"] - r["embedding_ms"] / r["prefill_ms"]) < 1e-9
    assert out[0].split()[0] == "tokens"


def test_missing_model_exits_2(tmp_path, capsys):
    assert embeddings.main([str(tmp_path / "none"), "--lengths", "4"]) == 2
    assert "none" in capsys.readouterr().err
