"""Write a Laneformer checkpoint as a GGUF file (the `laneformer` layout of gguf/laneformer.py).

    python -m expresslane.gguf.write CHECKPOINT OUT.gguf [--type Q8_0] [--split-max-tensors N]

Matrices are stored in `--type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the types gguf-py
quantizes, with llama.cpp's reference rounding); norms, and any matrix whose rows are not a whole
number of blocks, stay F32. Tensors are read, converted and written one at a time.
`--split-max-tensors` writes llama.cpp's split layout (OUT-00001-of-0000N.gguf, ...). The
tokenizer files beside the checkpoint are copied beside the output, where the tokenizer loader
looks first. Llama-family checkpoints are refused: llama.cpp's convert_hf_to_gguf.py writes those.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, ExpressLaneError
from . import laneformer

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")  # fmt: skip
# general.file_type: llama.cpp's llama_ftype of the whole file
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "BF16": 32}


def write_laneformer(src, out, type_name: str = "F32", split_max_tensors: int = 0) -> Path:
    """Write checkpoint `src` (a Laneformer folder) to `out`; returns the (first) file written."""
    import gguf

    from ..checkpoint import open_checkpoint

    if type_name not in TYPES:
        raise CheckpointError(f"--type {type_name}: expected one of {', '.join(TYPES)}")
    folder, cfg, handles, where = open_checkpoint(src)
    if cfg.family != "laneformer":
        raise CheckpointError(
            f"{folder}: a {cfg.model_type} checkpoint; this writer writes Laneformers "
            "(llama.cpp's convert_hf_to_gguf.py writes Llama-family models)"
        )
    out = Path(out)
    w = gguf.GGUFWriter(out, laneformer.ARCH, split_max_tensors=split_max_tensors)
    for key, (value, kind) in laneformer.metadata(cfg.to_hf_dict()).items():
        _add(w, key, value, kind)
    w.add_file_type(FILE_TYPES[type_name])
    plan = []  # (name, key, shape, type) in checkpoint order
    for key in sorted(where, key=_order):
        shape = tuple(handles[where[key]].get_slice(key).get_shape())
        kind = _type_for(key, shape, type_name)
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        w.add_tensor_info(laneformer.gguf_name(key), shape, np.dtype(np.float32), nbytes, qtype)
        plan.append((key, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for key, qtype in plan:
        t = handles[where[key]].get_slice(key)[:].float().numpy()
        data = t if qtype == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(t, qtype)
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    written = w.format_shard_names(out)[0] if split_max_tensors else out
    for name in TOKENIZER_FILES:
        if (folder / name).is_file() and not (out.parent / name).exists():
            shutil.copyfile(folder / name, out.parent / name)
    return written


def _type_for(key: str, shape: tuple[int, ...], type_name: str) -> str:
    """The requested type for a matrix whose rows are whole blocks; F32 for norms and the rest."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    if len(shape) < 2 or "norm" in key or shape[-1] % block:
        return "F32"
    return type_name


def _order(key: str) -> tuple:
    """Embedding first, then layer by layer, then the final norm and head (llama.cpp's order)."""
    parts = key.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), key)
    return (0 if "tok_embeddings" in key else 2, 0, key)


def _add(w, key: str, value, kind: str) -> None:
    import gguf

    V = gguf.GGUFValueType
    if kind.endswith("[]"):
        w.add_key_value(key, [int(v) for v in value], V.ARRAY, V[kind[:-2]])
    else:
        w.add_key_value(key, value, V[kind])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m expresslane.gguf.write", description=__doc__)
    p.add_argument("checkpoint", help="a Laneformer checkpoint folder")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--type", default="F32", choices=TYPES, help="the matrices' GGML type")
    p.add_argument("--split-max-tensors", type=int, default=0, help="tensors per part (split)")
    args = p.parse_args(argv)
    try:
        print(write_laneformer(args.checkpoint, args.out, args.type, args.split_max_tensors))
    except ExpressLaneError as e:
        print(f"expresslane: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
