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
from . import MAGIC, SPLIT_NAME

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
    offset: int  # absolute, in bytes from the start of its file
    nbytes: int
    file: Path  # the part of a split model that holds it (else the one file)

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
        """The tensor's bytes as stored (quantized blocks included), writable, read from the file
        only where touched: a copy-on-write map (a write stays in this process), unmapped when
        the last array over it goes. The packer copies them once, into its arena."""
        info = self.tensors[name]
        start = info.offset - info.offset % mmap.ALLOCATIONGRANULARITY  # the tensor's pages only
        with open(info.file, "rb") as f:  # (a private map is charged as memory: not the file)
            if info.offset + info.nbytes > os.fstat(f.fileno()).st_size:
                raise CheckpointError(f"{info.file}: truncated inside tensor {name}")
            if info.nbytes == 0:
                return np.zeros(0, np.uint8)
            mm = mmap.mmap(f.fileno(), info.offset + info.nbytes - start,
                           access=mmap.ACCESS_COPY, offset=start)  # fmt: skip
        return np.frombuffer(mm, np.uint8, info.nbytes, info.offset - start)


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of a GGUF model: one file's, or a split model's parts read as one."""
    header = read_file_header(path)
    count = header.get(SPLIT_COUNT) or 1
    return header if count <= 1 else _merge_parts(header, count)


def read_file_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse one GGUF file's header (cached per file, size and modification time)."""
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


_U64 = struct.Struct("<Q")


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

    def _strings(self, n: int) -> list[str]:
        """n strings in one loop: SmolLM2's header (49,152 tokens, 48,900 merges) in 0.03-0.06 s,
        against 0.09-0.12 s a string at a time through _string."""
        buf, pos, end, length, out = self.buf, self.pos, len(self.buf), _U64.unpack_from, []
        for _ in range(n):
            k = length(buf, pos)[0]
            pos += 8
            if pos + k > end:
                raise ValueError(f"a string of {k} bytes runs past the end at byte {pos}")
            out.append(buf[pos : pos + k].decode("utf-8"))
            pos += k
        self.pos = pos
        return out

    def _value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            etype, n = self._unpack("<I"), self._unpack("<Q")
            if etype == GGUFValueType.STRING:  # a vocabulary: tens of thousands
                return self._strings(n)
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
            info = TensorInfo(name, ggml_type, shape, data_offset + rel, nbytes, self.path)
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


SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def split_part_paths(path: Path, count: int) -> list[Path]:
    """The file names of all `count` parts of the split model that `path` is one part of."""
    m = SPLIT_NAME.fullmatch(path.name)
    if m is None or int(m["count"]) != count:
        raise CheckpointError(
            f"{path}: one part of a GGUF split into {count} files, but its name does not end in "
            f"-NNNNN-of-{count:05d}.gguf, so the other parts cannot be found"
        )
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _merge_parts(given: GGUFHeader, count: int) -> GGUFHeader:
    """One header for a split model: part 1's metadata, every part's tensors."""
    paths = split_part_paths(given.path, count)
    tensors: dict[str, TensorInfo] = {}
    for no, p in enumerate(paths):
        if not p.is_file():
            raise CheckpointError(f"{given.path}: part {no + 1} of {count} is missing: {p}")
        part = read_file_header(p)
        if (part.get(SPLIT_NO), part.get(SPLIT_COUNT)) != (no, count):
            raise CheckpointError(
                f"{p}: says it is part {part.get(SPLIT_NO, 0) + 1} of {part.get(SPLIT_COUNT, 1)}, "
                f"expected part {no + 1} of {count}"
            )
        for name, info in part.tensors.items():
            if name in tensors:
                raise CheckpointError(f"{p}: tensor {name} is also in {tensors[name].file.name}")
            tensors[name] = info
    first = read_file_header(paths[0])
    expected = first.get(SPLIT_TENSORS)
    if expected is not None and expected != len(tensors):
        raise CheckpointError(
            f"{first.path}: the {count} parts hold {len(tensors)} tensors; "
            f"{SPLIT_TENSORS} says {expected}"
        )
    return GGUFHeader(first.path, first.version, first.metadata, tensors, first.data_offset)
