"""GGUF files: the header (metadata and tensor table) and each tensor's raw bytes.

The layout is llama.cpp's GGUF v2/v3, little-endian: magic, version, counts, key/value metadata,
tensor infos, then aligned tensor data. Value and tensor type codes and block sizes come from the
`gguf` package (llama.cpp's own Python package). The header is parsed here rather than with
`gguf.GGUFReader`, which builds a numpy view per array element: seconds for a 49k-token
vocabulary, against a tenth of one here. tests/test_gguf_quants.py checks this parser field for
field against GGUFReader. Every problem with a file is a CheckpointError naming the file and
what was wrong.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from ..errors import CheckpointError
from . import MAGIC

VERSIONS = (2, 3)
_SCALARS = {  # value type -> struct format (little-endian)
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {t: np.dtype(f) for t, f in _SCALARS.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. `shape` is in torch order (rows first), GGUF's reversed."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name


# The end-of-generation markers llama.cpp recognises by their text (llama-vocab.cpp)
EOG_TOKENS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>",
                        "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
                        "<|end_of_text|>", "<end_of_utterance>"})  # fmt: skip


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: metadata has no general.architecture string")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def end_of_generation_ids(self) -> list[int]:
        """Every id that ends generation, as llama.cpp reads them: EOS, EOT and EOM from the
        metadata, then any token spelled as a known end marker (SmolLM2's GGUF names only
        <|im_end|>, yet its <|endoftext|> ends a text as well)."""
        declared = [self.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        ids = [int(i) for i in declared if i is not None]
        tokens = self.get("tokenizer.ggml.tokens") or []
        ids += [i for i, t in enumerate(tokens) if t in EOG_TOKENS]
        return list(dict.fromkeys(ids))

    def raw_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored (quantized blocks included), as a writable uint8 copy."""
        info = self.tensors[name]
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if info.offset + info.nbytes > len(mm):
                raise CheckpointError(f"{self.path}: truncated inside tensor {name}")
            return np.frombuffer(mm, np.uint8, info.nbytes, info.offset).copy()


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse a GGUF file's header (cached per file, size and modification time)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    return _read_header(p, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=8)
def _read_header(path: Path, size: int, mtime_ns: int) -> GGUFHeader:
    if size < 24:
        raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes, no header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != MAGIC:
            raise CheckpointError(
                f"{path}: not a GGUF file (magic {bytes(mm[:4])!r}, expected {MAGIC!r})"
            )
        try:
            return _Parser(path, mm).header()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: truncated or corrupt GGUF header ({e})") from None


class _Parser:
    """Sequential reads from the mapped file; any read past the end raises struct.error."""

    def __init__(self, path: Path, buf):
        self.path, self.buf, self.pos = path, buf, 4

    def _unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end at byte {self.pos}")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = self._unpack("<I"), self._unpack("<Q")
            if etype in _NUMPY:  # numbers in one read
                dt = _NUMPY[GGUFValueType(etype)]
                if self.pos + n * dt.itemsize > len(self.buf):
                    raise ValueError(f"an array of {n} values runs past the end")
                arr = np.frombuffer(self.buf, dt, n, self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype} at byte {self.pos}")
        return self._unpack(_SCALARS[GGUFValueType(vtype)])

    def header(self) -> GGUFHeader:
        version = self._unpack("<I")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            why = "a big-endian file" if swapped in VERSIONS else f"version {version}"
            raise CheckpointError(
                f"{self.path}: unsupported GGUF {why}; expected little-endian version 2 or 3"
            )
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        data_offset = -(-self.pos // align) * align
        tensors = {}
        for name, ggml_type, shape, rel in infos:
            nbytes = _nbytes(self.path, name, ggml_type, shape)
            info = TensorInfo(name, ggml_type, shape, data_offset + rel, nbytes)
            if info.offset + nbytes > len(self.buf):
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {name} ends at byte {info.offset + nbytes}, "
                    f"the file has {len(self.buf)} bytes"
                )
            tensors[name] = info
        return GGUFHeader(self.path, version, metadata, tensors, data_offset)

    def _tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._string()
        n_dims = self._unpack("<I")
        if n_dims > 8:
            raise ValueError(f"tensor {name} claims {n_dims} dimensions")
        dims = [self._unpack("<Q") for _ in range(n_dims)]
        ggml_type, offset = self._unpack("<I"), self._unpack("<Q")
        return name, ggml_type, tuple(reversed(dims)), offset


def _nbytes(path: Path, name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise CheckpointError(
            f"{path}: tensor {name} has unknown GGML type id {ggml_type}"
        ) from None
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape)) if shape else 1
    if shape and shape[-1] % block:
        raise CheckpointError(
            f"{path}: tensor {name} ({qtype.name}) has rows of {shape[-1]} values, "
            f"not a multiple of its block size {block}"
        )
    return n // block * type_size
