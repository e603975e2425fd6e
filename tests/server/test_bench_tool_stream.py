"""bench/tool_stream.py's request against a real uvicorn: a forced call's figures in order, its
arguments joined into an object; its main exits 2 on bad arguments."""

from __future__ import annotations

from serverkit import NAME

from expresslane.bench import tool_stream


def test_a_forced_call_streams_its_arguments(server):
    row = tool_stream.streamed_call(server.url, 60, model=NAME)
    # pieces: as many as the stream's chunks cut the arguments into (1 when they all come in one)
    assert row["finish"] in ("tool_calls", "length") and row["pieces"] >= 1
    assert row["chunk"] <= row["call"] <= row["args"] <= row["last"]
    assert row["parses"] or row["finish"] == "length"  # a call cut short stays as sent


def test_bad_arguments_exit_2(capsys):
    assert tool_stream.main(["--max-tokens", "2"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
