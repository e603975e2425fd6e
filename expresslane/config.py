"""Configuration: ModelConfig (read from a checkpoint's config.json) and SamplingParams.

One frozen ModelConfig describes both families. A Llama-family checkpoint (llama, mistral,
qwen2, qwen3) is the 1-lane case of the Laneformer decoder with "half" RoPE; a Laneformer checkpoint
(model_type laneformer or laneformer_tp) carries lanes, the DTP delay and its head type
(docs/laneformer.md). Every rule is checked here so that the model code can trust its config; a
broken rule raises ConfigError naming the field. hf_config.py translates config.json names and
defaults into the fields; this file builds and checks the ModelConfig from them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError, RequestError
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


# --- sampling ----------------------------------------------------------------------
# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing fp32 logits by
# 1e-38 overflows to inf and the softmax turns into NaN, so such a value cannot mean anything else.
GREEDY_TEMPERATURE = 1e-5
# The largest finite fp32: the sampler's knobs are fp32 buffers, and filling one with 1e39 fails.
FP32_MAX = 3.4028234663852886e38


# SamplingParams' logits adjustments (sampler.Penalties), by the name the API gives each
ADJUSTMENTS = ("logit_bias", "min_tokens", "repetition_penalty", "frequency_penalty",
               "presence_penalty")  # fmt: skip


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; n >= 0: the chosen token's plus the top n
    skip_special_tokens: bool = True  # vLLM's default: special tokens never reach the text
    spaces_between_special_tokens: bool = True
    grammar: Any = None  # a compiled grammar.Grammar: decoding is constrained to it
    # vLLM's logits adjustments (sampler.Penalties), applied before temperature in this order:
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's {token id: bias}, as pairs
    min_tokens: int = 0  # the end-of-text and stop ids masked until this many tokens
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits / p, others * p
    frequency_penalty: float = 0.0  # output tokens: minus this times their count
    presence_penalty: float = 0.0  # output tokens: minus this once
    # OpenAI's Predicted Outputs: token ids the answer is expected to repeat, drafted and
    # verified as speculation (speculative/prediction.py): the speed changes, never the tokens
    prediction: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Any of the penalties, logit_bias or min_tokens away from its neutral value."""
        return bool(self.logit_bias or self.min_tokens or self.repetition_penalty != 1.0
                    or self.frequency_penalty or self.presence_penalty)  # fmt: skip

    def validate(self) -> None:
        def check(ok: bool, param: str, rule: str) -> None:
            if not ok:
                raise RequestError(f"{param}={getattr(self, param)!r}: {rule}", param=param)

        check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 0,
            "max_tokens",
            "must be an integer >= 0",
        )
        check(
            math.isfinite(self.temperature) and 0 <= self.temperature <= FP32_MAX,
            "temperature",
            f"must be a finite number in [0, {FP32_MAX:.7g}] (float32)",
        )
        check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k",
            "must be an integer >= -1 (0 or -1 turn it off)",
        )
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be an integer in [0, 20]",
        )
        self._validate_adjustments(check)
        if not all(isinstance(t, int) and t >= 0 for t in self.prediction):
            raise RequestError("prediction: must be token ids (integers >= 0)", "prediction")

    def _validate_adjustments(self, check) -> None:
        """vLLM's and OpenAI's ranges; token ids against the vocabulary: Engine.check_logit_bias."""
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            check(_number(v) and -2.0 <= v <= 2.0, name, "must be a number in [-2, 2]")
        r = self.repetition_penalty
        check(_number(r) and 0.0 < r <= FP32_MAX, "repetition_penalty",
              "must be a finite number > 0 (1: off)")  # fmt: skip
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
              "min_tokens", "must be an integer in [0, max_tokens]")  # fmt: skip
        rule = "maps token ids (integers >= 0) to biases in [-100, 100]"
        for tok, bias in self.logit_bias:
            ok = isinstance(tok, int) and tok >= 0 and _number(bias) and -100 <= bias <= 100
            check(ok, "logit_bias", rule)


def logit_bias_pairs(bias: dict) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias object ({"token id": bias}, keys as strings) as SamplingParams'
    sorted (id, bias) pairs; the server's field and run's --logit-bias both read it here. The
    biases' range is SamplingParams.validate's."""
    if not isinstance(bias, dict):
        raise RequestError("logit_bias: expected an object of token ids to biases", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise RequestError(f"logit_bias: key {key!r} is not a token id", "logit_bias")
        if not _number(value):
            raise RequestError(f"logit_bias: the bias of {key} is not a number", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
