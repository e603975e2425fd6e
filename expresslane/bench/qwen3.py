"""SmolLM2 as a qwen3 file: the timing file of the packed step's q/k norms against llama.cpp.

No qwen3 weights can be downloaded here, so this writes SmolLM2-135M-Instruct's tensors (the F32
file of gguf/variants.py) under llama.cpp's `qwen3` architecture: metadata keys `llama.*` renamed
`qwen3.*`, the Q and K rows back in the checkpoint's order (llama.cpp permutes them for `llama`
files only), and per layer the two tensors qwen3 adds, `attn_q_norm` and `attn_k_norm` (head_dim,),
set to ones. The model is no longer SmolLM2 (every query and key head is normalised before RoPE,
which SmolLM2 was not trained with): its text means nothing, its shapes and its work per token are
a qwen3 model's of SmolLM2's size. Each TYPE is then written by llama.cpp's own quantizer.

    python -m expresslane.bench.qwen3 [TYPE ...]   # F32 then each TYPE; prints the paths

    expresslane bench "$(python -m expresslane.bench.qwen3 Q4_0 | tail -1)" --peer llama.cpp \\
        --formats gguf --contexts 40 1000 --decode-tokens 128 --rounds 3 --threads 2
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..gguf.quants import raw_to_float
from ..gguf.reader import read_header
from ..gguf.tensors import unpermute_rows
from ..gguf.variants import (
    FTYPES,
    STEM,
    atomic_write,
    copy_metadata,
    ensure,
    print_made,
    quantize_file,
)


def path(type_name: str) -> Path:
    """Where the qwen3 file of `type_name` lives: beside the SmolLM2 variants."""
    if type_name not in FTYPES:
        raise CheckpointError(f"no qwen3 timing file {type_name!r}; known: {', '.join(FTYPES)}")
    return ensure("F32").parent / f"{STEM}.qwen3.{type_name}.gguf"


def write_f32(src: Path, out: Path) -> Path:
    """`src` (a llama GGUF, F32) rewritten as a qwen3 file with q/k norms of ones."""
    import gguf

    header = read_header(src)
    reader = gguf.GGUFReader(src)  # for the metadata's value types, which ours drops
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_heads = int(reader.fields["llama.attention.head_count_kv"].contents())
    with atomic_write(out) as tmp:
        w = gguf.GGUFWriter(str(tmp), "qwen3")
        copy_metadata(reader, w, lambda name: name.replace("llama.", "qwen3.", 1))
        w.add_file_type(FTYPES["F32"])
        head_dim = None
        for name in header.tensors:
            x = raw_to_float(header, name)
            if name.endswith(("attn_q.weight", "attn_k.weight")):
                n = heads if "attn_q" in name else kv_heads
                x = unpermute_rows(x, n)  # qwen3 files keep the checkpoint's row order
                head_dim = x.shape[0] // n
            w.add_tensor(name, np.ascontiguousarray(x.numpy()))
            if name.endswith("attn_k.weight"):
                layer = name.split(".")[1]
                for norm in ("attn_q_norm", "attn_k_norm"):
                    w.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(head_dim, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return out


def make(type_name: str) -> Path:
    """The qwen3 file of `type_name`, made (from the F32 one) if missing."""
    out = path(type_name)
    if out.is_file():
        return out
    if type_name == "F32":
        return write_f32(ensure("F32"), out)
    return quantize_file(make("F32"), out, type_name)


def main(argv: list[str]) -> int:
    return print_made(make, ["F32", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
