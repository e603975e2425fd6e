"""Hosts for tests: network namespaces from scripts/netns.sh, and processes started inside them.

`Hosts.make(n)` runs `scripts/netns.sh up n` under a name of its own (concurrent sessions do
not collide) and says why when it cannot (not root, no iproute2, no namespaces in this
container): the caller skips with that reason. `close()` (also at exit) runs `down`, which
kills what still runs inside and deletes the namespaces; sets left by a killed session are
removed at the next one. GLOO_SOCKET_IFNAME is unset inside: the code under test picks the
interface (in a namespace the hostname resolves to 127.0.0.1, as on many real hosts).
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "netns.sh"


def _remove_stale() -> None:
    """Sets left by a test session that was killed (its pid is gone): `down` them."""
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except OSError:
        return
    for pid in {m.group(1) for m in re.finditer(r"^elt(\d+)hsw\b", names, re.M)}:
        if not Path(f"/proc/{pid}").exists():
            down = ["bash", str(SCRIPT), "down", "--name", f"elt{pid}h"]
            subprocess.run(down, capture_output=True)


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
        _remove_stale()
        name = f"elt{os.getpid()}h"
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
