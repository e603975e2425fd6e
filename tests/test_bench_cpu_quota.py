"""bench/cpu_quota.py: a cgroup with a CPU quota, `run` timed in it and outside it with its own
thread count and with --threads fixed; one table, then a JSON line. A run in a real quota picks
no more threads than the quota (root only); without the rights to make a cgroup it exits 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from expresslane.bench import cpu_quota
from expresslane.step import threads


def test_a_quota_cgroup_is_written_read_back_and_removed(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpu\n")  # a cgroup v2 mount
    monkeypatch.setattr(cpu_quota, "CGROUP", str(tmp_path))
    monkeypatch.setattr(cpu_quota, "remove_cgroup", shutil.rmtree)  # a real one's files go too
    with cpu_quota.quota_cgroup(1.5) as enter:
        (made,) = [p for p in tmp_path.iterdir() if p.is_dir()]
        enter()
        assert (made / "cgroup.procs").read_text() == str(os.getpid())
        (tmp_path / "self").write_text(f"0::/{made.name}\n")
        assert threads.cpu_quota(str(tmp_path), str(tmp_path / "self")) == 1.5
    assert not made.exists()


def test_rows_and_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "cpu").mkdir()  # a cgroup v1 mount
    monkeypatch.setattr(cpu_quota, "CGROUP", str(tmp_path))
    monkeypatch.setattr(cpu_quota, "remove_cgroup", shutil.rmtree)
    monkeypatch.setattr(cpu_quota, "usable_cores", lambda: 4)
    seen = []

    def fake_run(model, tokens, flags=(), preexec=None):
        seen.append((flags, preexec is not None))
        return {"tokens_per_s": 10.0 + len(seen), "threads": int(flags[1]) if flags else 4}

    monkeypatch.setattr(cpu_quota, "run_decode", fake_run)
    assert cpu_quota.main(["m", "--quota", "2", "--tokens", "4", "--repeats", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert [k for k in report if k.startswith(("default", "--"))] == [
        "default", "--threads 4", "--threads 2"]  # fmt: skip
    assert report["--threads 2"]["quota"]["threads"] == [2]
    assert [q for _, q in seen] == [True] * 6 + [False] * 6  # in the cgroup, then outside it
    assert out[0].startswith("| threads | quota 2 cores") and not list((tmp_path / "cpu").iterdir())


def test_without_rights_to_a_cgroup_it_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_quota, "CGROUP", str(tmp_path / "absent"))
    assert cpu_quota.main(["m", "--tokens", "4", "--repeats", "1"]) == 2
    assert "cannot create a cgroup" in capsys.readouterr().err
    assert cpu_quota.main(["m", "--quota", "0"]) == 2


def _can_make_cgroups() -> bool:
    try:
        with cpu_quota.quota_cgroup(1.0):
            return True
    except Exception:
        return False


@pytest.mark.skipif(threads.usable_cores() < 2 or not _can_make_cgroups(),
                    reason="needs 2 cores and the rights to make a cgroup (root)")  # fmt: skip
def test_a_process_in_a_one_core_quota_may_use_one_core():
    code = "from expresslane.step.threads import usable_cores; print(usable_cores())"
    with cpu_quota.quota_cgroup(1.0) as enter:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             preexec_fn=enter, check=True)  # fmt: skip
    assert int(out.stdout) == 1  # the tiny model takes 1 thread anyway: ask for the cores
