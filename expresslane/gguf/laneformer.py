"""The Laneformer written as GGUF: architecture `laneformer`, its metadata keys and tensor names.

llama.cpp has no Laneformer, so the layout is ours, built on llama.cpp's conventions wherever a
Llama has the same thing. Metadata (prefix `laneformer.`):

    context_length, embedding_length, feed_forward_length, block_count, vocab_size  (uint32)
    attention.head_count, attention.head_count_kv                                   (uint32)
    attention.layer_norm_rms_epsilon, rope.freq_base            (float64: exact round trip)
    attention.sliding_window (uint32, absent for none), sliding_window_n_layers     (int32)
    unclamped_layers (int32 array), lane_count, broadcast_delay                     (uint32)
    use_comm, use_early_comm, pre_norm_lane_agg, replicated_rmsn_scale              (bool)
    dtp_variant ("A"/"B"), lm_head_type ("replicate"/"lane"/"vocab_parallel"),
    model_type ("laneformer"/"laneformer_tp")                                        (string)
    eos_token_ids (int32 array; tokenizer.ggml.eos_token_id holds the first)

plus llama.cpp's `tokenizer.ggml.{bos,eos,padding}_token_id`. Tensors keep the checkpoint's
lane-major shapes ((L, out, in) projections, (L, V/L, D) vocab-parallel head, (L, D) per-lane
norm scales) under llama.cpp's names: `token_embd`, `output_norm`, `output` (any head type), and
`blk.{i}.attn_norm|attn_q|attn_k|attn_v|attn_output|ffn_norm|ffn_gate|ffn_up|ffn_down`, keeping
the checkpoint's suffix (`.weight`, or `.scale` for per-lane norms). Rows are stored in the
checkpoint's order (no Q/K permutation: the Laneformer's RoPE is interleaved already).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import CheckpointError
from .reader import GGUFHeader

ARCH = "laneformer"
# config.json field -> (GGUF key under `laneformer.`, value kind); kinds name GGUFValueType
FIELDS = {
    "max_position_embeddings": ("context_length", "UINT32"),
    "hidden_size": ("embedding_length", "UINT32"),
    "intermediate_size": ("feed_forward_length", "UINT32"),
    "num_hidden_layers": ("block_count", "UINT32"),
    "vocab_size": ("vocab_size", "UINT32"),
    "num_attention_heads": ("attention.head_count", "UINT32"),
    "num_key_value_heads": ("attention.head_count_kv", "UINT32"),
    "norm_eps": ("attention.layer_norm_rms_epsilon", "FLOAT64"),
    "rope_theta": ("rope.freq_base", "FLOAT64"),
    "sliding_window": ("attention.sliding_window", "UINT32"),
    "sliding_window_n_layers": ("sliding_window_n_layers", "INT32"),
    "unclamped_layers": ("unclamped_layers", "INT32[]"),
    "num_lanes": ("lane_count", "UINT32"),
    "broadcast_delay": ("broadcast_delay", "UINT32"),
    "use_comm": ("use_comm", "BOOL"),
    "use_early_comm": ("use_early_comm", "BOOL"),
    "pre_norm_lane_agg": ("pre_norm_lane_agg", "BOOL"),
    "replicated_rmsn_scale": ("replicated_rmsn_scale", "BOOL"),
    "dtp_variant": ("dtp_variant", "STRING"),
    "lm_head_type": ("lm_head_type", "STRING"),
    "model_type": ("model_type", "STRING"),
}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_lanes", "lm_head_type", "model_type")  # fmt: skip
EOS_IDS = "eos_token_ids"

LAYER = {  # inside blk.{i}. -> inside model.layers.{i}.
    "attn_norm": "attention_norm",
    "attn_q": "attention.wq",
    "attn_k": "attention.wk",
    "attn_v": "attention.wv",
    "attn_output": "attention.wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
}
TOP = {"token_embd": "model.tok_embeddings", "output_norm": "model.norm", "output": "lm_head"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scale)")
_OURS = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|scale)")


def checkpoint_key(gguf_name: str, lm_head_type: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.attention.wq.weight`; unknown names stay."""
    m = _BLK.fullmatch(gguf_name)
    if m and m[2] in LAYER:
        return f"model.layers.{m[1]}.{LAYER[m[2]]}.{m[3]}"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem == "output" and lm_head_type == "lane":
        return f"lm_head.linear.{suffix}"
    return f"{TOP[stem]}.{suffix}" if stem in TOP else gguf_name


def gguf_name(key: str) -> str:
    """The inverse of checkpoint_key: a Laneformer checkpoint key -> its GGUF tensor name."""
    m = _OURS.fullmatch(key)
    inverse = {v: k for k, v in LAYER.items()}
    if m and m[2] in inverse:
        return f"blk.{m[1]}.{inverse[m[2]]}.{m[3]}"
    stem, _, suffix = key.rpartition(".")
    stem = "lm_head" if stem == "lm_head.linear" else stem
    top = {v: k for k, v in TOP.items()}
    if stem not in top:
        raise CheckpointError(f"tensor {key}: not part of a Laneformer checkpoint")
    return f"{top[stem]}.{suffix}"


def metadata(hf: dict) -> dict[str, tuple[Any, str]]:
    """A Laneformer config.json dict -> {full GGUF key: (value, kind)} (absent fields left out)."""
    out = {}
    for field, (key, kind) in FIELDS.items():
        if hf.get(field) is not None and hf[field] != []:  # GGUF has no empty arrays
            out[f"{ARCH}.{key}"] = (hf[field], kind)
    eos = hf.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if eos:
        out["tokenizer.ggml.eos_token_id"] = (eos[0], "UINT32")
        out[f"{ARCH}.{EOS_IDS}"] = (eos, "INT32[]")
    for field, key in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if hf.get(field) is not None:
            out[f"tokenizer.ggml.{key}_token_id"] = (hf[field], "UINT32")
    return out


def hf_config_dict(header: GGUFHeader, dtype: str) -> dict[str, Any]:
    """The config.json of the Laneformer this file holds (checked by ModelConfig after)."""
    cfg: dict[str, Any] = {}
    for field, (key, _) in FIELDS.items():
        if f"{ARCH}.{key}" in header.metadata:
            cfg[field] = header.metadata[f"{ARCH}.{key}"]
    missing = [FIELDS[f][0] for f in REQUIRED if f not in cfg]
    if missing:
        raise CheckpointError(f"{header.path}: metadata key {ARCH}.{missing[0]} is missing")
    eos = header.get(f"{ARCH}.{EOS_IDS}") or [header.get("tokenizer.ggml.eos_token_id")]
    cfg.update(
        tie_word_embeddings="output.weight" not in header.tensors,
        bos_token_id=header.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[int(e) for e in eos if e is not None],
        pad_token_id=header.get("tokenizer.ggml.padding_token_id"),
        torch_dtype=dtype,
    )
    return cfg
