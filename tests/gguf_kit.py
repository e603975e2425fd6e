"""Small GGUF files for the tests, written with the `gguf` package's own GGUFWriter.

`random_raw` makes a tensor's stored bytes for any type we read: the gguf package quantizes random
weights where it can (F16, BF16, Q8_0, Q4_0..Q5_1, MXFP4), and for the K, IQ, TQ, NVFP4 and Q1_0
types, which it can only dequantize (Q1_0: not even that), random blocks with sane f16 scales.
`hf_to_gguf` turns a transformers Llama, Mistral, Qwen2 or Qwen3 state dict into a GGUF the way
llama.cpp's converter does (names, Q/K row permutation, metadata).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS",
           "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ2_0", "TQ1_0")  # of 256 values  # fmt: skip
F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ3_S": (0,), "TQ2_0": (64,),
              "TQ1_0": (52,), "IQ3_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ1_S": (0,),
              "IQ1_M": (), "NVFP4": (), "Q1_0": (0,),
              "Q8_K": ()}  # f16 scales (IQ1_M's: random_raw)  # fmt: skip


def random_raw(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Stored bytes of a (rows, cols) tensor of `type_name`: (rows, bytes per row) uint8."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in QUANTIZABLE:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        out = gguf.quants.quantize(w, qtype)
        return np.ascontiguousarray(out).view(np.uint8).reshape(rows, -1)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[type_name]:
        scale = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8).reshape(-1, 2)
    if type_name == "IQ1_M":  # its d: the top nibbles of the four u16 of scales
        d = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16)  # (blocks, 4)
        sc = sc & 0x0FFF | (d[:, None] >> np.arange(0, 16, 4, dtype=np.uint16) & 15) << 12
        raw[:, 48:56] = sc.astype(np.uint16).view(np.uint8)
    return raw.reshape(rows, -1)


def reference_dequant(raw: np.ndarray, type_name: str, shape) -> np.ndarray:
    """gguf's own dequantizer (the reference our torch one must equal)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return raw.view(np.float32).reshape(shape)
    if type_name == "Q1_0":  # gguf-py has no Q1_0: ggml's dequantize_row_q1_0, written out
        b = raw.reshape(-1, 18)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
        bits = np.unpackbits(b[:, 2:], axis=-1, bitorder="little").astype(bool)
        return np.where(bits, d, -d).reshape(shape)
    return gguf.quants.dequantize(raw, qtype).reshape(shape)


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict, split: int = 0) -> Path:
    """tensors: name -> (stored bytes (rows, bytes/row) uint8 or an fp32 array, type name).
    split > 0 writes parts of at most `split` tensors, as llama.cpp's gguf-split names them
    (`m-00001-of-00003.gguf`, ...), and returns the first part."""
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split)
    for key, value in metadata.items():
        _add(w, key, value)
    for name, (data, type_name) in tensors.items():
        if type_name == "F32" and data.dtype == np.float32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(path))[0]


def _add(w: gguf.GGUFWriter, key: str, value) -> None:
    t = gguf.GGUFValueType
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif value and isinstance(value[0], str):
        w.add_key_value(key, list(value), t.ARRAY, sub_type=t.STRING)
    elif value and isinstance(value[0], float):
        w.add_key_value(key, list(value), t.ARRAY, sub_type=t.FLOAT32)
    else:
        w.add_key_value(key, list(value), t.ARRAY, sub_type=t.INT32)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K permutation: rotate-half rows -> adjacent pairs."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(key: str) -> str:
    stem, _, suffix = key.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    _, _, i, rest = stem.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}.{suffix}"


def hf_to_gguf(
    model,
    path: Path,
    weight_type: str = "F32",
    extra: dict | None = None,
    rope_freqs=None,
    split: int = 0,
) -> Path:
    """A transformers Llama/Mistral/Qwen2/Qwen3 model written as llama.cpp would (2-D weights in
    `weight_type`, random blocks where gguf-py cannot quantize to it; norms and biases F32);
    `extra` adds or overrides metadata keys, `rope_freqs`
    is written as llama.cpp's `rope_freqs.weight` tensor."""
    cfg = model.config
    arch = cfg.model_type if cfg.model_type in ("qwen2", "qwen3") else "llama"
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tensors = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = t.detach().float().numpy()
        if arch == "llama" and "q_proj" in key:
            w = permute(w, heads)
        elif arch == "llama" and "k_proj" in key:
            w = permute(w, kv)
        kind = weight_type if w.ndim == 2 else "F32"
        if kind == "F32":
            data = w
        elif kind in QUANTIZABLE:
            data = random_raw_from(w, kind)
        else:  # a type gguf-py cannot quantize: random blocks of the tensor's shape
            data = random_raw(kind, *w.shape, seed=len(tensors))
        tensors[gguf_name(key)] = (data, kind)
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = (rope_freqs, "F32")
    theta = cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else 1e4
    meta = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": float(theta),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.vocab_size": cfg.vocab_size,
        **_window(cfg, arch),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **(extra or {}),
    }
    return write_gguf(path, arch, meta, tensors, split)


def _window(cfg, arch: str) -> dict:
    """Mistral's sliding window (llama.cpp files Mistral 7B as llama, with this key)."""
    window = getattr(cfg, "sliding_window", None)
    return {f"{arch}.attention.sliding_window": window} if cfg.model_type == "mistral" else {}


def random_raw_from(w: np.ndarray, type_name: str) -> np.ndarray:
    out = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[type_name])
    return np.ascontiguousarray(out).view(np.uint8).reshape(w.shape[0], -1)


def llama3_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp writes for Llama 3.1 scaling (per-frequency divisors)."""
    from expresslane.config import RopeScaling
    from expresslane.rope import inv_frequencies

    base = inv_frequencies(head_dim, theta, None)
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    rs = RopeScaling("llama3", *(scaling[k] for k in keys))
    return (base / inv_frequencies(head_dim, theta, rs)).numpy().astype(np.float32)
