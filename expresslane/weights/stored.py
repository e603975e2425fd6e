"""What a checkpoint stores, read without converting it: the matrices a GGUF file's packing
takes as blocks (so that loading never dequantizes them), and the 16-bit format a safetensors
checkpoint's matrices share, which the CPU keeps (as it keeps a GGUF BF16 file's), reading those
matrices as stored (`stored_matrices`, `stored_reader`): never as fp32 on the way. packing.py
plans and packs by them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..gguf import find_gguf
from .quant import kernel_reads

# a layer's products as packing.py stacks them: q k v, wo, gate up, w2 (module paths)
PRODUCTS = (("attention.wq", "attention.wk", "attention.wv"), ("attention.wo",),
            ("feed_forward.w1", "feed_forward.w3"), ("feed_forward.w2",))  # fmt: skip


def _whole(cfg) -> list[str]:
    """The embedding and an untied replicated head: whole matrices a packer takes as stored (a
    lane or vocab-parallel head is packed from its floats)."""
    head = cfg.lm_head_type == "replicate" and not cfg.tie_word_embeddings
    return ["model.tok_embeddings", "lm_head"][: 1 + head]


def stored_only(cfg, path, adapted: set[str] = frozenset()) -> set[str]:
    """The parameters pack_gguf takes from the file's blocks alone, by the rules it packs by: a
    one-lane layer's product (q k v stacked, gate up stacked, wo, w2) whose every part is either
    adapted (merged from floats) or stored in a type a kernel reads; the embedding and an untied
    replicated head when stored so. load_model leaves them unread: a 4-bit 7B is never 28 GB of
    fp32 on its way to its kernels."""
    from ..checkpoint import hf_name
    from ..gguf.tensors import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    keys = set(ck.keys())

    def reads(module_path: str) -> bool:
        key = hf_name(cfg, module_path + ".weight")
        return key in keys and kernel_reads(ck.ggml_type(key))

    paths = []
    if cfg.num_lanes == 1:  # a Laneformer's lanes stack its floats (_pack without `fused`)
        for i in range(cfg.num_layers):
            for product in PRODUCTS:
                parts = [f"model.layers.{i}.{m}" for m in product]
                if all(p in adapted or reads(p) for p in parts):
                    paths += [p for p in parts if p not in adapted]
    return {p + ".weight" for p in paths + [p for p in _whole(cfg) if reads(p)]}


def stored_16bit(path) -> str | None:
    """bfloat16 or float16 where every matrix of a safetensors checkpoint is stored so."""
    from ..checkpoint import open_checkpoint

    if find_gguf(path) is not None:
        return None
    kinds = {h.get_slice(k).get_dtype() for h in open_checkpoint(path)[2].values()
             for k in h.keys() if len(h.get_slice(k).get_shape()) > 1}  # fmt: skip
    return {"BF16": "bfloat16", "F16": "float16"}.get(kinds.pop()) if len(kinds) == 1 else None


def stored_matrices(cfg, adapted: set[str] = frozenset()) -> set[str]:
    """The parameters pack_stored reads from a 16-bit checkpoint as stored: every projection a
    LoRA does not adapt, and the whole matrices (_whole)."""
    paths = [f"model.layers.{i}.{m}" for i in range(cfg.num_layers)
             for product in PRODUCTS for m in product]  # fmt: skip
    return {p + ".weight" for p in [p for p in paths if p not in adapted] + _whole(cfg)}


def stored_reader(path, cfg) -> Callable[[str, tuple], torch.Tensor]:
    """(module path, our shape) -> its weight as the checkpoint stores it (its dtype), in our
    layout."""
    from ..checkpoint import hf_name, open_checkpoint, read_tensor

    _, _, handles, where = open_checkpoint(path)

    def read(module_path: str, shape: tuple) -> torch.Tensor:
        ours = module_path + ".weight"
        key = hf_name(cfg, ours)
        return read_tensor(cfg, handles[where[key]], key, ours, shape, where[key])

    return read
