"""The fused kernels' token axis: S <= 8 tokens of one sequence in one launch.

Each kernel must (1) match its reference (kernels/ref.py, which is the one-token function applied
token by token) and (2) give every token's row the very bits a launch of that token alone gives:
the plain step is the S = 1 case of the verify step, so greedy speculation is plain greedy. (2)
is checked with torch.equal, in fp32 and bf16, on irregular shapes (D not a power of two, head_dim
24 like 96, GQA groups 2 and 4, a wrapped sliding ring, causal attention among the new tokens).
On a machine without CUDA the kernels run in the Triton interpreter; with CUDA the same checks
run compiled (the staged `tests` stage), which is where the layouts' reduction order is proven.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from triton_interp import DEVICE, GPU, triton  # noqa: E402, F401  (first: sets the interpreter)

from expresslane.kernels import ref, tuning  # noqa: E402
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

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16]
S = 4  # tokens per launch (a decode step and 3 drafts)


@dataclass(frozen=True)
class Shape:
    name: str
    lanes: int
    dim: int
    n_q: int
    n_kv: int
    head_dim: int
    ffn: int
    vocab: int
    cap: int  # full-attention slots
    window: int  # sliding window; its ring has window + S - 1 slots (the cache's headroom)
    rope: str

    def __str__(self) -> str:
        return self.name


if GPU:
    SHAPES = [
        Shape("laneformer2b", 8, 3072, 32, 16, 96, 12288, 32000, 4096, 2048, "interleaved"),
        Shape("llama1b", 1, 2048, 32, 8, 64, 8192, 32000, 4096, 2048, "half"),
    ]
    POSITION = 3001  # past the window: the ring has wrapped
else:
    SHAPES = [
        Shape("L2g2", 2, 160, 8, 4, 16, 96, 203, 40, 12, "interleaved"),  # D, F/L = 48
        Shape("L1g4hd24", 1, 96, 4, 1, 24, 80, 101, 40, 12, "half"),  # hd 24: 3 x 8, like 96
    ]
    POSITION = 29  # ring of 15 slots wrapped once
# The interpreter's time goes with programs x launches: the costly tests run each shape in one
# dtype (both dtypes across the shapes); compiled on a GPU every pair runs.
PAIRS = [(s, dt) for s in SHAPES for dt in DTYPES]
if not GPU:
    PAIRS = list(zip(SHAPES, DTYPES, strict=True))


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    if GPU:
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)


def rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def close(actual, expected, dtype, what):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = expected.float().abs().max().clamp_min(1e-6).item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= tol * scale, f"{what}: max_diff={err:.3g} > {tol} * {scale:.3g}"


def rows_equal(batched, lone: list, what: str):
    """Row s of the S-token launch has the bits of the lone launch of token s."""
    for s, row in enumerate(lone):
        assert torch.equal(batched[s], row), f"{what}: row {s} differs from its lone launch"


def weights(s: Shape, dtype):
    L, D, hd = s.lanes, s.dim, s.head_dim

    def lane(o, k):
        return rand(L, o, k, dtype=dtype, scale=k**-0.5)

    return {
        "attention_norm": (1 + 0.2 * torch.randn(L, D, device=DEVICE)).to(dtype),
        "wq": lane(s.n_q * hd // L, D),
        "wk": lane(s.n_kv * hd // L, D),
        "wv": lane(s.n_kv * hd // L, D),
        "wo": lane(D, s.n_q * hd // L),
        "ffn_norm": (1 + 0.2 * torch.randn(D, device=DEVICE)).to(dtype),
        "w1": lane(s.ffn // L, D),
        "w3": lane(s.ffn // L, D),
        "w2": lane(D, s.ffn // L),
    }


def rope(s: Shape, n: int):
    inv = 10000.0 ** (-torch.arange(0, s.head_dim, 2, device=DEVICE).float() / s.head_dim)
    ang = torch.arange(n, device=DEVICE).float()[:, None] * inv[None, :]
    return ang.cos().contiguous(), ang.sin().contiguous()


def cache(s: Shape, dtype, ring: bool, q_pos: int):
    """K/V and positions as a step at q_pos finds them: ring (window + S - 1 slots) or full."""
    cap = s.window + S - 1 if ring else s.cap
    k = rand(cap, s.n_kv, s.head_dim, dtype=dtype)
    v = rand(cap, s.n_kv, s.head_dim, dtype=dtype)
    pos = torch.full((cap,), -1, dtype=torch.int64, device=DEVICE)
    held = torch.arange(max(0, q_pos - cap) if ring else 0, q_pos, device=DEVICE)
    pos[held % cap] = held
    pos[(q_pos - 5) % cap] = -1  # an empty slot among the valid ones
    return k, v, pos


def at(p: int) -> torch.Tensor:
    return torch.tensor([p], dtype=torch.int64, device=DEVICE)


# --- each kernel: S tokens against the reference, and row by row against lone launches --------
@pytest.mark.parametrize("s,dtype", PAIRS, ids=str)
def test_norm_qkv_tokens(s, dtype):
    w = weights(s, dtype)
    cos, sin = rope(s, POSITION + S)
    x = rand(S, s.lanes, s.dim, dtype=dtype)
    base = cache(s, dtype, ring=True, q_pos=POSITION)
    args = (w["attention_norm"], w["wq"], w["wk"], w["wv"], cos, sin)
    kv = [t.clone() for t in base]
    q = norm_qkv(x, *args, at(POSITION), *kv, rope_style=s.rope)
    kv_ref = [t.clone() for t in base]
    close(q, ref.norm_qkv(x, *args, at(POSITION), *kv_ref, rope_style=s.rope), dtype, "q")
    close(kv[0], kv_ref[0], dtype, "k_cache")
    assert torch.equal(kv[2], kv_ref[2])
    lone_kv = [t.clone() for t in base]
    lone = [norm_qkv(x[j], *args, at(POSITION + j), *lone_kv, rope_style=s.rope) for j in range(S)]
    rows_equal(q, lone, "q")
    for got, want, name in zip(kv, lone_kv, ("k", "v", "pos"), strict=True):
        assert torch.equal(got, want), f"{name} cache differs from S lone writes"


ATTENTION = [  # (cache kind, window, num_splits, block_n)
    ("full", None, None, None),
    ("full", None, 3, 16),
    ("ring", "window", None, None),
    ("ring", "window", 1, 16),
    ("full", "half", 2, None),  # a window mask on a full-size cache
]


@pytest.mark.parametrize("s,dtype", PAIRS, ids=str)
@pytest.mark.parametrize("kind,window,splits,block_n", ATTENTION)
def test_attention_tokens(s, dtype, kind, window, splits, block_n):
    """Token j sees the cache and the new tokens 0..j (causal among them), nothing later."""
    k, v, pos = cache(s, dtype, ring=kind == "ring", q_pos=POSITION)
    cap = k.shape[0]
    for j in range(S):  # the new tokens' keys, as norm_qkv leaves them
        pos[(POSITION + j) % cap] = POSITION + j
    win = {"window": s.window, "half": s.window // 2, None: None}[window]
    q = rand(S, s.n_q, s.head_dim, dtype=dtype)
    kw = dict(window=win, num_splits=splits, block_n=block_n)
    out = decode_attention(q, k, v, pos, at(POSITION), **kw)
    close(out, ref.decode_attention(q, k, v, pos, at(POSITION), window=win), dtype, "attention")
    lone = []
    for j in range(S):  # the cache as a lone step of token j finds it: later tokens unwritten
        p = pos.clone()
        p[p > POSITION + j] = -1
        lone.append(decode_attention(q[j], k, v, p, at(POSITION + j), **kw))
    rows_equal(out, lone, "attention")
    again = decode_attention(q, k, v, pos, at(POSITION), **kw)  # the arrival counts were reset
    assert torch.equal(again, out)


@pytest.mark.parametrize("s,dtype", PAIRS[:2], ids=str)
@pytest.mark.parametrize("kind,window,splits", [("full", None, 3), ("ring", "window", 2)])
def test_attention_prefetch_and_combine(s, dtype, kind, window, splits):
    """Prefetching the next K/V tile gives the same bits as loading each where it is used, and
    the combine taken two chunks at a time gives the reference's result and rows that are a lone
    step's bits (its summation order depends on the configuration, never on S)."""
    k, v, pos = cache(s, dtype, ring=kind == "ring", q_pos=POSITION)
    cap = k.shape[0]
    for j in range(S):
        pos[(POSITION + j) % cap] = POSITION + j
    win = {"window": s.window, None: None}[window]
    q = rand(S, s.n_q, s.head_dim, dtype=dtype)
    kw = dict(window=win, num_splits=splits, block_n=16)
    plain = decode_attention(q, k, v, pos, at(POSITION), **kw)
    with tuning.forcing("attention", {"PREFETCH": 1}):
        assert torch.equal(decode_attention(q, k, v, pos, at(POSITION), **kw), plain)
    with tuning.forcing("attention", {"BLOCK_C": 1}):
        narrow = decode_attention(q, k, v, pos, at(POSITION), **kw)
        p = pos.clone()
        p[p > POSITION] = -1
        lone = decode_attention(q[0], k, v, p, at(POSITION), **kw)
    close(narrow, ref.decode_attention(q, k, v, pos, at(POSITION), window=win), dtype, "attn")
    rows_equal(narrow[:1], [lone], "attention, one chunk at a time")


@pytest.mark.parametrize(
    "mode,past,split_k,prefetch,dtype",
    [("past", True, 1, 0, torch.float32), ("past", False, 1, 1, torch.bfloat16),
     ("present", False, 1, 0, torch.bfloat16), ("no_reduce", False, 1, 1, torch.float32),
     ("past", True, 2, 0, torch.bfloat16), ("present", False, 3, 1, torch.float32)],
)  # fmt: skip
def test_gemv_reduce_tokens(mode, past, split_k, prefetch, dtype):
    s = SHAPES[0]  # 2 lanes: the reduce modes differ
    kin = s.ffn // s.lanes
    a = rand(S, s.lanes, kin, dtype=dtype)
    w = rand(s.lanes, s.dim, kin, dtype=dtype, scale=kin**-0.5)
    r = rand(S, s.lanes, s.dim, dtype=dtype)
    pa = rand(S, s.lanes, s.dim, dtype=dtype) if past else None
    with tuning.forcing(f"gemv_reduce_{mode}", {"PREFETCH": prefetch}):
        h, y = gemv_reduce(a, w, r, pa, mode=mode, split_k=split_k)
        lone = [gemv_reduce(a[j], w, r[j], None if pa is None else pa[j], mode=mode,
                            split_k=split_k) for j in range(S)]  # fmt: skip
    h_ref, y_ref = ref.gemv_reduce(a, w, r, pa, mode=mode)
    close(h, h_ref, dtype, "h")
    close(y, y_ref, dtype, "y")
    rows_equal(h, [hj for hj, _ in lone], "h")
    rows_equal(y, [yj for _, yj in lone], "y")


@pytest.mark.parametrize("s,dtype", PAIRS, ids=str)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_swiglu_and_gemv_tokens(s, dtype, prefetch):
    x = rand(S, s.lanes, s.dim, dtype=dtype, scale=3.0)
    nw = (1 + 0.2 * torch.randn(s.dim, device=DEVICE)).to(dtype)
    w1 = rand(s.lanes, s.ffn // s.lanes, s.dim, dtype=dtype, scale=s.dim**-0.5)
    w3 = rand(s.lanes, s.ffn // s.lanes, s.dim, dtype=dtype, scale=s.dim**-0.5)
    with tuning.forcing("norm_swiglu", {"PREFETCH": prefetch}):
        out = norm_swiglu(x, nw, w1, w3)
        rows_equal(out, [norm_swiglu(x[j], nw, w1, w3) for j in range(S)], "swiglu")
    close(out, ref.norm_swiglu(x, nw, w1, w3), dtype, "swiglu")
    with tuning.forcing("lane_gemv", {"PREFETCH": prefetch}):
        y = lane_gemv(w1, x, norm_weight=nw, split_k=2)
        rows_equal(y, [lane_gemv(w1, x[j], norm_weight=nw, split_k=2) for j in range(S)], "gemv")
    close(y, ref.lane_gemv(w1, x, norm_weight=nw), dtype, "lane_gemv")


@pytest.mark.parametrize(
    "head_type,pre_agg,dtype",
    [("replicate", False, torch.float32), ("replicate", True, torch.bfloat16),
     ("lane", False, torch.bfloat16), ("vocab_parallel", False, torch.float32),
     ("vocab_parallel", False, torch.bfloat16)],
)  # fmt: skip
def test_lm_head_tokens(head_type, pre_agg, dtype):
    s = SHAPES[0]
    h = rand(S, s.lanes, s.dim, dtype=dtype, scale=2.0)
    nw = (1 + 0.2 * torch.randn(s.dim, device=DEVICE)).to(dtype)
    if head_type == "vocab_parallel":
        w = rand(s.lanes, triton.cdiv(s.vocab, s.lanes), s.dim, dtype=dtype, scale=s.dim**-0.5)
    else:
        width = s.lanes * s.dim if head_type == "lane" else s.dim
        w = rand(s.vocab, width, dtype=dtype, scale=width**-0.5)
    kw = dict(head_type=head_type, pre_norm_lane_agg=pre_agg)
    logits = lm_head_logits(h, nw, w, **kw)
    close(logits, ref.lm_head_logits(h, nw, w, **kw), dtype, "logits")
    rows_equal(logits, [lm_head_logits(h[j], nw, w, **kw) for j in range(S)], "logits")
    tokens = lm_head_argmax(h, nw, w, **kw)
    assert tokens.shape == (S,) and torch.equal(tokens, logits.argmax(-1))


# --- a whole layer, and the fused step ------------------------------------------------------------
# On a GPU also 2 tokens (a verify of one draft): its 2-row chunks once laid out K otherwise
# than one token's (gemv.block_s); the interpreter has no layouts to differ.
TOKEN_COUNTS = (2, S) if GPU else (S,)


@pytest.mark.parametrize("n", TOKEN_COUNTS)
@pytest.mark.parametrize("s,dtype", PAIRS, ids=str)
def test_layer_rows_equal_lone_steps(s, dtype, n):
    """A sliding layer in "past" mode: n tokens at once against n single-token steps, bitwise,
    and against the reference layer."""
    w = weights(s, dtype)
    cos, sin = rope(s, POSITION + n)
    h = rand(n, s.lanes, s.dim, dtype=dtype)
    pa, pm = rand(n, s.lanes, s.dim, dtype=dtype), rand(n, s.lanes, s.dim, dtype=dtype)
    base = cache(s, dtype, ring=True, q_pos=POSITION)
    kw = dict(reduce_mode="past", window=s.window, rope_style=s.rope)
    kv = [t.clone() for t in base]
    got = fused_decode_layer(h, w, *kv, at(POSITION), cos, sin, past_attn=pa, past_mlp=pm, **kw)
    kv_ref = [t.clone() for t in base]
    want = reference_decode_layer(h, w, *kv_ref, at(POSITION), cos, sin, past_attn=pa,
                                  past_mlp=pm, **kw)  # fmt: skip
    for g, r, name in zip(got, want, ("h", "attention partial", "mlp partial"), strict=True):
        close(g, r, dtype, name)
    kv_lone = [t.clone() for t in base]
    lone = [fused_decode_layer(h[j], w, *kv_lone, at(POSITION + j), cos, sin, past_attn=pa[j],
                               past_mlp=pm[j], **kw) for j in range(n)]  # fmt: skip
    for i, name in enumerate(("h", "attention partial", "mlp partial")):
        rows_equal(got[i], [out[i] for out in lone], name)
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_lone, strict=True))


def test_fused_decoder_forward_rows_equal_decode_steps():
    """FusedDecoder.forward(tokens (S,), position) -> (S, V): its rows are the logits of S
    decode steps bit for bit, next_token of the S tokens picks after the last, and both match
    the model's own forward."""
    import tiny

    from expresslane.cache import KVCache
    from expresslane.sampling.params import SamplingParams
    from expresslane.step.fused import FusedDecoder

    model = tiny.laneformer(seed=3, sliding_window=4, num_hidden_layers=2,
                            sliding_window_n_layers=1).to(DEVICE)  # fmt: skip
    prompt, drafts = [1, 5, 9, 13, 17, 21], torch.tensor([7, 30, 4], device=DEVICE)
    logits, params = {}, SamplingParams(temperature=0.0)
    for name in ("verify", "steps"):
        cache = KVCache(model.cfg, 16, DEVICE, torch.float32, headroom=len(drafts) - 1)
        with torch.no_grad():
            model(torch.tensor([prompt], device=DEVICE), cache=cache)
        dec = FusedDecoder(model, cache, kernels=True)
        p = len(prompt)
        if name == "verify":
            logits[name] = dec.forward(drafts, at(p))
            last = dec.next_token(drafts, at(p), params, None)  # the same KV written again
        else:
            logits[name] = torch.stack([dec.forward(drafts[j : j + 1], at(p + j))[0]
                                        for j in range(len(drafts))])  # fmt: skip
    assert torch.equal(logits["verify"], logits["steps"])
    assert last.item() == logits["verify"][-1].argmax().item()
    with torch.no_grad():
        full = model(torch.tensor([prompt + drafts.tolist()], device=DEVICE))[0, -len(drafts) :]
    close(logits["verify"], full.float(), torch.float32, "fused forward vs model forward")
    with pytest.raises(ValueError, match="at most 8"):
        dec.forward(torch.zeros(9, dtype=torch.long, device=DEVICE), at(0))
    with pytest.raises(ValueError, match="headroom >= 2"):  # the ring would lose token 0's keys
        FusedDecoder(model, KVCache(model.cfg, 16, DEVICE, torch.float32)).forward(drafts, at(0))


def test_tuning_table_is_read_at_load(tmp_path, monkeypatch):
    """A GPU's table (kernels/tuning/<gpu>.json, the sweep's winners) replaces the default
    configuration of the kernel and shape it names; another GPU or shape keeps the default;
    a forced variant goes over both. The chosen tiles give the same bits here."""
    from expresslane.kernels import gemv

    s = SHAPES[0]
    key = tuning.shape_key(L=s.lanes, O=s.ffn // s.lanes, K=s.dim)
    doc = {"gpu": "NVIDIA H200", "kernels": {"norm_swiglu": {key: {"BLOCK_O": 4}}}}
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(doc))
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    tuning.table.cache_clear()
    default = {"BLOCK_O": 8, "PREFETCH": 0}
    x = rand(2, s.lanes, s.dim, dtype=torch.float32)
    nw = torch.ones(s.dim, device=DEVICE)
    w1 = rand(s.lanes, s.ffn // s.lanes, s.dim, dtype=torch.float32)
    plain = norm_swiglu(x, nw, w1, w1)
    try:
        monkeypatch.setitem(gemv.PLANNED_GPU, "name", "NVIDIA H200")
        assert tuning.choose("norm_swiglu", x, key, default) == {"BLOCK_O": 4, "PREFETCH": 0}
        assert tuning.choose("norm_swiglu", x, "L9-O9-K9", default) == default
        with tuning.watching() as seen:
            tabled = norm_swiglu(x, nw, w1, w1)
        assert ("norm_swiglu", key) in seen and torch.equal(tabled, plain)
        with tuning.forcing("norm_swiglu", {"BLOCK_O": 16}):
            assert tuning.choose("norm_swiglu", x, key, default)["BLOCK_O"] == 16
        monkeypatch.setitem(gemv.PLANNED_GPU, "name", "NVIDIA A100")  # no table: defaults
        assert tuning.choose("norm_swiglu", x, key, default) == default
    finally:
        tuning.table.cache_clear()
