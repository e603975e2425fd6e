"""Model presets: named Hugging Face-style config.json dicts, and `load_model_config`.

A preset is written exactly as the checkpoint's config.json would be, so it goes through the same
parser and validation (`ModelConfig.from_hf_dict`) as a real checkpoint. Presets let the ceiling
calculator, benchmarks and tests name a model without downloading it:

- `laneformer-2b`: Kog's Laneformer 2B (docs/laneformer.md 3.1).
- `llama-3.2-1b`, `llama-3.2-3b`, `llama-3.1-8b`: Meta's published configs.
- `qwen3-0.6b`, `qwen2.5-0.5b`: Qwen's published configs (q/k norms; attention biases), the
  Llama-family extras of the fused GPU step at a real shape.
- `laneformer-tiny`, `llama-tiny`, `qwen3-tiny`: small random-init shapes for CPU tests (float32).

`load_model_config` accepts a preset name, a checkpoint folder holding config.json, or the path of
a config.json file.
"""

from __future__ import annotations

import copy
from pathlib import Path

from .config import ModelConfig
from .errors import ConfigError

# Llama 3 RoPE scaling as published by Meta; 3.2 uses factor 32, 3.1 factor 8.
_LLAMA3_ROPE_32 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3_ROPE_8 = dict(_LLAMA3_ROPE_32, factor=8.0)

# The Instruct releases stop on <|end_of_text|>, <|eom_id|> and <|eot_id|>; the base releases use
# only 128001. The longer list is a superset and is harmless for base-model text.
_LLAMA3_EOS = [128001, 128008, 128009]


def _llama3(
    hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, rope: dict, tied: bool
) -> dict:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": dict(rope),
        "max_position_embeddings": 131072,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": list(_LLAMA3_EOS),
        "torch_dtype": "bfloat16",
    }


def _qwen(model_type: str, hidden: int, intermediate: int, layers: int, heads: int, kv: int,
          max_len: int, **extra) -> dict:  # fmt: skip
    return {
        "model_type": model_type,
        "architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "Qwen2ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": max_len,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        **extra,
    }


PRESETS: dict[str, dict] = {
    # The model card's values (laneformer.md 3.1). norm_eps is not published: 1e-5 is the
    # reference config's default. dtp_variant is left to the parser default (laneformer.md 5.4, 11).
    "laneformer-2b": {
        "model_type": "laneformer",
        "architectures": ["LaneformerForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 3072,
        "intermediate_size": 12288,
        "num_hidden_layers": 15,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "num_lanes": 8,
        "broadcast_delay": 2,
        "use_comm": True,
        "use_early_comm": True,
        "lm_head_type": "vocab_parallel",
        "pre_norm_lane_agg": False,
        "replicated_rmsn_scale": True,
        "sliding_window": 2048,
        "sliding_window_n_layers": 10,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 64, _LLAMA3_ROPE_32, tied=True),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 128, _LLAMA3_ROPE_32, tied=True),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 128, _LLAMA3_ROPE_8, tied=False),
    # SmolLM2-135M's shape (a small Llama that transformers users run on CPUs): the CPU benchmark.
    "smollm-135m": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    # Qwen's config.json files as published (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B-Instruct).
    "qwen3-0.6b": _qwen("qwen3", 1024, 3072, 28, 16, 8, 40960, head_dim=128),
    "qwen2.5-0.5b": _qwen(
        "qwen2",
        896,
        4864,
        24,
        14,
        2,
        32768,
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=21,
    ),  # fmt: skip
    "qwen3-tiny": _qwen(
        "qwen3",
        128,
        256,
        2,
        4,
        2,
        256,
        head_dim=32,
        vocab_size=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    ),  # fmt: skip
    # Same structure as the 2B at toy size: 8 lanes of 2 query heads / 1 KV head (head_dim 16),
    # delay 2, vocab-parallel head, a 32-token window on the first 2 of 4 layers.
    "laneformer-tiny": {
        "model_type": "laneformer",
        "architectures": ["LaneformerForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_lanes": 8,
        "broadcast_delay": 2,
        "use_comm": True,
        "use_early_comm": True,
        "lm_head_type": "vocab_parallel",
        "pre_norm_lane_agg": False,
        "replicated_rmsn_scale": True,
        "sliding_window": 32,
        "sliding_window_n_layers": 2,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
    # Llama 3.2 in miniature: GQA 4/2, tied embeddings and llama3 RoPE scaling so that tests
    # exercise the same code paths as the real 1B.
    "llama-tiny": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_hf_dict(name: str) -> dict:
    """A fresh copy of the preset's config.json dict (safe to modify or write to disk)."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(
            f"unknown model preset {name!r}: known presets are {', '.join(preset_names())}"
        )
    return copy.deepcopy(PRESETS[key])


def get_preset(name: str) -> ModelConfig:
    """The validated ModelConfig of a preset; ConfigError lists the known names."""
    return ModelConfig.from_hf_dict(preset_hf_dict(name))


def load_model_config(preset_or_dir: str | Path) -> ModelConfig:
    """A ModelConfig from a preset name, a checkpoint folder, or a config.json path."""
    text = str(preset_or_dir)
    if text.lower() in PRESETS:
        return get_preset(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: folder has no config.json")
        return ModelConfig.from_json(path / "config.json")
    if path.is_file():
        return ModelConfig.from_json(path)
    raise ConfigError(
        f"model {text!r}: not a preset ({', '.join(preset_names())}), "
        "a checkpoint folder with config.json, or a config.json file"
    )
