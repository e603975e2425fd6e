"""The small random Laneformer the CPU tests build on: one base config, each test says what differs.

8 query heads and 4 KV heads over 4 lanes, delay 2, a vocab-parallel head, two sliding-window
layers before one full-attention layer: every mechanism the decode paths must get right, at a size
the interpreter and a 2-core CPU run in milliseconds.
"""

from __future__ import annotations

from expresslane.config import ModelConfig
from expresslane.model import Laneformer, init_weights

BASE = dict(
    model_type="laneformer",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_lanes=4,
    broadcast_delay=2,
    lm_head_type="vocab_parallel",
    sliding_window=16,
    sliding_window_n_layers=2,
    max_position_embeddings=256,
    eos_token_id=2,
)


def laneformer_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE, **overrides})


def laneformer(seed: int = 0, **overrides) -> Laneformer:
    """Random weights (norm scales jittered so that per-lane and shared norms differ), eval mode."""
    cfg = laneformer_config(**overrides)
    return init_weights(Laneformer(cfg), seed=seed, norm_noise=0.1).eval()
