"""GGUF checkpoints (llama.cpp's format): header, dequantization, config, tensors by HF key.

`find_gguf(path)` says whether a model path means a GGUF file: a file with the GGUF magic or a
`.gguf` name, or a folder with no safetensors that holds exactly one `.gguf`. checkpoint.py then
reads it through `GGUFCheckpoint` (expresslane/gguf/tensors.py) and `model_config`
(expresslane/gguf/config.py); the tokenizer comes from expresslane/tokenizer/gguf.py.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError

MAGIC = b"GGUF"


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
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise CheckpointError(
            f"{path}: holds {len(found)} GGUF files ({names}); give the path of the one to load"
        )
    return found[0] if found else None
