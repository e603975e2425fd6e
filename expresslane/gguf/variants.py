"""SmolLM2 in every GGUF type, written by llama.cpp's own quantizer: the test files of issue 27.

The source is an F32 GGUF of the real SmolLM2-135M-Instruct. No F32 file is published where the
project fetches from, so it is made from the fetched Q4_1 file (expresslane/gguf/fetch.py): every
tensor dequantized by our reader (bit for bit gguf-py's dequantization) and written back with
gguf-py's GGUFWriter, metadata and tokenizer copied. That F32 file is then quantized into each type
of `TYPES` by `llama_cpp.llama_model_quantize` (llama-cpp-python), so the files are what
llama.cpp's `llama-quantize` writes, mixes included (Q4_K_M: Q4_K and Q6_K, with Q5_0/Q8_0 for
SmolLM2's 576-wide rows, which are not a multiple of 256; with llama-cpp-python 0.3.36, Q2_K and
Q3_K_* fall back to Q4_0 there (Q5_0 / Q5_1 for some of Q3_K_M's and Q3_K_L's), IQ4_XS and IQ3_S to
IQ4_NL, TQ* to Q4_0).

Q4_1 is the fetched file itself: llama.cpp's quantizer wrote it too, from the original weights.
Files live beside the model in the cache, written to a temporary name then renamed:

    path("Q4_K_M")   # -> $EXPRESSLANE_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_K_M.gguf
    ensure("Q4_K_M") # that path, made first if missing (needs llama_cpp for all but F32)

    python -m expresslane.gguf.variants [TYPE ...]   # makes them (all by default), prints paths
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .fetch import fetch_smollm2, smollm2_path
from .quants import raw_to_float
from .reader import read_header

# llama.cpp's llama_ftype numbers (include/llama.h): what `llama-quantize` names each mix.
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
          "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
          "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ3_XS": 22, "IQ3_XXS": 23,
          "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29,
          "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37, "MXFP4": 38,
          "NVFP4": 39, "Q1_0": 40}  # fmt: skip
# llama.cpp quantizes these only with an importance matrix (llama-imatrix's per-column mean
# square of a matrix's inputs). These files get one of ones, every column alike: they test
# reading llama.cpp's blocks, not a quality a calibrated matrix would give.
NEEDS_IMATRIX = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ1_S", "IQ1_M")
# Q2_K: SmolLM2's file holds Q3_K (llama.cpp's Q2_K mix puts ffn_down, the one matrix whose rows
# are a multiple of 256, in Q3_K) and no Q2_K; Q2_K_S, which would, needs an imatrix. "-pure"
# asks the quantizer for no mix (llama-quantize --pure): Q2_K-pure holds Q2_K in ffn_down.
# IQ3_M: IQ3_S in ffn_down; TQ2_0 / TQ1_0: ternary ffn_down, the other rows Q4_0 (SmolLM2 is not
# a ternary model: a test file, not a useful one); the IQ1-IQ3_XXS files: their type in ffn_down
# (IQ4_NL / Q4_0 elsewhere; the IQ2_S mix holds IQ2_XS there, IQ2_M holds IQ2_S), with the
# importance matrix of NEEDS_IMATRIX. MXFP4: every matrix, written by gguf-py's quantizer, as
# llama.cpp's (ftype 38, MXFP4_MOE) quantizes only a mixture of experts' experts to it. NVFP4 and
# Q1_0: llama_model_quantize refuses both here (0.3.36: "invalid output file type 39"; Q1_0 has no
# fallback for rows not a multiple of 128), so each matrix goes through ggml's own quantizer
# (ggml_quantize_chunk, the function llama-quantize calls): NVFP4 every matrix, Q1_0 ffn_down (the
# one matrix whose rows allow it) and Q4_0 elsewhere, as the TQ files' mix.
PURE = "-pure"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16",
         "Q2_K", "Q2_K-pure", "IQ4_NL", "IQ4_XS", "IQ3_M", "TQ2_0", "TQ1_0", "IQ3_XXS",
         "IQ2_XXS", "IQ2_XS", "IQ2_M", "IQ1_S", "IQ1_M", "MXFP4", "NVFP4", "Q1_0")  # fmt: skip
STEM = "SmolLM2-135M-Instruct"


def path(type_name: str, cache: Path | None = None) -> Path:
    """Where the SmolLM2 GGUF of `type_name` ("Q4_K_M", ..., or "F32") is cached."""
    if type_name.removesuffix(PURE) not in FTYPES:
        known = ", ".join(FTYPES)
        raise CheckpointError(f"no SmolLM2 variant {type_name!r}; known: {known} (each + {PURE})")
    fetched = smollm2_path(cache)
    return fetched if type_name == "Q4_1" else fetched.parent / f"{STEM}.{type_name}.gguf"


def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def ensure(type_name: str, cache: Path | None = None) -> Path:
    """The cached file of `type_name`, made (from the F32 file, made from Q4_1) if missing."""
    if type_name == "Q4_1":
        return fetch_smollm2(cache)
    out = path(type_name, cache)
    if out.is_file():
        return out
    if type_name == "F32":
        return _write_f32(fetch_smollm2(cache), out)
    if type_name in BY_MATRIX:
        return _write_f32(ensure("F32", cache), out, type_name)
    return quantize_file(ensure("F32", cache), out, type_name)


# the files written a matrix at a time: (matrix K -> its type, quantizer) per file type
BY_MATRIX = {
    "MXFP4": (lambda K: "MXFP4", "gguf-py"),
    "NVFP4": (lambda K: "NVFP4", "ggml"),
    "Q1_0": (lambda K: "Q1_0" if K % 128 == 0 else "Q4_0", "ggml"),
}


def _write_f32(src: Path, out: Path, file_type: str = "F32") -> Path:
    """Every tensor of `src` dequantized to F32 (file row order kept), metadata copied; for a
    `file_type` of BY_MATRIX, every matrix then quantized as it says (see TYPES' comment)."""
    import gguf

    pick, by = BY_MATRIX.get(file_type, (None, None))
    header = read_header(src)
    reader = gguf.GGUFReader(src)  # for the value types of the metadata, which ours drops
    with atomic_write(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), header.architecture)
        copy_metadata(reader, w)
        w.add_file_type(FTYPES[file_type])
        mats = {n: i.shape[-1] for n, i in header.tensors.items() if len(i.shape) == 2}
        types = {n: pick(K) for n, K in mats.items()} if pick else {}
        for name, info in header.tensors.items():
            if name in types:  # the byte shape: bytes a block per block
                rows, cols = info.shape
                qtype = gguf.GGMLQuantizationType[types[name]]
                bv, bb = gguf.GGML_QUANT_SIZES[qtype]
                w.add_tensor_info(name, (rows, cols // bv * bb), np.dtype(np.uint8),
                                  rows * cols // bv * bb, raw_dtype=qtype)  # fmt: skip
            else:
                n = 4 * int(np.prod(info.shape))
                w.add_tensor_info(name, info.shape, np.dtype(np.float32), n)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name in header.tensors:  # one tensor in memory at a time
            x = raw_to_float(header, name).numpy()
            if name in types:
                x = (_gguf_py_quantize if by == "gguf-py" else _ggml_quantize)(x, types[name])
            w.write_tensor_data(x)
        w.close()
    return out


def _gguf_py_quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x (rows, K) fp32 -> blocks by gguf-py's quantizer, in slices of rows (its temporaries
    are 64x)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return np.concatenate([gguf.quants.quantize(x[r : r + 2048], qtype)
                           for r in range(0, len(x), 2048)])  # fmt: skip


def _ggml_quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """x (rows, K) fp32 -> the blocks llama.cpp's quantizer writes (ggml_quantize_chunk, from
    llama-cpp-python's libggml-base), (rows, bytes a row) uint8."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    bv, bb = gguf.GGML_QUANT_SIZES[qtype]
    rows, K = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((rows, K // bv * bb), dtype=np.uint8)
    done = libggml().ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, K,
                                          None)  # fmt: skip
    if done != out.nbytes:
        raise CheckpointError(f"ggml_quantize_chunk({type_name}) wrote {done} of {out.nbytes} B")
    return out


def libggml():
    """llama-cpp-python's libggml-base (ctypes), its quantizer's argument types declared."""
    try:
        import llama_cpp
    except ImportError:
        raise CheckpointError(
            "making this SmolLM2 needs llama.cpp's quantizer: pip install llama-cpp-python"
        ) from None
    found = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-base.*"))
    if not found:
        raise CheckpointError("llama-cpp-python's libggml-base was not found beside it")
    lib = ctypes.CDLL(str(found[0]))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]  # fmt: skip
    return lib


_SKIPPED = ("general.architecture", "general.file_type", "general.alignment")


def copy_metadata(reader, w, rename: Callable[[str], str] = lambda name: name) -> None:
    """Every metadata field of a gguf-py reader into a writer, by `rename(name)`, with its value
    types; not the architecture, file type and alignment, which the writer sets."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in _SKIPPED:
            continue
        main, sub = field.types[0], field.types[-1] if len(field.types) > 1 else None
        w.add_key_value(rename(field.name), field.contents(), main, sub)


def quantize_file(src: Path, out: Path, type_name: str) -> Path:
    try:
        import llama_cpp
    except ImportError:
        raise CheckpointError(
            f"making the {type_name} SmolLM2 needs llama.cpp's quantizer: "
            "pip install llama-cpp-python"
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name.removesuffix(PURE)]
    params.pure = type_name.endswith(PURE)
    params.nthread = os.cpu_count() or 1
    if type_name.removesuffix(PURE) in NEEDS_IMATRIX:
        entries, keep = _ones_imatrix(src, llama_cpp)
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
    with atomic_write(out) as tmp:
        rc = llama_cpp.llama_model_quantize(
            str(src).encode(), str(tmp).encode(), ctypes.byref(params)
        )
        if rc != 0:
            raise CheckpointError(f"llama_model_quantize({src.name} -> {type_name}) failed: {rc}")
    return out


def _ones_imatrix(src: Path, llama_cpp):
    """An importance matrix of ones for every matrix of `src`, as llama.cpp's C API takes it (an
    array of (name, data, size) ended by a null name), and the buffers it points into."""
    header = read_header(src)
    names = [n for n, info in header.tensors.items() if len(info.shape) == 2]
    entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
    keep = []
    for i, name in enumerate(names):
        cols = header.tensors[name].shape[-1]
        ones = (ctypes.c_float * cols)(*([1.0] * cols))
        keep += [ones, name.encode()]
        entries[i].name, entries[i].data, entries[i].size = keep[-1], ones, cols
    return entries, keep


class atomic_write:
    """A temporary name beside `out`, renamed to `out` on success, removed on failure."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.out.parent, prefix=f".{self.out.name}.")
        os.close(fd)
        self.tmp = Path(name)
        return self.tmp

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            os.chmod(self.tmp, 0o644)  # mkstemp's 0600 would hide it from other users
            os.replace(self.tmp, self.out)
        else:
            self.tmp.unlink(missing_ok=True)


def print_made(make, names: list[str]) -> int:
    """`make(name)` for each name, its path printed; exit status 2 with one line on an error."""
    try:
        for t in names:
            print(make(t))
    except CheckpointError as e:
        print(f"expresslane: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    return print_made(ensure, argv or ["F32", *TYPES])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
