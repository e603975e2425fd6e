"""GGUF checkpoints (llama.cpp's format): header, dequantization, config, tensors by HF key.

`find_gguf(path)` says whether a model path means a GGUF file: a file with the GGUF magic or a
`.gguf` name, or a folder with no safetensors that holds exactly one `.gguf` (or the parts of one
split model, `name-00001-of-0000N.gguf` ...). checkpoint.py then
reads it through `GGUFCheckpoint` (expresslane/gguf/tensors.py) and `model_config`
(expresslane/gguf/config.py); the tokenizer comes from expresslane/tokenizer/gguf.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError

MAGIC = b"GGUF"
SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def is_gguf_file(path: Path) -> bool:
    """True for a file that starts with the GGUF magic (whatever its name)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` stands for, or None when it is something else."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" or is_gguf_file(path) else None
    if not path.is_dir() or any(path.glob("*.safetensors")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1 and _one_split_model(found):
        return found[0]  # part 1 of 0000N; the reader gathers the rest
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise CheckpointError(
            f"{path}: holds {len(found)} GGUF files ({names}); give the path of the one to load"
        )
    return found[0] if found else None


def _one_split_model(files: list[Path]) -> bool:
    """True when the sorted `files` are exactly parts 1..N of one `stem-0000k-of-0000N.gguf`."""
    names = [SPLIT_NAME.fullmatch(p.name) for p in files]
    if not all(names) or len({(m["stem"], m["count"]) for m in names}) != 1:
        return False
    return [int(m["no"]) for m in names] == list(range(1, int(names[0]["count"]) + 1))
