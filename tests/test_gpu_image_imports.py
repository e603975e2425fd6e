"""What the GPU stages run works on an image without the serving stack or gguf.

The GPU image has no fastapi, uvicorn, pydantic or gguf (the first GPU run's bench stages died
in 2 seconds on `ModuleNotFoundError: fastapi`, through the `serve` parser). Here every GPU
entry point runs in a subprocess whose `sitecustomize` makes importing those modules raise:
`expresslane bench --help` and a tiny CPU bench, `run`, `smoke --dry-run`, `launches`,
`ceiling`, and the imports of the kernels' ahead-of-time compiler, profiler and kernel bench.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("fastapi", "uvicorn", "pydantic", "gguf", "starlette")

SITECUSTOMIZE = f"""
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"{{name}} is not on the GPU image", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
"""

# Every entry point in one process (one torch import); each returns 0 or the script fails.
ENTRY_POINTS = """
import contextlib, io, sys
from expresslane.__main__ import main as cli
from expresslane.bench import launches, smoke

def quiet(fn, *argv):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = fn(list(argv))
    except SystemExit as e:  # --help
        rc = e.code
    assert rc == 0, (fn, argv, rc, out.getvalue()[-2000:])
    return out.getvalue()

quiet(cli, "bench", "--help")
quiet(cli, "serve", "--help")  # the parser the bench stages build too
assert '"rows"' in quiet(cli, "bench", "--preset", "llama-tiny", "--contexts", "16",
                         "--decode-tokens", "2", "--device", "cpu", "--dtype", "float32",
                         "--kernels", "off", "--threads", "1", "--no-peer")
quiet(cli, "run", "--prompt", "def f(", "--max-tokens", "3", "--device", "cpu",
      "--temperature", "0.8", "--top-p", "0.9", "--seed", "1")
assert '"ok": true' in quiet(smoke.main, "--dry-run")
quiet(launches.main, "--model", "laneformer-tiny", "--context", "64")
quiet(cli, "ceiling", "--model", "laneformer-2b")
import expresslane.bench.kernels, expresslane.bench.profile, expresslane.kernels.aot  # noqa
import expresslane.bench.session, expresslane.step.graph, expresslane.step.fused  # noqa
import expresslane.bench.persistent, expresslane.step.persistent, expresslane.bench.barrier  # noqa
import expresslane.bench.free_grammar, expresslane.bench.structured  # noqa: the grammar stages
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})
assert not loaded, loaded
print("entry points ok")
"""


def blocked_python(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)  # fmt: skip


@pytest.fixture(scope="module")
def blocker_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_image")


def test_the_blocker_blocks(blocker_dir):
    """The control: under the hook the server itself cannot be imported."""
    proc = blocked_python(blocker_dir, "import expresslane.serve.server")
    assert proc.returncode != 0 and "fastapi is not on the GPU image" in proc.stderr


def test_gpu_entry_points_import_no_serving_stack(blocker_dir):
    code = textwrap.dedent(ENTRY_POINTS).replace("{blocked!r}", repr(BLOCKED))
    proc = blocked_python(blocker_dir, code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("entry points ok")
