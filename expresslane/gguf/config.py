"""GGUF metadata -> a transformers-style config dict (then ModelConfig, as for config.json).

Keys follow llama.cpp's names under the architecture prefix (`llama.block_count`,
`llama.attention.head_count_kv`, `llama.rope.freq_base`, ...). Architectures read: `llama` (Llama
1-3 and Mistral 7B: llama.cpp has no `mistral` architecture and files Mistral as llama; a
sliding-window key makes it mistral here), `qwen2`, `qwen3` (q/k norms per head, head_dim from
`attention.key_length`) and `laneformer` (expresslane/gguf/laneformer.py). RoPE scaling: `linear`
from `rope.scaling.*`, and Llama 3.1's llama3 scaling, which llama.cpp stores only as a
`rope_freqs.weight` tensor of per-frequency divisors: its parameters are recovered from that tensor
and checked to reproduce it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig, RopeScaling
from ..errors import CheckpointError, ConfigError
from ..rope import inv_frequencies
from . import laneformer
from .quants import raw_to_float
from .reader import GGUFHeader

ARCHITECTURES = ("llama", "qwen2", "qwen3", laneformer.ARCH)
ROPE_FREQS = "rope_freqs.weight"


def model_config(header: GGUFHeader) -> ModelConfig:
    return ModelConfig.from_hf_dict(hf_config_dict(header))


def hf_config_dict(header: GGUFHeader) -> dict[str, Any]:
    """The config.json transformers would write for this file (the fields ExpressLane reads)."""
    arch = header.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{header.path}: GGUF architecture {arch!r} is not supported; ExpressLane reads "
            f"{', '.join(ARCHITECTURES)} (Mistral 7B files are 'llama')"
        )
    if arch == laneformer.ARCH:
        return laneformer.hf_config_dict(header, _dtype(header))

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in header.metadata:
            raise CheckpointError(f"{header.path}: metadata key {full} is missing")
        return _per_layer(header, full)

    heads = need("attention.head_count")
    hidden = need("embedding_length")
    head_dim = header.get(f"{arch}.attention.key_length") or hidden // heads
    v_dim = header.get(f"{arch}.attention.value_length") or head_dim
    if v_dim != head_dim:
        raise CheckpointError(
            f"{header.path}: {arch}.attention.value_length={v_dim} differs from key_length="
            f"{head_dim}; separate key and value head sizes are not supported"
        )
    rot = header.get(f"{arch}.rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise CheckpointError(
            f"{header.path}: {arch}.rope.dimension_count={rot} rotates part of each head "
            f"(head_dim {head_dim}); partial rotary embeddings are not supported"
        )
    cfg: dict[str, Any] = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _per_layer(header, f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "max_position_embeddings": header.get(f"{arch}.context_length", 2048),
        "rms_norm_eps": header.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": header.get(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": _vocab_size(header, arch),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": "blk.0.attn_q.bias" in header.tensors,
        "torch_dtype": _dtype(header),
        **_special_ids(header),
    }
    window = header.get(f"{arch}.attention.sliding_window")
    if arch == "llama" and window:
        cfg.update(model_type="mistral", sliding_window=window)
    scaling = _rope_scaling(header, arch, head_dim, cfg["rope_theta"])
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def _per_layer(header: GGUFHeader, key: str) -> Any:
    """A value llama.cpp may store per layer (head counts, FFN size): one value, or refused."""
    v = header.get(key)
    if isinstance(v, list):
        if not v or any(x != v[0] for x in v):
            raise CheckpointError(f"{header.path}: {key} differs between layers ({v[:8]}...)")
        return v[0]
    return v


def _vocab_size(header: GGUFHeader, arch: str) -> int:
    emb = header.tensors.get("token_embd.weight")
    if emb is not None:
        return emb.shape[0]
    tokens = header.get("tokenizer.ggml.tokens")
    return header.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 32000)


def _dtype(header: GGUFHeader) -> str:
    """The dtype a GPU loads in by default: the file's, or bfloat16 for quantized files."""
    wq = header.tensors.get("blk.0.attn_q.weight") or header.tensors.get("token_embd.weight")
    kind = wq.type_name if wq is not None else "BF16"
    return {"F32": "float32", "F16": "float16"}.get(kind, "bfloat16")


def _special_ids(header: GGUFHeader) -> dict[str, Any]:
    """BOS, PAD, and every end-of-generation id llama.cpp knows (EOS, EOT, EOM, end markers)."""
    g = header.get
    eos = header.end_of_generation_ids()
    out: dict[str, Any] = {"bos_token_id": g("tokenizer.ggml.bos_token_id"), "eos_token_id": eos}
    if g("tokenizer.ggml.padding_token_id") is not None:
        out["pad_token_id"] = g("tokenizer.ggml.padding_token_id")
    return out


def _rope_scaling(header: GGUFHeader, arch: str, head_dim: int, theta: float) -> dict | None:
    kind = header.get(f"{arch}.rope.scaling.type")
    factor = header.get(f"{arch}.rope.scaling.factor")
    if kind is None and header.get(f"{arch}.rope.scale_linear"):  # older files
        kind, factor = "linear", header.get(f"{arch}.rope.scale_linear")
    if ROPE_FREQS in header.tensors:
        if kind not in (None, "none"):
            raise CheckpointError(f"{header.path}: both {ROPE_FREQS} and rope.scaling.type={kind}")
        return _llama3_from_freqs(header, head_dim, theta)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise CheckpointError(
        f"{header.path}: {arch}.rope.scaling.type={kind!r} is not supported (none, linear, or "
        f"llama3 through {ROPE_FREQS})"
    )


def _llama3_from_freqs(header: GGUFHeader, head_dim: int, theta: float) -> dict | None:
    """llama3 parameters that reproduce `rope_freqs.weight` (inv_freq = base / rope_freqs).

    With s = (orig/wavelen - low) / (high - low) in the smooth band, 1/f = (1-s)/factor + s is
    linear in 1/wavelen: two band points give orig/(high-low) and low/(high-low). Only those
    ratios matter, so orig is taken as 8192 (Llama 3.1's) and low/high follow.
    """
    f = raw_to_float(header, ROPE_FREQS).double().numpy()
    base = inv_frequencies(head_dim, theta, None).double().numpy()
    if f.shape != base.shape:
        raise CheckpointError(
            f"{header.path}: {ROPE_FREQS} has {f.size} values, expected head_dim/2 = {base.size}"
        )
    factor = float(f.max())
    if np.allclose(f, 1.0):
        return None
    wavelen = 2 * math.pi / base
    band = (f > 1 + 1e-6) & (f < factor - 1e-6 * factor)
    if band.sum() >= 2:
        s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[band], s, 1)
        b = -b
    else:  # no smooth band: put both edges between the last unscaled and first scaled wavelength
        edge = math.sqrt(wavelen[f <= 1 + 1e-6].max() * wavelen[f >= factor * (1 - 1e-6)].min())
        a, b = edge * 1e6, 1e6  # low_wavelen = a/b = edge; the band is ~1e-6 wide
    orig = 8192
    scaling = RopeScaling("llama3", factor, orig * b / a, orig * (b + 1) / a, orig)
    got = inv_frequencies(head_dim, theta, scaling).double()
    if not torch.allclose(got, torch.from_numpy(base / f), rtol=1e-4, atol=0):
        raise ConfigError(
            f"{header.path}: {ROPE_FREQS} does not follow llama3 RoPE scaling; cannot load it"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": orig,
    }
