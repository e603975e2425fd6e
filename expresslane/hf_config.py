"""config.json dicts -> ModelConfig fields: each family's field names, defaults and layers.

This file only translates names and defaults; config.py builds and validates the ModelConfig
from what `parse_hf_config` returns (a dict of its field values, `rope_scaling` as a dict), so
the dependency runs one way: config.py -> hf_config.py.

Laneformer (model_type laneformer / laneformer_tp) uses the public reference implementation's
defaults and its sliding-window layer rule (docs/laneformer.md, "Configuration"); the Llama
family (llama, mistral, qwen2, qwen3) follows transformers, RoPE given either as rope_theta /
rope_scaling (transformers 4) or rope_parameters (transformers 5). A field of the wrong type is
a ConfigError naming it; an unknown model type is refused, never guessed.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

LANEFORMER_TYPES = ("laneformer", "laneformer_tp")
LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


def parse_hf_config(raw: dict) -> dict[str, Any]:
    """A config.json dict -> keyword arguments of ModelConfig (not yet validated)."""
    mt = raw.get("model_type")
    if mt in LANEFORMER_TYPES:
        return _laneformer_from_dict(raw)
    if mt in LLAMA_TYPES:
        return _llama_from_dict(raw)
    raise ConfigError(
        f"config field model_type={mt!r}: unsupported; ExpressLane runs "
        f"{LANEFORMER_TYPES + LLAMA_TYPES}"
    )


# --- parsing helpers --------------------------------------------------------------------------
def _int(raw: dict, key: str, default: Any = None) -> Any:
    v = raw.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config field {key}={v!r}: must be an integer")
    return v


def _num(raw: dict, key: str, default: float) -> float:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"config field {key}={v!r}: must be a number")
    return float(v)


def _bool(raw: dict, key: str, default: bool) -> bool:
    v = raw.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"config field {key}={v!r}: must be true or false")
    return v


def _eos(raw: dict, default: Any) -> tuple[int, ...]:
    v = raw.get("eos_token_id", default)
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
        raise ConfigError(f"config field eos_token_id={v!r}: must be an integer or a list of them")
    return tuple(vals)


def _rope(raw: dict) -> tuple[float, dict | None]:
    """RoPE from rope_theta/rope_scaling (transformers 4) or rope_parameters (transformers 5)."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ConfigError(f"config field rope_parameters={params!r}: must be an object")
        if "full_attention" in params and isinstance(params["full_attention"], dict):
            params = params["full_attention"]
        theta = _num(params, "rope_theta", _num(raw, "rope_theta", 10000.0))
        scaling = params
    else:
        theta = _num(raw, "rope_theta", 10000.0)
        scaling = raw.get("rope_scaling")
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ConfigError(f"config field rope_scaling={scaling!r}: must be an object or null")
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ConfigError(
            f"config field rope_scaling.rope_type={rtype!r}: supported types are {ROPE_TYPES}"
        )
    if rtype == "default":
        return theta, None
    return theta, dict(  # the fields of config.RopeScaling
        rope_type=rtype,
        factor=_num(scaling, "factor", 1.0),
        low_freq_factor=_num(scaling, "low_freq_factor", 1.0),
        high_freq_factor=_num(scaling, "high_freq_factor", 4.0),
        original_max_position_embeddings=_int(scaling, "original_max_position_embeddings", 8192),
    )


def _layer_types(raw: dict, n: int) -> tuple[str, ...] | None:
    lt = raw.get("layer_types")
    if lt is None:
        return None
    if not isinstance(lt, list) or not all(isinstance(t, str) for t in lt):
        raise ConfigError(f"config field layer_types={lt!r}: must be a list of strings")
    return tuple(lt)


def _dtype(raw: dict) -> str:
    d = raw.get("torch_dtype", raw.get("dtype")) or "float32"
    return str(d).removeprefix("torch.")


def _laneformer_from_dict(raw: dict) -> dict[str, Any]:
    # Defaults are the reference LaneformerTPConfig's (docs/laneformer.md, "Configuration").
    hidden = _int(raw, "hidden_size", 4096)
    heads = _int(raw, "num_attention_heads", 32)
    kv = _int(raw, "num_key_value_heads", None) or heads
    n = _int(raw, "num_hidden_layers", 32)
    if not hidden or not heads or hidden % heads:
        raise ConfigError(
            f"config field hidden_size={hidden}: must be divisible by num_attention_heads={heads}"
        )
    window = _int(raw, "sliding_window", None)
    swn = _int(raw, "sliding_window_n_layers", 0) or 0
    unclamped = raw.get("unclamped_layers") or []
    if not isinstance(unclamped, list) or not all(isinstance(x, int) for x in unclamped):
        raise ConfigError(f"config field unclamped_layers={unclamped!r}: must be a list of ints")
    types = _laneformer_layer_types(n, window, swn, unclamped)
    theta = _num(raw, "rope_theta", 10000.0)
    _check_ignored_fields(raw, hidden // heads, types, theta, _num(raw, "norm_eps", 1e-5))
    lanes = _int(raw, "num_lanes", 1)
    return dict(
        family="laneformer",
        model_type=raw["model_type"],
        vocab_size=_int(raw, "vocab_size", 128256),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", 16384),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=_int(raw, "max_position_embeddings", 131072),
        norm_eps=_num(raw, "norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=None,  # the reference has no RoPE scaling (checked above)
        rope_style="interleaved",
        num_lanes=lanes,
        broadcast_delay=_int(raw, "broadcast_delay", 1),
        use_comm=_bool(raw, "use_comm", True),
        use_early_comm=_bool(raw, "use_early_comm", True),
        dtp_variant=raw.get("dtp_variant", "A"),
        lm_head_type=raw.get("lm_head_type", "replicate"),
        pre_norm_lane_agg=_bool(raw, "pre_norm_lane_agg", False),
        replicated_rmsn_scale=_bool(raw, "replicated_rmsn_scale", True),
        sliding_window=window,
        layer_types=types,
        sliding_window_n_layers=swn,
        unclamped_layers=tuple(unclamped),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        bos_token_id=_int(raw, "bos_token_id", 1),
        eos_token_ids=_eos(raw, 0),
        pad_token_id=_int(raw, "pad_token_id", None),
        dtype=_dtype(raw),
    )


def _laneformer_layer_types(n: int, window, swn: int, unclamped: list) -> tuple[str, ...]:
    """The reference's rule: unclamped layers are full; else layer i slides iff i < swn or
    i >= n + swn (swn < 0 counts from the end). Like the reference, a sliding layer without a
    window is refused rather than quietly made full."""
    sliding = [i not in unclamped and (i < swn or i >= n + swn) for i in range(n)]
    if any(sliding) and window is None:
        layers = [i for i, s in enumerate(sliding) if s]
        raise ConfigError(
            f"config field sliding_window=null: sliding_window_n_layers={swn} makes layers "
            f"{layers} sliding-window layers, which need a window size (the reference "
            "implementation refuses this too); set sliding_window or sliding_window_n_layers=0"
        )
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _check_ignored_fields(raw: dict, head_dim: int, types: tuple, theta: float, eps: float):
    """Fields the reference Laneformer implementation never reads (it builds plain RoPE from
    rope_theta, its layers from sliding_window_n_layers, its shapes from hidden_size).

    Each is accepted only where it says what the reference computes anyway, so a checkpoint
    that relies on one (a RoPE scaling, a layer_types list of its own) is refused with the
    reason instead of being run as something its authors' code would not compute."""
    why = "the Laneformer reference implementation ignores this field and computes"
    expected = {
        "layer_types": list(types),
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
    }
    for key, want in expected.items():
        if raw.get(key) is not None and raw[key] != want:
            raise ConfigError(f"config field {key}={raw[key]!r}: {why} {want!r}")
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            rope = rope["full_attention"]  # transformers 5: per layer type
        if rope is None:
            continue
        rtype = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else 0
        if rtype != "default":
            raise ConfigError(
                f"config field {key}={raw[key]!r}: {why} plain RoPE from rope_theta; "
                "remove it or give rope_type 'default'"
            )
        if "rope_theta" in rope and rope["rope_theta"] != theta:
            raise ConfigError(
                f"config field {key}.rope_theta={rope['rope_theta']!r}: {why} rope_theta={theta}"
                " (the top-level field, or its default 10000)"
            )


def _llama_from_dict(raw: dict) -> dict[str, Any]:
    mt = raw["model_type"]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    hidden = _int(raw, "hidden_size", 4096)
    heads = _int(raw, "num_attention_heads", 32)
    n = _int(raw, "num_hidden_layers", 32)
    head_dim = _int(raw, "head_dim", None) or (hidden // heads if heads else 0)
    window = _int(raw, "sliding_window", None)
    types = _layer_types(raw, n)
    if types is None:
        if mt == "mistral" and window is not None:
            types = ("sliding_attention",) * n
        elif mt in ("qwen2", "qwen3") and raw.get("use_sliding_window") and window is not None:
            first = _int(raw, "max_window_layers", n)
            types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))
        else:
            types = ("full_attention",) * n
    if "sliding_attention" not in types:
        window = None
    theta, scaling = _rope(raw)
    bias = _bool(raw, "attention_bias", mt == "qwen2")
    if _bool(raw, "mlp_bias", False):
        raise ConfigError("config field mlp_bias=true: MLP biases are not supported")
    return dict(
        family="llama",
        model_type=mt,
        vocab_size=_int(raw, "vocab_size", 32000),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", 11008),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=_int(raw, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
        norm_eps=_num(raw, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_style="half",
        num_lanes=1,
        broadcast_delay=1,
        lm_head_type="replicate",
        sliding_window=window,
        layer_types=types,
        attention_bias=bias,
        qk_norm=mt == "qwen3",
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        bos_token_id=_int(raw, "bos_token_id", 1),
        eos_token_ids=_eos(raw, 2),
        pad_token_id=_int(raw, "pad_token_id", None),
        dtype=_dtype(raw),
    )
