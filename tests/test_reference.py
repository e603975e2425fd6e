"""The engine's Laneformer against the independent naive reference of tests/reference.py.

Every case builds a tiny model, randomises it with init_weights (with norm noise, so per-lane
scales matter), and compares the model's cache-free forward with the reference computed
position by position in float64 (docs/laneformer.md 3 to 7). Extra checks: a 1-lane Laneformer
is a Llama with Meta->HF permuted wq/wk (laneformer.md 4.4), the lane linears are their standard
matrices (laneformer.md 3.2), the wiring is really exercised (wrong delay / Option / RoPE /
window must diverge, laneformer.md 10), and attention is lane-local (laneformer.md 4.3).
"""

from __future__ import annotations

import pytest
import torch

from expresslane.config import ModelConfig
from expresslane.model import Laneformer, init_weights, lane_linear
from expresslane.rope import interleaved_to_half_permutation

try:  # tests/ is not a package: pytest puts it on sys.path (rootdir-relative "prepend" mode)
    from reference import _attention, reference_logits
except ImportError:  # pragma: no cover - if tests/ ever becomes a package
    from .reference import _attention, reference_logits

torch.set_num_threads(1)

TOL = 1e-4
TOKENS_12 = [5, 17, 3, 60, 42, 8, 33, 1, 27, 50, 11, 63]
TOKENS_20 = [9, 44, 2, 61, 18, 30, 7, 55, 23, 40, 12, 36, 1, 48, 26, 59, 4, 15, 38, 21]


def lane_cfg(**kw) -> ModelConfig:
    raw = dict(
        model_type="laneformer",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_lanes=2,
        broadcast_delay=2,
        max_position_embeddings=64,
        eos_token_id=2,
    )
    raw.update(kw)
    return ModelConfig.from_hf_dict(raw)


def llama_cfg(**kw) -> ModelConfig:
    raw = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
    )
    raw.update(kw)
    return ModelConfig.from_hf_dict(raw)


def build(cfg: ModelConfig, seed: int = 0) -> Laneformer:
    model = init_weights(Laneformer(cfg), seed, norm_noise=0.1)
    return model.eval()


def model_logits(model: Laneformer, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([tokens]))
    assert out.shape == (1, len(tokens), model_vocab(model))
    return out[0]


def model_vocab(model: Laneformer) -> int:
    return model.model.tok_embeddings.weight.shape[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# --- the grid ---------------------------------------------------------------------------------
L4 = dict(
    num_lanes=4, hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=128
)
PER_LANE = dict(replicated_rmsn_scale=False)

LANE_CASES = {
    # reduce configurations x delays (lanes 2, 4 layers, replicate head, shared norms)
    "d1-present-past": dict(broadcast_delay=1),
    "d2-present-past": dict(broadcast_delay=2),
    "d3-present-past": dict(broadcast_delay=3),
    "d4-all-present": dict(broadcast_delay=4),
    "d1-noreduce-past": dict(broadcast_delay=1, use_early_comm=False),
    "d2-noreduce-past": dict(broadcast_delay=2, use_early_comm=False),
    "d3-noreduce-past-L4": dict(broadcast_delay=3, use_early_comm=False, **L4),
    "d2-nocomm-present": dict(broadcast_delay=2, use_comm=False),
    "d1-nocomm-noreduce": dict(broadcast_delay=1, use_comm=False, use_early_comm=False),
    # Option B
    "B-d1": dict(broadcast_delay=1, dtp_variant="B"),
    "B-d2": dict(broadcast_delay=2, dtp_variant="B"),
    "B-d3-L4-vp": dict(broadcast_delay=3, dtp_variant="B", lm_head_type="vocab_parallel", **L4),
    "B-d2-noreduce": dict(broadcast_delay=2, dtp_variant="B", use_early_comm=False),
    "B-d2-nocomm": dict(broadcast_delay=2, dtp_variant="B", use_comm=False),
    # norm types x heads (lanes 4)
    "L4-replicate-shared": dict(**L4),
    "L4-replicate-perlane": dict(**L4, **PER_LANE),
    "L4-replicate-perlane-eps": dict(**L4, **PER_LANE, norm_eps=0.5),
    "L4-prenormagg-shared-eps": dict(**L4, pre_norm_lane_agg=True, norm_eps=0.5),
    "L4-prenormagg-perlane-eps": dict(**L4, **PER_LANE, pre_norm_lane_agg=True, norm_eps=0.5),
    "L4-lane-shared": dict(**L4, lm_head_type="lane"),
    "L4-lane-perlane": dict(**L4, **PER_LANE, lm_head_type="lane"),
    "L4-vp-shared": dict(**L4, lm_head_type="vocab_parallel"),
    "L4-vp-perlane-d1": dict(**L4, **PER_LANE, lm_head_type="vocab_parallel", broadcast_delay=1),
    "L2-tied": dict(tie_word_embeddings=True),
    "L2-tied-perlane": dict(tie_word_embeddings=True, **PER_LANE),
    # GQA: 2 KV heads per lane
    "gqa-L2": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, **PER_LANE),
    "gqa-L4": dict(
        num_lanes=4,
        hidden_size=64,
        num_attention_heads=16,
        num_key_value_heads=8,
        intermediate_size=128,
        lm_head_type="vocab_parallel",
    ),
    # 1 lane
    "L1-vp-perlane": dict(
        num_lanes=1, num_key_value_heads=2, lm_head_type="vocab_parallel", **PER_LANE
    ),
    "L1-lane-noreduce": dict(
        num_lanes=1, lm_head_type="lane", use_comm=False, use_early_comm=False
    ),
}

# sliding windows smaller than the 20-token sequence (laneformer.md 7)
SLIDING_CASES = {
    "swa-first2-w5": dict(sliding_window=5, sliding_window_n_layers=2),
    "swa-last2-w4": dict(sliding_window=4, sliding_window_n_layers=-2),
    "swa-first3-unclamped1-w3": dict(
        sliding_window=3, sliding_window_n_layers=3, unclamped_layers=[1]
    ),
    "swa-last3-unclamped3-L4-vp-B": dict(
        sliding_window=6,
        sliding_window_n_layers=-3,
        unclamped_layers=[3],
        lm_head_type="vocab_parallel",
        dtp_variant="B",
        **L4,
        **PER_LANE,
    ),
    "swa-last2-layer-types-w3": dict(  # a layer_types list that agrees with the rule
        sliding_window=3,
        sliding_window_n_layers=-2,
        layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"],
    ),
}

LLAMA_CASES = {
    "llama-gqa": dict(),
    "qwen2-bias-tied": dict(model_type="qwen2", tie_word_embeddings=True),
    "mistral-swa-w4": dict(model_type="mistral", sliding_window=4),
}


@pytest.mark.parametrize("kw", LANE_CASES.values(), ids=LANE_CASES.keys())
def test_laneformer_matches_reference(kw):
    cfg = lane_cfg(**kw)
    model = build(cfg, seed=1)
    ref = reference_logits(cfg, model.state_dict(), TOKENS_12)
    diff = max_diff(model_logits(model, TOKENS_12), ref)
    assert diff <= TOL, f"max |model - reference| = {diff:.3g}"


@pytest.mark.parametrize("kw", SLIDING_CASES.values(), ids=SLIDING_CASES.keys())
def test_sliding_window_matches_reference(kw):
    cfg = lane_cfg(**kw)
    assert any(t == "sliding_attention" for t in cfg.layer_types)
    model = build(cfg, seed=2)
    ref = reference_logits(cfg, model.state_dict(), TOKENS_20)
    diff = max_diff(model_logits(model, TOKENS_20), ref)
    assert diff <= TOL, f"max |model - reference| = {diff:.3g}"
    # the window really bites: the same weights without sliding layers give other logits
    full = cfg.with_overrides(sliding_window=None, layer_types=("full_attention",) * cfg.num_layers)
    assert max_diff(reference_logits(full, model.state_dict(), TOKENS_20), ref) > 100 * TOL


@pytest.mark.parametrize("kw", LLAMA_CASES.values(), ids=LLAMA_CASES.keys())
def test_llama_matches_reference(kw):
    cfg = llama_cfg(**kw)
    assert cfg.rope_style == "half"
    model = build(cfg, seed=3)
    sd = model.state_dict()
    if cfg.attention_bias:
        assert sd["model.layers.0.attention.wq.bias"].shape == (1, cfg.q_dim)
        sd = {k: v + 0.3 * torch.randn_like(v) if k.endswith(".bias") else v for k, v in sd.items()}
        model.load_state_dict(sd)
    tokens = TOKENS_20 if cfg.sliding_window else TOKENS_12
    ref = reference_logits(cfg, sd, tokens)
    diff = max_diff(model_logits(model, tokens), ref)
    assert diff <= TOL, f"max |model - reference| = {diff:.3g}"


# --- 1 lane Laneformer == Llama with permuted wq/wk (laneformer.md 4.4) ------------------------
def meta_to_hf_rows(head_dim: int) -> list[int]:
    """New row order inside one head: [0, 2, 4, ..., 1, 3, 5, ...]."""
    return list(range(0, head_dim, 2)) + list(range(1, head_dim, 2))


@pytest.mark.parametrize("head_dim", [2, 4, 8, 96, 128])
def test_interleaved_to_half_permutation(head_dim):
    perm = interleaved_to_half_permutation(head_dim)
    assert [int(p) for p in perm] == meta_to_hf_rows(head_dim)


L1_EQUIV = {
    "delay-ge-layers": dict(broadcast_delay=3),
    "comm-d1": dict(broadcast_delay=1),
    "noreduce": dict(broadcast_delay=1, use_comm=False, use_early_comm=False),
    "comm-d2-B": dict(broadcast_delay=2, dtp_variant="B"),
}


@pytest.mark.parametrize("kw", L1_EQUIV.values(), ids=L1_EQUIV.keys())
def test_one_lane_laneformer_is_llama(kw):
    hd = 8
    lf_cfg = lane_cfg(num_lanes=1, num_hidden_layers=3, num_key_value_heads=2, norm_eps=1e-5, **kw)
    ll_cfg = llama_cfg(num_hidden_layers=3, rms_norm_eps=1e-5)
    assert lf_cfg.head_dim == ll_cfg.head_dim == hd
    assert lf_cfg.rope_style == "interleaved" and ll_cfg.rope_style == "half"
    lf = build(lf_cfg, seed=4)
    ll = Laneformer(ll_cfg).eval()
    lf_sd = lf.state_dict()
    ll_sd = ll.state_dict()
    assert set(lf_sd) == set(ll_sd)
    rows = torch.tensor(meta_to_hf_rows(hd))
    new_sd = {}
    for key, w in lf_sd.items():
        assert ll_sd[key].shape == w.shape, key
        if key.endswith((".wq.weight", ".wk.weight")):
            lanes, out, d = w.shape
            w = w.reshape(lanes, out // hd, hd, d)[:, :, rows, :].reshape(lanes, out, d)
        new_sd[key] = w.clone()
    ll.load_state_dict(new_sd)
    a = model_logits(lf, TOKENS_12)
    b = model_logits(ll, TOKENS_12)
    assert max_diff(a, b) <= TOL
    # the reference agrees with both, and with the unpermuted weights the two conventions differ
    assert max_diff(reference_logits(ll_cfg, new_sd, TOKENS_12), b) <= TOL
    assert max_diff(reference_logits(lf_cfg, lf_sd, TOKENS_12), a) <= TOL
    assert max_diff(reference_logits(ll_cfg, lf_sd, TOKENS_12), a) > 100 * TOL


# --- lane linears are their standard matrices (laneformer.md 3.2) -------------------------------
@pytest.mark.parametrize("lanes", [1, 2, 4])
def test_lane_linear_standard_matrices(lanes):
    g = torch.Generator().manual_seed(lanes)
    n_in, n_out = 16, 24
    x_full = torch.randn(2, 3, n_in, generator=g, dtype=torch.float64)
    # Row: W (L, out/L, in), every lane reads the full input
    w_row = torch.randn(lanes, n_out // lanes, n_in, generator=g, dtype=torch.float64)
    x_b = x_full[:, :, None, :].expand(2, 3, lanes, n_in)
    y = lane_linear(x_b, w_row)
    assert y.shape == (2, 3, lanes, n_out // lanes)
    w_std = torch.empty(n_out, n_in, dtype=torch.float64)
    for r in range(n_out):  # row r = lane r // (out/L), local row r % (out/L)
        w_std[r] = w_row[r // (n_out // lanes), r % (n_out // lanes)]
    assert torch.equal(w_std, w_row.reshape(n_out, n_in))
    torch.testing.assert_close(y.reshape(2, 3, n_out), x_full @ w_std.T, rtol=1e-12, atol=1e-12)
    # Column: W (L, out, in/L), lane l reads its own in/L slice, partials sum to the full product
    w_col = torch.randn(lanes, n_out, n_in // lanes, generator=g, dtype=torch.float64)
    x_s = x_full.reshape(2, 3, lanes, n_in // lanes)
    y = lane_linear(x_s, w_col)
    assert y.shape == (2, 3, lanes, n_out)
    w_std = torch.empty(n_out, n_in, dtype=torch.float64)
    for lane in range(lanes):
        for j in range(n_in // lanes):
            w_std[:, lane * (n_in // lanes) + j] = w_col[lane, :, j]
    torch.testing.assert_close(y.sum(dim=2), x_full @ w_std.T, rtol=1e-12, atol=1e-12)


# --- negative tests: the wiring is exercised (laneformer.md 10) ---------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        dict(broadcast_delay=1, **L4),
        dict(broadcast_delay=2, **PER_LANE, lm_head_type="vocab_parallel"),
    ],
    ids=["L4-d1", "L2-d2-vp"],
)
def test_wrong_wiring_diverges(kw):
    cfg = lane_cfg(**kw)
    model = build(cfg, seed=5)
    sd = model.state_dict()
    out = model_logits(model, TOKENS_12)
    assert max_diff(reference_logits(cfg, sd, TOKENS_12), out) <= TOL
    d = cfg.broadcast_delay
    wrong = {
        "delay+1": cfg.with_overrides(broadcast_delay=d + 1),
        "option B": cfg.with_overrides(dtp_variant="B"),
        "no early comm": cfg.with_overrides(use_early_comm=False),
        "no comm": cfg.with_overrides(use_comm=False),
        "rotate-half RoPE": cfg.with_overrides(rope_style="half"),
    }
    for name, bad in wrong.items():
        diff = max_diff(reference_logits(bad, sd, TOKENS_12), out)
        assert diff > 100 * TOL, f"{name}: reference only {diff:.3g} away from the model"


# --- attention is lane-local (laneformer.md 4.3) -----------------------------------------------
def _capture_attention_inputs(model, layer, tokens):
    captured = {}

    def hook(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs

    handle = model.model.layers[layer].attention.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model_logits(model, tokens)
    finally:
        handle.remove()
    return captured["args"], captured["kwargs"]


@pytest.mark.parametrize("lanes,kv", [(2, 4), (4, 8)])
def test_attention_is_lane_local(lanes, kv):
    cfg = lane_cfg(
        num_lanes=lanes,
        hidden_size=64,
        num_attention_heads=2 * kv,
        num_key_value_heads=kv,
        intermediate_size=128,
        broadcast_delay=1,
        **PER_LANE,
    )
    model = build(cfg, seed=6)
    layer = 2  # past layer: lanes hold different residuals here
    attn = model.model.layers[layer].attention
    args, kwargs = _capture_attention_inputs(model, layer, TOKENS_12)
    x = args[0] if args else kwargs["x"]
    assert x.shape[-2:] == (lanes, cfg.hidden_size)
    assert max_diff(x[..., 0, :], x[..., 1, :]) > 1e-3  # the lanes really differ
    with torch.no_grad():
        base = attn(*args, **kwargs).clone()
        g = torch.Generator().manual_seed(7)
        for k in range(lanes):
            saved = attn.wk.weight.detach().clone(), attn.wv.weight.detach().clone()
            attn.wk.weight[k] += torch.randn(attn.wk.weight[k].shape, generator=g)
            attn.wv.weight[k] += torch.randn(attn.wv.weight[k].shape, generator=g)
            out = attn(*args, **kwargs)
            attn.wk.weight.copy_(saved[0])
            attn.wv.weight.copy_(saved[1])
            for lane in range(lanes):
                diff = max_diff(out[..., lane, :], base[..., lane, :])
                if lane == k:
                    assert diff > 1e-3, f"lane {k}'s own output ignored its wk/wv"
                else:
                    assert diff == 0.0, f"lane {k}'s wk/wv changed lane {lane} by {diff:.3g}"
    # the reference has the same property, derived from the global GQA mapping of laneformer.md 4.3
    sd = {k: v.double() for k, v in model.state_dict().items()}
    prefix = f"model.layers.{layer}"
    xn = [x[0, :, lane, :].double() for lane in range(lanes)]  # the normed attention input
    pos = torch.arange(len(TOKENS_12))
    ref_base = _attention(cfg, sd, prefix + ".attention", xn, pos, None)
    for k in range(lanes):
        sd2 = dict(sd)
        for name in ("wk", "wv"):
            w = sd[f"{prefix}.attention.{name}.weight"].clone()
            w[k] += 1.0
            sd2[f"{prefix}.attention.{name}.weight"] = w
        ref = _attention(cfg, sd2, prefix + ".attention", xn, pos, None)
        for lane in range(lanes):
            changed = max_diff(ref[lane], ref_base[lane]) > 0
            assert changed == (lane == k)
