"""The fused step's Llama-family extras: qwen2's attention biases and qwen3's q/k norms.

norm_qkv adds the biases to its rounded products and, for q/k norms, has the last program of a
head normalise the whole head (kernels/qk_norm.py). Checked as test_kernels_tokens.py checks the
kernels: against kernels/ref.py, every row bitwise equal to its lone launch, and the fused step
against the model's forward; in the Triton interpreter here, compiled where CUDA is.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_tokens import (  # noqa: E402  (first: it sets the interpreter)
    DEVICE,
    PAIRS,
    POSITION,
    S,
    at,
    cache,
    close,
    rand,
    rope,
    rows_equal,
    weights,
)

from expresslane.cache import KVCache  # noqa: E402
from expresslane.kernels import ref  # noqa: E402
from expresslane.kernels.norm_qkv import norm_qkv  # noqa: E402
from expresslane.kernels.qk_norm import _SCRATCH  # noqa: E402
from expresslane.step.fused import FusedDecoder  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    if torch.cuda.is_available():
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)


@pytest.mark.parametrize("s,dtype", PAIRS, ids=str)
@pytest.mark.parametrize("block_p", [None, 2], ids=["head", "split"])
def test_norm_qkv_biases_and_qk_norms(s, dtype, block_p):
    """qwen2's biases and qwen3's q/k norms: against the reference, and every row the bits of
    its lone launch, with a head whole in one program or split over several (the last of them
    to finish normalises it); the arrival counts are left at 0 for the next launch."""
    w = weights(s, dtype)
    cos, sin = rope(s, POSITION + S)
    x = rand(S, s.lanes, s.dim, dtype=dtype)
    base = cache(s, dtype, ring=True, q_pos=POSITION)
    args = (w["attention_norm"], w["wq"], w["wk"], w["wv"], cos, sin)
    biases = tuple(rand(*w[n].shape[:2], dtype=dtype, scale=0.5) for n in ("wq", "wk", "wv"))
    norms = tuple((1 + 0.3 * torch.randn(s.head_dim, device=DEVICE)).to(dtype) for _ in "qk")
    kw = dict(rope_style=s.rope, biases=biases, qk_norms=norms, block_p=block_p)
    kv, kv_ref, lone_kv = ([t.clone() for t in base] for _ in range(3))
    q = norm_qkv(x, *args, at(POSITION), *kv, **kw)
    close(q, ref.norm_qkv(x, *args, at(POSITION), *kv_ref, **kw), dtype, "q")
    for got, want, name in zip(kv, kv_ref, ("k", "v"), strict=False):
        close(got, want, dtype, f"{name}_cache")
    plain = norm_qkv(x, *args, at(POSITION), *[t.clone() for t in base], rope_style=s.rope)
    assert not torch.allclose(q.float(), plain.float(), atol=1e-3), "biases and norms unused"
    lone = [norm_qkv(x[j], *args, at(POSITION + j), *lone_kv, **kw) for j in range(S)]
    rows_equal(q, lone, "q")
    for got, want, name in zip(kv, lone_kv, ("k", "v", "pos"), strict=True):
        assert torch.equal(got, want), f"{name} cache differs from S lone writes"
    assert all(not counts.any() for _, counts in _SCRATCH.values()), "arrival counts left set"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_decoder_runs_qwen_layers(family):
    """qwen2 (attention biases) and qwen3 (q/k norms) on the fused step: its logits are the
    model's forward's, and a verify's rows are the bits of decode steps."""
    import tiny  # after test_kernels_tokens has set the interpreter

    kw = dict(attention_bias=True) if family == "qwen2" else dict(head_dim=16)
    model = tiny.laneformer(seed=4, model_type=family, num_lanes=1, sliding_window=None,
                            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                            hidden_size=48, **kw).to(DEVICE)  # fmt: skip
    assert model.cfg.attention_bias or model.cfg.qk_norm
    prompt, drafts = [1, 5, 9, 13], torch.tensor([7, 30, 4], device=DEVICE)
    logits = {}
    for name in ("verify", "steps"):
        cache = KVCache(model.cfg, 16, DEVICE, torch.float32)
        with torch.no_grad():
            model(torch.tensor([prompt], device=DEVICE), cache=cache)
        dec, p = FusedDecoder(model, cache, kernels=True), len(prompt)
        if name == "verify":
            logits[name] = dec.forward(drafts, at(p))
        else:
            logits[name] = torch.stack([dec.forward(drafts[j : j + 1], at(p + j))[0]
                                        for j in range(len(drafts))])  # fmt: skip
    assert torch.equal(logits["verify"], logits["steps"])
    with torch.no_grad():
        full = model(torch.tensor([prompt + drafts.tolist()], device=DEVICE))[0, -len(drafts) :]
    close(logits["verify"], full.float(), torch.float32, f"{family}: fused vs model forward")
