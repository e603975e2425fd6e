"""Every decode kernel against its reference in expresslane/kernels/ref.py.

On a machine without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set
below before triton is imported) on small, deliberately irregular shapes: non-power-of-two D and
F/L, 1/2/4 lanes, head_dim 16 and 32, GQA group 2, a wrapped sliding-window ring, empty and stale
cache slots. With CUDA the same checks run compiled, on Laneformer-2B shapes (D=3072, L=8,
hd=96, Hq=32, Hkv=16, F=12288, V=32000) and on a 1-lane Llama-like shape.
Tolerances: max |kernel - ref| <= tol * max |ref|, tol 1e-4 (fp32) and 2e-2 (bf16; the
interpreter truncates bf16 where the GPU rounds to nearest).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from triton_interp import DEVICE, GPU, triton  # noqa: E402, F401  (first: sets the interpreter)

from expresslane.kernels import ref, use_triton  # noqa: E402
from expresslane.kernels.decode_attention import decode_attention  # noqa: E402
from expresslane.kernels.decode_step import (  # noqa: E402
    fused_decode_layer,
    reference_decode_layer,
)
from expresslane.kernels.gemv import lane_gemv  # noqa: E402
from expresslane.kernels.gemv_reduce import gemv_reduce  # noqa: E402
from expresslane.kernels.lm_head import lm_head_argmax, lm_head_logits  # noqa: E402
from expresslane.kernels.norm_qkv import norm_qkv  # noqa: E402
from expresslane.kernels.swiglu import norm_swiglu  # noqa: E402

pytestmark = pytest.mark.gpu  # with CUDA, every test here runs compiled on 2B / 1B shapes
DTYPES = [torch.float32, torch.bfloat16]


@dataclass(frozen=True)
class Shape:
    name: str
    lanes: int
    dim: int
    n_q: int  # query heads
    n_kv: int  # KV heads
    head_dim: int
    ffn: int  # F (all lanes)
    vocab: int  # V for replicate/lane heads (vocab_parallel uses V rounded to lanes)
    max_len: int  # full-attention cache slots
    window: int  # sliding window = ring slots
    rope: str

    def __str__(self) -> str:
        return self.name


if GPU:
    SHAPES = [
        Shape("laneformer2b", 8, 3072, 32, 16, 96, 12288, 32000, 4096, 2048, "interleaved"),
        Shape("llama1b", 1, 2048, 32, 8, 64, 8192, 32000, 4096, 2048, "half"),
    ]
    POSITIONS = (700, 3001)  # short context; sliding ring wrapped
else:
    SHAPES = [
        Shape("L1", 1, 128, 4, 2, 32, 96, 203, 40, 12, "half"),  # D = 96 + 32
        Shape("L2", 2, 160, 8, 4, 16, 96, 203, 40, 12, "interleaved"),  # D, F/L = 48 irregular
        Shape("L4", 4, 96, 8, 4, 16, 192, 203, 40, 12, "interleaved"),
    ]
    POSITIONS = (7, 29)  # ring not yet full; ring wrapped twice


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    if GPU:  # the fp32 references must not run in TF32 or reduce in bf16
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(
            torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False
        )
    torch.manual_seed(0)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = actual.float(), expected.float()
    scale = e.abs().max().clamp_min(1e-6).item()
    err = (a - e).abs().max().item()
    assert err <= tol * scale, f"{what}: max_diff={err:.3g} > {tol} * max|ref|={scale:.3g}"


# --- random inputs ---------------------------------------------------------------------------
def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def lane_weight(lanes, out, k, dtype):
    return rand(lanes, out, k, dtype=dtype, scale=k**-0.5)  # outputs of order 1


def norm_weight(s: Shape, per_lane: bool, dtype):
    shape = (s.lanes, s.dim) if per_lane else (s.dim,)
    return (1.0 + 0.2 * torch.randn(*shape, device=DEVICE)).to(dtype)


def rope_tables(s: Shape, max_pos: int):
    inv = 10000.0 ** (-torch.arange(0, s.head_dim, 2, device=DEVICE).float() / s.head_dim)
    ang = torch.arange(max_pos, device=DEVICE).float()[:, None] * inv[None, :]  # (P, hd/2)
    return ang.cos().contiguous(), ang.sin().contiguous()


def filled_cache(s: Shape, dtype, cap: int, q_pos: int, ring: bool):
    """Random K/V with the positions a decode at q_pos sees before writing its own slot."""
    k = rand(cap, s.n_kv, s.head_dim, dtype=dtype)
    v = rand(cap, s.n_kv, s.head_dim, dtype=dtype)
    pos = torch.full((cap,), -1, dtype=torch.int64, device=DEVICE)
    held = torch.arange(max(0, q_pos - cap + 1) if ring else 0, q_pos, device=DEVICE)
    pos[held % cap] = held
    if q_pos > 3:
        pos[(q_pos - 3) % cap] = -1  # an empty slot inside the valid range
    if not ring and q_pos + 2 < cap:
        pos[q_pos + 2] = q_pos + 2  # stale future entry: must be masked by causality
    return k, v, pos


def layer_weights(s: Shape, dtype, per_lane_norm: bool):
    L, D, hd = s.lanes, s.dim, s.head_dim
    return {
        "attention_norm": norm_weight(s, per_lane_norm, dtype),
        "wq": lane_weight(L, s.n_q * hd // L, D, dtype),
        "wk": lane_weight(L, s.n_kv * hd // L, D, dtype),
        "wv": lane_weight(L, s.n_kv * hd // L, D, dtype),
        "wo": lane_weight(L, D, s.n_q * hd // L, dtype),
        "ffn_norm": norm_weight(s, per_lane_norm, dtype),
        "w1": lane_weight(L, s.ffn // L, D, dtype),
        "w3": lane_weight(L, s.ffn // L, D, dtype),
        "w2": lane_weight(L, D, s.ffn // L, dtype),
    }


def clone_all(*ts):
    return [t.clone() for t in ts]


# --- tests -------------------------------------------------------------------------------------
def test_use_triton(monkeypatch):
    cpu = torch.zeros(1)
    assert use_triton(cpu)  # forced by the fixture
    monkeypatch.delenv("EXPRESSLANE_FORCE_TRITON")
    assert not use_triton(cpu)
    if GPU:
        assert use_triton(cpu.cuda())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize("norm,split_k", [(None, 1), ("shared", 2), ("lane", 3)])
def test_lane_gemv(s, dtype, norm, split_k):
    x = rand(s.lanes, s.dim, dtype=dtype)
    w = lane_weight(s.lanes, s.ffn // s.lanes, s.dim, dtype)
    nw = None if norm is None else norm_weight(s, norm == "lane", dtype)
    got = lane_gemv(w, x, norm_weight=nw, split_k=split_k)
    assert_close(got, ref.lane_gemv(w, x, norm_weight=nw), dtype, "lane_gemv")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "ring"])
def test_norm_qkv(s, dtype, sliding):
    w = layer_weights(s, dtype, per_lane_norm=sliding)  # both norm kinds across the params
    cap = s.window if sliding else s.max_len
    q_pos = POSITIONS[1] if sliding else POSITIONS[0]
    cos, sin = rope_tables(s, s.max_len)
    position = torch.tensor([q_pos], dtype=torch.int64, device=DEVICE)
    h = rand(s.lanes, s.dim, dtype=dtype)
    cache = filled_cache(s, dtype, cap, q_pos, ring=sliding)
    rope_style = s.rope if not sliding else ("half" if s.rope == "interleaved" else "interleaved")
    outs = []  # the ring case also splits each head over several programs (block_p=4)
    for fn, block_p in ((norm_qkv, 4 if sliding else None), (ref.norm_qkv, None)):
        k, v, pos = clone_all(*cache)
        q = fn(h, w["attention_norm"], w["wq"], w["wk"], w["wv"], cos, sin, position, k, v, pos,
               eps=1e-5, rope_style=rope_style, block_p=block_p)  # fmt: skip
        outs.append((q, k, v, pos))
    (q_r, k_r, v_r, pos_r) = outs[-1]
    for q, k, v, pos in outs[:-1]:
        assert_close(q, q_r, dtype, "q")
        assert_close(k, k_r, dtype, "k_cache")
        assert_close(v, v_r, dtype, "v_cache")
        assert torch.equal(pos, pos_r), "pos_cache"
    assert pos_r[q_pos % cap].item() == q_pos


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize(
    "kind,q_idx,num_splits",
    [("full", 1, 3), ("ring", 0, None), ("ring", 1, 1), ("windowed", 1, 2)],
)
def test_decode_attention(s, dtype, kind, q_idx, num_splits):
    q_pos = POSITIONS[q_idx]
    if kind == "ring":  # sliding layer: cap = W, slot = pos % W
        cap, window = s.window, s.window
    elif kind == "windowed":  # full-size cache, window mask only
        cap, window = s.max_len, s.window // 2
    else:
        cap, window = s.max_len, None
    k, v, pos = filled_cache(s, dtype, cap, q_pos, ring=kind == "ring")
    pos[q_pos % cap] = q_pos  # the query's own key, as norm_qkv leaves it
    q = rand(s.n_q, s.head_dim, dtype=dtype)
    position = torch.tensor([q_pos], dtype=torch.int64, device=DEVICE)
    got = decode_attention(q, k, v, pos, position, window=window, num_splits=num_splits)
    assert_close(got, ref.decode_attention(q, k, v, pos, position, window=window), dtype, "attn")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize(
    "mode,with_past,split_k",
    [("past", True, 1), ("past", False, 1), ("present", False, 1), ("no_reduce", False, 1),
     ("past", True, 2), ("present", False, 3)],
)  # fmt: skip
def test_gemv_reduce(s, dtype, mode, with_past, split_k):
    k_in = s.ffn // s.lanes
    a = rand(s.lanes, k_in, dtype=dtype)
    w = lane_weight(s.lanes, s.dim, k_in, dtype)
    r = rand(s.lanes, s.dim, dtype=dtype)
    past = rand(s.lanes, s.dim, dtype=dtype) if with_past else None
    h, y = gemv_reduce(a, w, r, past, mode=mode, split_k=split_k)
    h_ref, y_ref = ref.gemv_reduce(a, w, r, past, mode=mode)
    assert_close(y, y_ref, dtype, "partial y")
    assert_close(h, h_ref, dtype, f"h ({mode})")
    if mode == "present":  # every lane holds the same residual update
        assert_close(h - r, (h - r)[:1].expand_as(h), dtype, "present lanes agree")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize("per_lane", [False, True], ids=["shared", "lane"])
def test_norm_swiglu(s, dtype, per_lane):
    x = rand(s.lanes, s.dim, dtype=dtype, scale=3.0)
    nw = norm_weight(s, per_lane, dtype)
    w1 = lane_weight(s.lanes, s.ffn // s.lanes, s.dim, dtype)
    w3 = lane_weight(s.lanes, s.ffn // s.lanes, s.dim, dtype)
    assert_close(norm_swiglu(x, nw, w1, w3), ref.norm_swiglu(x, nw, w1, w3), dtype, "swiglu")


HEADS = [  # (head_type, per-lane final norm, pre_norm_lane_agg)
    ("replicate", False, False),
    ("replicate", True, False),
    ("replicate", False, True),
    ("lane", True, False),
    ("vocab_parallel", False, False),
    ("vocab_parallel", True, False),
]


def head_inputs(s: Shape, dtype, head_type, per_lane_norm):
    h = rand(s.lanes, s.dim, dtype=dtype, scale=2.0)
    nw = norm_weight(s, per_lane_norm, dtype)
    if head_type == "vocab_parallel":
        w = lane_weight(s.lanes, triton.cdiv(s.vocab, s.lanes), s.dim, dtype)
    elif head_type == "lane":
        w = rand(s.vocab, s.lanes * s.dim, dtype=dtype, scale=(s.lanes * s.dim) ** -0.5)
    else:
        w = rand(s.vocab, s.dim, dtype=dtype, scale=s.dim**-0.5)
    return h, nw, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
@pytest.mark.parametrize("head_type,per_lane_norm,pre_agg", HEADS)
def test_lm_head(s, dtype, head_type, per_lane_norm, pre_agg):
    h, nw, w = head_inputs(s, dtype, head_type, per_lane_norm)
    kw = dict(head_type=head_type, eps=1e-5, pre_norm_lane_agg=pre_agg)
    logits = lm_head_logits(h, nw, w, **kw)
    logits_ref = ref.lm_head_logits(h, nw, w, **kw)
    assert logits.dtype == torch.float32
    assert_close(logits, logits_ref, dtype, f"logits ({head_type})")
    token = lm_head_argmax(h, nw, w, **kw)
    assert token.shape == (1,) and token.dtype == torch.int64
    # Same in-kernel arithmetic as the logits kernel: bitwise the same choice.
    assert token.item() == torch.argmax(logits).item()
    top2 = logits_ref.topk(2).values
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if (top2[0] - top2[1]).item() > tol * logits_ref.abs().max().item():
        assert token.item() == ref.lm_head_argmax(h, nw, w, **kw).item()


@pytest.mark.parametrize("chunk", [None, 1, 2])
@pytest.mark.parametrize("head_type", ["replicate", "vocab_parallel"])
def test_argmax_ties_pick_lowest_index(head_type, chunk, monkeypatch):
    """The lowest index of the tied maxima, whether the combine reads every block's pair at
    once or a few at a time (chunk 1: every tie meets in one slot)."""
    from expresslane.kernels import lm_head as head

    if chunk:
        monkeypatch.setattr(head, "COMBINE_MAX", chunk)
    s = SHAPES[-1]
    h, nw, w = head_inputs(s, torch.float32, head_type, False)
    rows = w.view(-1, s.dim)  # (V, D) in global vocab order for both head types
    xn = ref._head_input(h, nw, head_type, 1e-5, False).view(-1, s.dim)[-1]  # the last lane
    if head_type == "vocab_parallel":  # make the tied rows live in the last lane's slice
        vl = w.shape[1]
        lo, hi = (s.lanes - 1) * vl + 2, (s.lanes - 1) * vl + vl - 1
    else:
        lo, hi = 3, s.vocab - 2  # different blocks of the grid
    # One non-zero column: every summation order gives bitwise the same, dominant logit.
    c = xn.abs().argmax()
    rows[lo] = 0.0
    rows[lo, c] = 100.0 * xn[c].sign()
    rows[hi] = rows[lo + 1] = rows[lo]  # ties across blocks and inside one block
    token = lm_head_argmax(h, nw, w, head_type=head_type)
    assert token.item() == lo == ref.lm_head_argmax(h, nw, w, head_type=head_type).item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_fused_decode_layer(s, dtype):
    """Two consecutive tokens through a sliding layer (present, then past with the first step's
    partials as stand-ins for layer i-d's), then the greedy head on the result."""
    per_lane = s.lanes > 1
    w = layer_weights(s, dtype, per_lane_norm=per_lane)
    cos, sin = rope_tables(s, s.max_len)
    q0 = POSITIONS[1] - 1
    cache = filled_cache(s, dtype, s.window, q0, ring=True)
    state = {"fused": (rand(s.lanes, s.dim, dtype=dtype), *clone_all(*cache), None, None)}
    state["ref"] = tuple(t.clone() if t is not None else None for t in state["fused"])
    for step in range(2):
        position = torch.tensor([q0 + step], dtype=torch.int64, device=DEVICE)
        mode = "present" if step == 0 else "past"
        for name, fn in (("fused", fused_decode_layer), ("ref", reference_decode_layer)):
            h, k, v, pos, a_past, m_past = state[name]
            h, a, m = fn(h, w, k, v, pos, position, cos, sin, reduce_mode=mode,
                         past_attn=a_past, past_mlp=m_past, window=s.window, eps=1e-5,
                         rope_style=s.rope)  # fmt: skip
            state[name] = (h, k, v, pos, a, m)
        (h, k, v, pos, a, m), (h_r, k_r, v_r, pos_r, a_r, m_r) = state["fused"], state["ref"]
        assert_close(h, h_r, dtype, f"h step {step}")
        assert_close(a, a_r, dtype, f"attention partial step {step}")
        assert_close(m, m_r, dtype, f"mlp partial step {step}")
        assert_close(k, k_r, dtype, "k_cache")
        assert_close(v, v_r, dtype, "v_cache")
        assert torch.equal(pos, pos_r)
    if dtype == torch.float32:  # greedy equality after the layer (bf16 may tie within tol)
        head = lane_weight(s.lanes, triton.cdiv(s.vocab, s.lanes), s.dim, dtype)
        nw = norm_weight(s, per_lane, dtype)
        got = lm_head_argmax(h, nw, head, head_type="vocab_parallel")
        want = ref.lm_head_argmax(h_r, nw, head, head_type="vocab_parallel")
        assert got.item() == want.item()


def test_wrappers_reject_bad_inputs():
    s = SHAPES[0]
    x = rand(s.lanes, s.dim, dtype=torch.float32)
    w = lane_weight(s.lanes, 8, s.dim, torch.float32)
    with pytest.raises(AssertionError, match="dtype"):
        lane_gemv(w.to(torch.bfloat16), x)
    with pytest.raises(AssertionError, match="contiguous"):
        lane_gemv(w.transpose(1, 2).contiguous().transpose(1, 2), x)
    with pytest.raises(AssertionError, match="mode"):
        gemv_reduce(x, lane_weight(s.lanes, s.dim, s.dim, torch.float32), x, None, mode="sum")
    assert math.isfinite(lane_gemv(w, x).sum().item())


@pytest.mark.parametrize("family", ["laneformer", "qwen3"])
def test_engine_with_fused_kernels_equals_reference_generate(monkeypatch, family):
    """The whole decode step on the kernels (interpreted here) gives the model's greedy tokens:
    a Laneformer with a sliding ring, and a qwen3 (q/k norms, attention biases added)."""
    import tiny

    from expresslane.engine import Engine
    from expresslane.generation import reference_generate
    from expresslane.sampling.params import SamplingParams

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    kw = dict(sliding_window=4)
    if family == "qwen3":
        kw = dict(model_type="qwen3", num_lanes=1, sliding_window=None, head_dim=16,
                  num_attention_heads=4, num_key_value_heads=2, attention_bias=True)  # fmt: skip
    model = tiny.laneformer(seed=2, max_position_embeddings=64, **kw).to(DEVICE)
    prompt = [1, 5, 9, 13, 17]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = reference_generate(model, prompt, params, stop_ids=set())
    engine = Engine(model, max_model_len=16, decode="graph", kernels="on", steps_per_replay=2)
    assert engine.step_name == "fused kernels" and engine.step.kernels
    assert list(engine.generate(prompt, params)) == expected


def test_speculation_on_the_fused_kernels_is_the_plain_fused_step(monkeypatch):
    """The verify runs the fused step over k + 1 rows (kernels interpreted here): greedy output
    is the plain fused step's, token for token (the GPU's test_speculative asserts it there)."""
    import tiny

    from expresslane.engine import Engine
    from expresslane.sampling.params import SamplingParams
    from expresslane.speculative.drafting import SpeculativeConfig

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    model = tiny.laneformer(seed=2, sliding_window=4, max_position_embeddings=64).to(DEVICE)
    prompt = [1, 5, 9, 1, 5, 9, 1]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = Engine(model, max_model_len=24, decode="graph", kernels="on")
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    engine = Engine(model, max_model_len=24, decode="graph", kernels="on", speculative=spec)
    assert engine.step.kernels
    assert list(engine.generate(prompt, params)) == list(plain.generate(prompt, params))
    assert engine.stats.extra["speculative"]["verify_steps"] > 0
