"""GGUF tensors under transformers' checkpoint keys: names mapped, Q/K rows un-permuted.

`GGUFCheckpoint` looks like an open safetensors file to checkpoint.py (`keys()`, `get_slice(key)`
whose `[...]` returns a tensor), so loading, shape checks and the parallel placement's slicing
work unchanged; a slice dequantizes the whole tensor to fp32 (the caller casts to its dtype).

llama.cpp's converter reorders the rows of q_proj and k_proj of `llama` files (per head,
rotate-half pairs (i, i + d/2) become adjacent rows (2i, 2i+1), its "permute"); the rows are put
back here so the model runs transformers' rotate-half RoPE. `raw(key)` gives the stored blocks of
a tensor with the same row order, for kernels that keep weights quantized.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from . import laneformer
from .config import ROPE_FREQS, hf_config_dict
from .quants import check_supported, raw_to_float
from .reader import read_header

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER = {  # inside blk.{i}. -> inside model.layers.{i}.
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PERMUTED_ARCHS = ("llama",)  # qwen2 and qwen3 files keep transformers' row order
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_key(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; unknown names stay."""
    m = _BLK.fullmatch(gguf_name)
    if m and m[2] in LAYER:
        return f"model.layers.{m[1]}.{LAYER[m[2]]}.{m[3]}"
    stem, _, suffix = gguf_name.rpartition(".")
    return f"{TOP[stem]}.{suffix}" if stem in TOP else gguf_name


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation on the leading axis of (rows, ...) or (rows,)."""
    rows = t.shape[0]
    half = rows // n_head // 2
    # (n_head, d/2, 2, ...) -> (n_head, 2, d/2, ...): adjacent pairs back to the two halves
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: GGML type name, logical shape (rows, cols) and its bytes per row."""

    ggml_type: str
    shape: tuple[int, ...]
    data: torch.Tensor  # uint8 (rows, bytes per row), rows in transformers' order


class GGUFCheckpoint:
    """The tensors of one GGUF model (one file, or a split model's parts), by checkpoint key,
    checked before anything is read."""

    def __init__(self, path: str | Path):
        self.header = read_header(path)
        self.path = self.header.path
        cfg = hf_config_dict(self.header)
        heads = cfg["num_attention_heads"]
        self._heads = {"q_proj": heads, "k_proj": cfg.get("num_key_value_heads") or heads}
        self._permuted = self.header.architecture in PERMUTED_ARCHS
        names = [n for n in self.header.tensors if n != ROPE_FREQS]
        if self.header.architecture == laneformer.ARCH:  # our own keys, not transformers'
            head = cfg["lm_head_type"]
            self._names = {laneformer.checkpoint_key(n, head): n for n in names}
        else:
            self._names = {hf_key(n): n for n in names}
        for n in names:  # refuse before reading anything
            check_supported(self.header, n)

    def keys(self) -> list[str]:
        return list(self._names)

    def ggml_type(self, key: str) -> str:
        return self.header.tensors[self._names[key]].type_name

    def shape(self, key: str) -> tuple[int, ...]:
        return self.header.tensors[self._names[key]].shape

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self, key)

    def _row_heads(self, key: str) -> int | None:
        """Heads whose rows llama.cpp permuted in this tensor, or None."""
        if not self._permuted:
            return None
        proj = key.split(".")[-2]
        return self._heads.get(proj) if ".self_attn." in key else None

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor dequantized to fp32, rows in transformers' order."""
        t = raw_to_float(self.header, self._names[key])
        heads = self._row_heads(key)
        return unpermute_rows(t, heads) if heads else t

    def raw(self, key: str) -> RawTensor:
        """The stored blocks (not dequantized), rows in transformers' order. A tensor of more
        than two dimensions (a Laneformer's (L, out, in)) comes as its (L * out, in) rows."""
        info = self.header.tensors[self._names[key]]
        whole = len(info.shape) > 1 or info.type_name in ("F32", "F16", "BF16")
        shape = (math.prod(info.shape[:-1]), info.shape[-1]) if len(info.shape) > 2 else info.shape
        rows = shape[0] if whole else 1  # a quantized 1-D tensor is one row of blocks
        data = torch.from_numpy(self.header.raw_bytes(info.name)).reshape(rows, -1)
        heads = self._row_heads(key)
        if heads and whole:
            data = unpermute_rows(data, heads)
        return RawTensor(info.type_name, shape, data)


class _Slice:
    """What safetensors' get_slice returns: a shape, and indexing that reads the tensor."""

    def __init__(self, ck: GGUFCheckpoint, key: str):
        self.ck, self.key = ck, key

    def get_shape(self) -> list[int]:
        return list(self.ck.shape(self.key))

    def __getitem__(self, index) -> torch.Tensor:
        return self.ck.tensor(self.key)[index]
