"""bench/sampling.py: every sampler and every fast piece beside its reference, timed per scale;
bad flags and an absent device exit 2."""

from __future__ import annotations

import json

import pytest

from expresslane.bench import sampling

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: restores the thread count


def test_every_case_is_timed_at_every_scale(capsys):
    argv = ["--vocab", "512", "--scale", "6", "1", "--repeats", "2", "--threads", "1"]
    assert sampling.main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cases = [r["case"] for r in line["rows"] if r["scale"] == 6]
    assert len(cases) == len(set(cases)) == len(sampling.SAMPLERS) + 8
    assert all(r["us"] > 0 for r in line["rows"]) and len(line["rows"]) == 2 * len(cases)


def test_bad_flags_exit_2(capsys):
    assert sampling.main(["--vocab", "8"]) == 2
    assert "--vocab" in capsys.readouterr().err
    assert sampling.main(["--device", "nosuchdevice"]) == 2
    assert "nosuchdevice" in capsys.readouterr().err
