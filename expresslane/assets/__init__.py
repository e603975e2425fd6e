"""The embedded default model: the small trained Laneformer shipped in this folder.

Until a trained model is present, `default_model_dir()` builds a small *random-weight*
Laneformer (with a tiny tokenizer) in the user's cache and says so plainly on stderr: its output
is noise, useful only to exercise the engine end to end.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TRAINED = Path(__file__).parent / "laneformer-py"
# What a user of the embedded model should expect, said before its first answer (cli/run.py);
# the figures are those of laneformer-py/README.md.
SUMMARY = (
    "a 5.6 M-parameter Laneformer trained for 48 minutes on the Python standard library; expect "
    "Python-shaped text, not working code (name a checkpoint folder to run a real model)"
)
RANDOM_CONFIG = {
    "model_type": "laneformer",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8 * 2,
    "num_lanes": 8,
    "broadcast_delay": 2,
    "lm_head_type": "vocab_parallel",
    "sliding_window": 64,
    "sliding_window_n_layers": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def default_model_dir() -> Path:
    if has_trained_model():
        return TRAINED
    return random_model_dir()


def model_path(model: str | None) -> Path:
    """The folder or GGUF file a command's MODEL names (resolved: local, HF cache, download),
    or the embedded model where none is given."""
    from ..checkpoint import resolve_model_dir

    return resolve_model_dir(model) if model else default_model_dir()


def has_trained_model() -> bool:
    return (TRAINED / "model.safetensors").is_file()


def random_model_dir() -> Path:
    cache = Path(os.environ.get("EXPRESSLANE_CACHE", Path.home() / ".cache" / "expresslane"))
    out = cache / "random-laneformer"
    if not (out / "model.safetensors").is_file():
        build_random_model(out)
    print(
        f"note: no trained default model is embedded yet; using RANDOM weights from {out} "
        "(the output is noise)",
        file=sys.stderr,
    )
    return out


def build_random_model(out: Path, seed: int = 0) -> Path:
    from ..checkpoint import save_model
    from ..config import ModelConfig
    from ..model import Laneformer, init_weights
    from ..train.tokenizer_train import train_tiny_tokenizer

    cfg = ModelConfig.from_hf_dict(RANDOM_CONFIG)
    save_model(init_weights(Laneformer(cfg), seed=seed), out)
    train_tiny_tokenizer(out, vocab_size=cfg.vocab_size)
    return out
