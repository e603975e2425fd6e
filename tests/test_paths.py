"""Docs and commands name no absolute path of the machine that wrote them (issue 28).

BENCHMARKS.md's commands and scripts/serve_health.py once named a models folder that existed
only on the measuring machine. Every tracked doc, script, build file and module of the package
is read; a path under /work, /root, /home/USER, /Users/USER or /tmp/NAME fails the test, naming
the file and line. Readers resolve names instead: `org/name` from the Hub,
`"$(expresslane fetch smollm2)"`, `~/.cache/expresslane` or `$EXPRESSLANE_CACHE`.
Tests are not read (a sandbox test writes to /tmp on purpose), nor data files (the embedded
model's manifest records where its corpus was read).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MACHINE_PATH = re.compile(
    r"(?<![\w.~$/-])/(?:work|root|home/[\w.-]+|Users/[\w.-]+|tmp/[\w.-]+)(?=/|\b)"
)
READ = re.compile(r"(\.(md|txt|py|sh|cfg|toml|ini|yml|yaml|jinja|html|js|css)|Makefile|\.ci/.*)$")
SKIPPED = ("tests/", "expresslane/assets/")


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.splitlines() if READ.search(f) and not f.startswith(SKIPPED)]


def machine_paths(name: str, text: str) -> list[str]:
    """`file:line: text` for every line of `text` that names an absolute machine path."""
    return [
        f"{name}:{n}: {line.strip()}"
        for n, line in enumerate(text.splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]


def test_the_pattern_finds_machine_paths_and_spares_names():
    found = machine_paths("x.md", "a /work/models/smollm2-hf b\n/root/.cache/x\nok\n")
    assert found == ["x.md:1: a /work/models/smollm2-hf b", "x.md:2: /root/.cache/x"]
    for text in ("/home/alice/m.gguf", "/Users/bob/m", "cp a /tmp/expresslane-run/x"):
        assert machine_paths("f", text), text
    for text in ("~/.cache/expresslane", "$EXPRESSLANE_CACHE/smollm2", "org/work/x",
                 "https://example.com/root/x", "HuggingFaceTB/SmolLM2-135M-Instruct", "/tmp",
                 '"$(expresslane fetch smollm2)"', "a/home/b", "/homework"):  # fmt: skip
        assert not machine_paths("f", text), text


def test_docs_and_commands_name_no_machine_path():
    found = []
    for name in tracked_files():
        path = ROOT / name
        if path.is_file():
            found += machine_paths(name, path.read_text(encoding="utf-8", errors="replace"))
    assert not found, "absolute paths of one machine (use names a reader can resolve):\n" + (
        "\n".join(found)
    )
