"""bench/auto_tools.py's request against a real uvicorn: an `auto` answer's figures, each call
it returns valid against its tool's schema; its main exits 2 on bad arguments."""

from __future__ import annotations

from serverkit import NAME

from expresslane.bench import auto_tools


def test_an_auto_request_reports_its_answer(server):
    rows = [auto_tools.ask(server.url, q, 24, 0.9, seed, model=NAME)
            for q in auto_tools.ASKS[:2] for seed in range(2)]  # fmt: skip
    for r in rows:
        assert r["tps"] > 0 and 1 <= r["tokens"] <= 24 and len(r["hash"]) == 12
        assert r["valid"] and r["finish"] in ("stop", "length", "tool_calls")
        assert r["calls"] == 0 or r["opened"]


def test_bad_arguments_exit_2(capsys):
    assert auto_tools.main(["--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
