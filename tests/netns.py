"""Hosts for tests: network namespaces from scripts/netns.sh, and processes started inside them.

`Hosts.make(n)` runs `scripts/netns.sh up n` under a name of its own (concurrent sessions do
not collide) and says why when it cannot (not root, no iproute2, no namespaces in this
container): the caller skips with that reason. `close()` (also at exit) runs `down`, which
kills what still runs inside and deletes the namespaces.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns.sh"


class Hosts:
    def __init__(self, name: str, n: int):
        self.name, self.n = name, n
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
        }
        self.env.pop("GLOO_SOCKET_IFNAME", None)  # the code under test picks the interface

    @classmethod
    def make(cls, n: int) -> tuple[Hosts | None, str]:
        """(hosts, "") or (None, why they cannot be made here)."""
        name = f"elt{os.getpid() % 100000}"
        try:
            got = subprocess.run(
                ["bash", str(SCRIPT), "up", str(n), "--name", name],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"scripts/netns.sh up {n}: {e}"
        if got.returncode != 0:
            return None, f"scripts/netns.sh up {n} failed: {got.stderr.strip()}"
        hosts = cls(name, n)
        atexit.register(hosts.close)
        return hosts, ""

    def addr(self, i: int) -> str:
        return f"10.77.0.{i + 1}"

    def argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", f"{self.name}{i}", *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw["env"] = {**self.env, **kw.get("env", {})}
        return subprocess.Popen(self.argv(i, argv), text=True, **kw)

    def python(self, i: int, *args: str, **kw) -> subprocess.Popen:
        return self.popen(i, [sys.executable, *args], **kw)

    def shape(self, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(SCRIPT), "shape", "--name", self.name, *flags],
            capture_output=True,
            text=True,
        )

    def close(self) -> None:
        subprocess.run(["bash", str(SCRIPT), "down", "--name", self.name], capture_output=True)
