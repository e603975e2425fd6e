"""Configuration: ModelConfig, read from a checkpoint's config.json (a request's sampling
configuration is sampling/params.py).

One frozen ModelConfig describes both families. A Llama-family checkpoint (llama, mistral,
qwen2, qwen3) is the 1-lane case of the Laneformer decoder with "half" RoPE; a Laneformer checkpoint
(model_type laneformer or laneformer_tp) carries lanes, the DTP delay and its head type
(docs/laneformer.md). Every rule is checked here so that the model code can trust its config; a
broken rule raises ConfigError naming the field. hf_config.py translates config.json names and
defaults into the fields; this file builds and checks the ModelConfig from them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .hf_config import ROPE_TYPES, parse_hf_config

HEAD_TYPES = ("replicate", "lane", "vocab_parallel")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "laneformer" or "llama"
    model_type: str  # as written in config.json
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_style: str = "interleaved"  # "interleaved" (Meta/complex pairs) or "half" (HF rotate-half)
    num_lanes: int = 1
    broadcast_delay: int = 1
    use_comm: bool = True
    use_early_comm: bool = True
    # laneformer.md 5.4: "A" = the public implementation's wiring (present layers' partials are
    # re-added at layers d..2d-1); "B" = layers < d do not broadcast, so layers d..2d-1 add only
    # their own.
    dtp_variant: str = "A"
    lm_head_type: str = "replicate"
    pre_norm_lane_agg: bool = False
    replicated_rmsn_scale: bool = True
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window_n_layers: int = 0
    unclamped_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    qk_norm: bool = False  # qwen3: RMSNorm over each query and key head (head_dim,) before RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    dtype: str = "float32"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # --- derived shapes ---------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def lane_q_dim(self) -> int:
        return self.q_dim // self.num_lanes

    @property
    def lane_kv_dim(self) -> int:
        return self.kv_dim // self.num_lanes

    @property
    def lane_ffn_dim(self) -> int:
        return self.intermediate_size // self.num_lanes

    @property
    def per_lane_norms(self) -> bool:
        return not self.replicated_rmsn_scale

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def reduce_mode(self, layer: int) -> str:
        """The reduce of laneformer.md 5.3: present, no_reduce or past."""
        if layer < self.broadcast_delay:
            return "present" if self.use_early_comm else "no_reduce"
        return "past" if self.use_comm else "no_reduce"

    def past_source(self, layer: int) -> int | None:
        """The layer whose per-lane partials a `past` layer consumes, or None when it adds none."""
        if self.reduce_mode(layer) != "past":
            return None
        src = layer - self.broadcast_delay
        if self.dtp_variant == "B" and src < self.broadcast_delay:
            return None
        return src

    def broadcasts(self, layer: int) -> bool:
        """True when some later layer consumes this layer's per-lane partials."""
        return any(self.past_source(j) == layer for j in range(self.num_layers))

    @property
    def final_norm_shared(self) -> bool:
        return self.replicated_rmsn_scale or self.pre_norm_lane_agg

    def with_overrides(self, **kw: Any) -> ModelConfig:
        cfg = replace(self, **kw)
        cfg.validate()
        return cfg

    # --- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        L = self.num_lanes
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
            "num_lanes",
            "broadcast_delay",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"config field {name}={v!r}: must be a positive integer")
        if self.norm_eps <= 0:
            raise ConfigError(f"config field norm_eps={self.norm_eps}: must be > 0")
        if self.rope_theta <= 0:
            raise ConfigError(f"config field rope_theta={self.rope_theta}: must be > 0")
        if self.head_dim % 2:
            raise ConfigError(f"config field head_dim={self.head_dim}: RoPE needs an even head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config field num_key_value_heads={self.num_kv_heads}: must divide "
                f"num_attention_heads={self.num_heads}"
            )
        for name, v in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if v % L:
                raise ConfigError(f"config field {name}={v}: must be divisible by num_lanes={L}")
        if self.lm_head_type not in HEAD_TYPES:
            raise ConfigError(
                f"config field lm_head_type={self.lm_head_type!r}: must be one of {HEAD_TYPES}"
            )
        if self.lm_head_type == "vocab_parallel" and self.vocab_size % L:
            raise ConfigError(
                f"config field vocab_size={self.vocab_size}: must be divisible by "
                f"num_lanes={L} for lm_head_type 'vocab_parallel'"
            )
        if self.pre_norm_lane_agg and self.lm_head_type != "replicate":
            raise ConfigError(
                "config field pre_norm_lane_agg=true: only allowed with "
                f"lm_head_type 'replicate', not {self.lm_head_type!r}"
            )
        if self.tie_word_embeddings and self.lm_head_type != "replicate":
            raise ConfigError(
                "config field tie_word_embeddings=true: only allowed with lm_head_type 'replicate'"
            )
        if self.dtp_variant not in ("A", "B"):
            raise ConfigError(f"config field dtp_variant={self.dtp_variant!r}: must be 'A' or 'B'")
        if self.qk_norm and self.family != "llama":
            raise ConfigError("qk_norm=true: only Llama-family checkpoints (qwen3) have q/k norms")
        if self.rope_style not in ("interleaved", "half"):
            raise ConfigError(f"rope_style={self.rope_style!r}: must be 'interleaved' or 'half'")
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                f"config field layer_types has {len(self.layer_types)} entries: "
                f"expected num_hidden_layers={self.num_layers}"
            )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(
                f"config field layer_types: unknown type {bad[0]!r}, expected one of {LAYER_TYPES}"
            )
        if "sliding_attention" in self.layer_types and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ConfigError(
                f"config field sliding_window={self.sliding_window!r}: sliding-window "
                "layers need a positive integer window"
            )
        if self.rope_scaling and self.rope_scaling.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"config field rope_scaling.rope_type="
                f"{self.rope_scaling.rope_type!r}: supported types are {ROPE_TYPES}"
            )
        for t in self.eos_token_ids:
            if not 0 <= t < self.vocab_size:
                raise ConfigError(
                    f"config field eos_token_id={t}: outside the vocabulary "
                    f"(vocab_size={self.vocab_size})"
                )

    # --- config.json --------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json there") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_hf_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_hf_dict(cls, raw: dict) -> ModelConfig:
        """Parse a transformers-style config.json dict (hf_config.py owns the field rules)."""
        fields = parse_hf_config(raw)
        if fields["rope_scaling"] is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        cfg = cls(**fields)
        cfg.validate()
        return cfg

    def to_hf_dict(self) -> dict:
        """The config.json that writes this model back (the layout it was read from)."""
        d: dict[str, Any] = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (
                self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
            ),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
        }
        if self.rope_scaling:
            d["rope_scaling"] = asdict(self.rope_scaling)
        if self.family == "laneformer":
            d.update(
                model_type=self.model_type,
                architectures=["LaneformerForCausalLM"],
                norm_eps=self.norm_eps,
                num_lanes=self.num_lanes,
                broadcast_delay=self.broadcast_delay,
                use_comm=self.use_comm,
                use_early_comm=self.use_early_comm,
                lm_head_type=self.lm_head_type,
                pre_norm_lane_agg=self.pre_norm_lane_agg,
                replicated_rmsn_scale=self.replicated_rmsn_scale,
                sliding_window_n_layers=self.sliding_window_n_layers,
                unclamped_layers=list(self.unclamped_layers),
                dtp_variant=self.dtp_variant,
            )
        else:
            arch = {
                "llama": "LlamaForCausalLM",
                "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM",
            }[self.model_type]
            d.update(
                model_type=self.model_type,
                architectures=[arch],
                rms_norm_eps=self.norm_eps,
                head_dim=self.head_dim,
                hidden_act="silu",
                attention_bias=self.attention_bias,
            )
        return d
