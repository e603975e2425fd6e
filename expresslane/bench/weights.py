"""Random weights of a real shape for the benchmarks, made where they will run.

A preset has no checkpoint: the benchmarks build its random weights. `random_model` builds the
module on the meta device (no allocation, no initialisation), places it empty on the target
device in the target dtype and fills it there with `init_weights` (the draws come from a
generator on that device): a 2.3 B-parameter model takes milliseconds on a GPU, where building
it on the CPU took about 40 s. On a CPU the weights equal `init_weights(Laneformer(cfg))` of the
same seed, so rows measured either way decode the same tokens.

`random_checkpoint` writes such a model to disk (the parallel bench's ranks read their slices
from it); `as_llama` is the equal-byte Llama that stands in as a Laneformer's peer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import DTYPES, NoInit, save_model
from ..config import ModelConfig
from ..model import Laneformer, init_weights
from ..rope import inv_frequencies


def random_model(
    cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
    seed: int = 0,
) -> Laneformer:  # fmt: skip
    """Random weights of cfg's shape, made on `device` in `dtype` (default: the config's)."""
    dt = dtype or DTYPES.get(cfg.dtype, torch.float32)
    with torch.device("meta"), NoInit():
        model = Laneformer(cfg)
    model = model.to(dtype=dt).to_empty(device=device)
    init_weights(model, seed=seed)
    # to_empty left the non-persistent RoPE buffer uninitialised (and .to cast it): fp32 again
    model.inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    return model.eval()


def random_checkpoint(cfg: ModelConfig, out: Path, seed: int = 0) -> Path:
    """Random weights of real shape, saved as a checkpoint both engines can read."""
    model = random_model(cfg, "cpu", torch.float32, seed=seed)
    return save_model(model, out, dtype=cfg.dtype if cfg.dtype != "float32" else None)


def as_llama(cfg: ModelConfig) -> ModelConfig:
    """The Llama of equal weight bytes: same dims, one lane, replicate head (the peer's shape).

    Every layer attends to the full context: transformers' Mistral applies one mask type to
    all layers and its StaticCache then fails past the window (5.23), so sliding layers are not
    reproduced. Up to the window the KV bytes are equal too; past it the peer reads more KV
    (its rows count its own bytes)."""
    d = cfg.to_hf_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
    )
    llama = {k: d[k] for k in keep}
    llama.update(model_type="llama", head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps)
    return ModelConfig.from_hf_dict(llama)
