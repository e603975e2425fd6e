"""bench/load.py: a GGUF file to its first token in fresh processes, timed, with the peak memory
of each; bad flags exit 2."""

from __future__ import annotations

import importlib.util
import json

import pytest

from expresslane.assets import TRAINED
from expresslane.bench.load import main
from expresslane.gguf.write import write_laneformer


def test_a_round_in_a_fresh_process(tmp_path, capsys):
    path = write_laneformer(TRAINED, tmp_path / "lf.gguf", "Q8_0")
    peer = importlib.util.find_spec("llama_cpp") is not None
    assert (
        main([str(path), "--repeats", "1", "--threads", "1", *([] if peer else ["--no-peer"])]) == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    row = json.loads(out[-1])["rows"][0]
    assert row["file"] == "lf.gguf" and out[0].startswith("| file |")
    assert row["ours"]["seconds"] > 0 and row["ours"]["peak_mb"] > 0
    if peer:  # llama.cpp has no Laneformer: its cell says why, the bench goes on
        assert "error" in row["llama.cpp"]


@pytest.mark.parametrize(
    "args,says",
    [(["nope.gguf"], "nope.gguf: no such file"), (["--repeats", "0"], "at least 1"),
     (["--checkout", "/"], "no expresslane package")],
)  # fmt: skip
def test_bad_flags_exit_2(tmp_path, capsys, args, says):
    real = tmp_path / "m.gguf"
    real.write_bytes(b"")
    argv = args if args[0].endswith(".gguf") else [str(real), *args]
    assert main(argv) == 2
    assert says in capsys.readouterr().err
