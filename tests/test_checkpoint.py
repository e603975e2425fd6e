"""Checkpoints: save/load round trips, shards, the HF cache layout, and clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from expresslane.checkpoint import load_model, resolve_model_dir, save_model
from expresslane.config import ModelConfig
from expresslane.errors import CheckpointError, ConfigError
from expresslane.model import Laneformer, init_weights

CFG = dict(
    model_type="laneformer",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_lanes=2,
    broadcast_delay=1,
    lm_head_type="lane",
    max_position_embeddings=64,
    eos_token_id=2,
    replicated_rmsn_scale=False,
)
TOKENS = torch.tensor([[5, 9, 33, 2, 70, 11]])


@pytest.fixture()
def saved(tmp_path):
    model = init_weights(Laneformer(ModelConfig.from_hf_dict(CFG)), seed=1, norm_noise=0.2)
    save_model(model, tmp_path / "ckpt")
    return model.eval(), tmp_path / "ckpt"


def test_round_trip_gives_same_logits(saved):
    model, path = saved
    loaded = load_model(path, device="cpu", dtype="float32", progress=False)
    assert loaded.cfg == model.cfg
    with torch.no_grad():
        assert torch.equal(model(TOKENS), loaded(TOKENS))


def test_sharded_save_loads_through_the_index(saved, tmp_path):
    model, _ = saved
    out = save_model(model, tmp_path / "sharded", max_shard_bytes=20_000)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    loaded = load_model(out, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), loaded(TOKENS))


def test_dtype_cast(saved):
    _, path = saved
    loaded = load_model(path, device="cpu", dtype="bfloat16", progress=False)
    assert next(loaded.parameters()).dtype == torch.bfloat16


def test_norm_type_is_told_by_the_keys(saved):
    _, path = saved
    cfg = json.loads((path / "config.json").read_text())
    cfg["replicated_rmsn_scale"] = True  # the config lies; the `.scale` keys tell the truth
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_model(path, device="cpu", progress=False).cfg.per_lane_norms


def test_hf_cache_snapshot_is_found(saved, tmp_path, monkeypatch):
    _, path = saved
    snap = tmp_path / "hub" / "models--kogai--tiny" / "snapshots" / "abc123"
    shutil.copytree(path, snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("kogai/tiny") == snap


def _expect(path, exc, *words):
    with pytest.raises(exc) as e:
        load_model(path, device="cpu", progress=False)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg
    return msg


def test_missing_folder(tmp_path):
    _expect(tmp_path / "nope", CheckpointError, "nope")


def test_unknown_model_type(saved):
    _, path = saved
    (path / "config.json").write_text(json.dumps({**CFG, "model_type": "gpt2"}))
    _expect(path, ConfigError, "model_type", "gpt2")


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_attention_heads", 3),
        ("num_lanes", "two"),
        ("use_comm", "yes"),
        ("lm_head_type", "tied"),
    ],
)
def test_config_with_a_wrong_field(saved, field, value):
    _, path = saved
    (path / "config.json").write_text(json.dumps({**CFG, field: value}))
    _expect(path, ConfigError, field)


def test_vocab_not_divisible_by_lanes_for_vocab_parallel():
    with pytest.raises(ConfigError, match="vocab_size"):
        ModelConfig.from_hf_dict({**CFG, "lm_head_type": "vocab_parallel", "vocab_size": 97})


def test_truncated_safetensors(saved):
    _, path = saved
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _expect(path, CheckpointError, "model.safetensors")


def test_wrong_shape_names_the_tensor(saved):
    _, path = saved
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.attention.wq.weight"] = torch.zeros(2, 7, 32)
    save_file(tensors, path / "model.safetensors")
    _expect(path, CheckpointError, "model.layers.1.attention.wq.weight", "[2, 7, 32]")


def test_missing_and_unexpected_tensors_are_named(saved):
    _, path = saved
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.feed_forward.w2.weight"]
    save_file(tensors, path / "model.safetensors")
    _expect(path, CheckpointError, "model.layers.0.feed_forward.w2.weight", "missing")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.feed_forward.w2.weight"] = torch.zeros(2, 32, 32)
    tensors["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(tensors, path / "model.safetensors")
    _expect(path, CheckpointError, "model.layers.0.extra.weight", "unexpected")


def test_pickle_checkpoint_is_refused(saved):
    _, path = saved
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    _expect(path, CheckpointError, "pytorch_model.bin", "pickle", "execute")
