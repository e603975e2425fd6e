"""ModelConfig parsing: every Laneformer field, Llama-family variants, and rule violations."""

from __future__ import annotations

import json

import pytest

from expresslane.config import ModelConfig
from expresslane.errors import ConfigError

LF = dict(
    model_type="laneformer",
    vocab_size=32000,
    hidden_size=3072,
    intermediate_size=12288,
    num_hidden_layers=15,
    num_attention_heads=32,
    num_key_value_heads=16,
    num_lanes=8,
    broadcast_delay=2,
    lm_head_type="vocab_parallel",
    sliding_window=2048,
    sliding_window_n_layers=10,
    max_position_embeddings=4096,
    eos_token_id=2,
)


def test_laneformer_2b_layer_assignment():
    cfg = ModelConfig.from_hf_dict(LF)
    assert [cfg.is_sliding(i) for i in range(15)] == [True] * 10 + [False] * 5
    assert [cfg.reduce_mode(i) for i in range(15)] == ["present"] * 2 + ["past"] * 13
    assert cfg.head_dim == 96 and cfg.lane_q_dim == 384 and cfg.lane_kv_dim == 192
    # Option A: layers 0..12 are consumed later; Option B: only 2..12 broadcast
    assert [i for i in range(15) if cfg.broadcasts(i)] == list(range(13))
    b = cfg.with_overrides(dtp_variant="B")
    assert [i for i in range(15) if b.broadcasts(i)] == list(range(2, 13))


def test_negative_window_layers_and_unclamped_and_layer_types():
    cfg = ModelConfig.from_hf_dict({**LF, "sliding_window_n_layers": -5, "unclamped_layers": [12]})
    assert [i for i in range(15) if cfg.is_sliding(i)] == [10, 11, 13, 14]
    # layer_types is not read by the reference: accepted when it agrees with its rule...
    same = ["sliding_attention"] * 10 + ["full_attention"] * 5
    assert ModelConfig.from_hf_dict({**LF, "layer_types": same}).layer_types == tuple(same)
    # ...and refused, not obeyed, when it asks for other layers
    other = ["full_attention", "sliding_attention"] * 7 + ["full_attention"]
    with pytest.raises(ConfigError, match="layer_types.*reference implementation ignores"):
        ModelConfig.from_hf_dict({**LF, "layer_types": other})


def test_laneformer_window_null_with_sliding_layers_is_refused_like_the_reference():
    with pytest.raises(ConfigError, match=r"sliding_window=null.*layers \[0, 1, 2\]"):
        ModelConfig.from_hf_dict({**LF, "sliding_window": None, "sliding_window_n_layers": 3})
    # no layer would slide: nothing to refuse (n = 0, or every sliding layer unclamped)
    for kw in (
        {"sliding_window_n_layers": 0},
        {"sliding_window_n_layers": 1, "unclamped_layers": [0]},
    ):
        cfg = ModelConfig.from_hf_dict({**LF, "sliding_window": None, **kw})
        assert not any(cfg.is_sliding(i) for i in range(15))


def test_laneformer_rope_is_plain_rope_from_rope_theta_like_the_reference():
    # what the reference computes anyway is accepted (transformers 5 writes rope_parameters)
    for extra in (
        {"rope_scaling": None},
        {"rope_scaling": {"rope_type": "default"}},
        {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    ):
        cfg = ModelConfig.from_hf_dict({**LF, **extra})
        assert cfg.rope_scaling is None and cfg.rope_theta == extra.get("rope_theta", 1e4)
    # a scaling, or a theta the reference would not use, is refused with the reason
    refused = [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "rope_theta=10000"),
    ]
    for extra, says in refused:
        with pytest.raises(ConfigError, match="reference implementation ignores") as e:
            ModelConfig.from_hf_dict({**LF, **extra})
        assert says in str(e.value)


@pytest.mark.parametrize(
    "field,agrees,differs",
    [("head_dim", 96, 128), ("attention_bias", False, True), ("hidden_act", "silu", "gelu")],
)
def test_laneformer_llama_fields_the_reference_ignores(field, agrees, differs):
    assert ModelConfig.from_hf_dict({**LF, field: agrees}).head_dim == 96
    with pytest.raises(ConfigError, match=f"config field {field}=.*ignores"):
        ModelConfig.from_hf_dict({**LF, field: differs})


@pytest.mark.parametrize(
    "comm,early,expect",
    [
        (True, True, ["present", "present", "past"]),
        (True, False, ["no_reduce", "no_reduce", "past"]),
        (False, True, ["present", "present", "no_reduce"]),
        (False, False, ["no_reduce", "no_reduce", "no_reduce"]),
    ],
)
def test_reduce_modes_follow_spec_6_3(comm, early, expect):
    cfg = ModelConfig.from_hf_dict({**LF, "use_comm": comm, "use_early_comm": early})
    assert [cfg.reduce_mode(i) for i in (0, 1, 2)] == expect


def test_rope_parameters_of_transformers_5_and_rope_scaling_of_4():
    old = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    new = ModelConfig.from_hf_dict(
        dict(
            model_type="llama",
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling and new.rope_scaling.factor == 32.0
    plain = ModelConfig.from_hf_dict(
        dict(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    )
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_mistral_and_qwen2_windows_and_biases():
    m = ModelConfig.from_hf_dict(dict(model_type="mistral", num_hidden_layers=4, sliding_window=8))
    assert all(m.is_sliding(i) for i in range(4)) and m.window(0) == 8
    q = ModelConfig.from_hf_dict(
        dict(
            model_type="qwen2",
            num_hidden_layers=4,
            sliding_window=8,
            use_sliding_window=True,
            max_window_layers=2,
        )
    )
    assert [q.is_sliding(i) for i in range(4)] == [False, False, True, True]
    assert q.attention_bias
    q2 = ModelConfig.from_hf_dict(dict(model_type="qwen2", sliding_window=8))
    assert q2.sliding_window is None and not any(q2.is_sliding(i) for i in range(32))


def test_round_trip_through_to_hf_dict():
    for raw in (LF, dict(model_type="llama", num_key_value_heads=8, tie_word_embeddings=True)):
        cfg = ModelConfig.from_hf_dict(raw)
        assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg


@pytest.mark.parametrize(
    "change,field",
    [
        ({"num_attention_heads": 36}, "num_attention_heads"),
        ({"num_key_value_heads": 12}, "num_key_value_heads"),
        ({"vocab_size": 32001}, "vocab_size"),
        ({"lm_head_type": "vocab_parallel", "pre_norm_lane_agg": True}, "pre_norm_lane_agg"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"broadcast_delay": 0}, "broadcast_delay"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["chunked_attention"] * 15}, "layer_types"),
        ({"eos_token_id": 40000}, "eos_token_id"),
        ({"hidden_size": "3072"}, "hidden_size"),
        ({"model_type": "gpt_neox"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_scaling"),
    ],
)
def test_rule_violations_name_the_field(change, field):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict({**LF, **change})
    assert field in str(e.value)


def test_config_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json(tmp_path / "config.json")
