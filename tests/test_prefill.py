"""Prefill: SDPA's causal forms against explicit masks, chunks against the cache-free forward.

`model.causal_attention` (queries the last S of T keys: SDPA's causal mask when T == S, its
bottom-right causal bias after a cached prefix) equals attention under the explicit mask in
float64, on irregular shapes and GQA groups, in fp32 and from bf16 inputs (fp32 accumulation:
within the output's bf16 rounding). The engine's prefill, in chunks of every size, after a
reused prefix, with rings that the chunks cross, gives the last logits of the cache-free
forward; a prompt up to the default chunk is one pass over the weights. On a GPU the same runs
in bf16 (marked `gpu`: the session's tests stage), where the fused kernels take these paths.
"""

from __future__ import annotations

import pytest
import tiny
import torch
import torch.nn.functional as F

from expresslane.engine import Engine
from expresslane.model import attend, causal_attention, visible_mask, windowed_attention
from expresslane.sampling.params import SamplingParams

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
MODELS = {
    "laneformer": {},  # two rings of 16, then a full layer; GQA 8/4 over 4 lanes
    "llama": dict(model_type="llama", num_lanes=1, sliding_window=None, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, hidden_size=48),
}  # fmt: skip
pytestmark = pytest.mark.usefixtures("one_thread")


def masked_reference(q, k, v):
    """float64 attention of q (B, S, H, hd) over k/v (B, T, H_kv, hd), query i seeing keys
    0..T-S+i: the explicit mask, heads repeated. -> (B, H, S, hd)."""
    S, T, H, Hkv = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, S, T)
    qpos = torch.arange(T - S, T, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(T, device=q.device)[None, :] > qpos, float("-inf"))
    return scores.softmax(-1) @ v


SHAPES = [  # (B, S, cached, H, H_kv, hd)
    (1, 17, 0, 6, 2, 24),
    (1, 29, 7, 5, 5, 40),
    (2, 50, 33, 8, 1, 24),
    (1, 23, 61, 4, 2, 64),
]


def qkv(B, S, cached, H, Hkv, hd, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    T = S + cached
    q, k, v = (torch.randn(B, n, h, hd, generator=g) for n, h in ((S, H), (T, Hkv), (T, Hkv)))
    return (x.to(device=device, dtype=dtype) for x in (q, k, v))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_causal_attention_equals_the_explicit_mask(shape):
    q, k, v = qkv(*shape)
    ref = masked_reference(q, k, v)
    assert (causal_attention(q, k, v).double() - ref).abs().max() < 1e-5
    S, T = q.shape[1], k.shape[1]
    visible = torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]
    assert (attend(q, k, v, visible).double() - ref).abs().max() < 1e-5  # the mask path
    assert (attend(q, k, v, None).double() - ref).abs().max() < 1e-5
    if T > S:  # off CUDA the mask is the one torch's bottom-right causal bias materialises
        from torch.nn.attention.bias import causal_lower_right

        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        biased = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(S, T),
                                                enable_gqa=q.shape[2] != k.shape[2])  # fmt: skip
        assert torch.equal(causal_attention(q, k, v), biased)


def bf16_bound(ref: torch.Tensor) -> float:
    """Two bf16 roundings of the largest output (the inputs are exact in bf16 already)."""
    return 2 * 2.0**-8 * ref.abs().max().item()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_causal_attention_from_bf16_accumulates_in_fp32(shape):
    q, k, v = qkv(*shape, dtype=torch.bfloat16)
    ref = masked_reference(q, k, v)  # the same bf16 values, in float64
    out = causal_attention(q, k, v)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < bf16_bound(ref)


@pytest.mark.parametrize(
    "S, old, window, H, Hkv",
    [(40, 0, 9, 6, 2), (57, 16, 16, 4, 4), (33, 13, 13, 8, 2), (70, 21, 20, 5, 1)],
)
def test_windowed_attention_equals_the_full_mask(S, old, window, H, Hkv):
    """Blocks of `window` queries over a ring of older keys (shuffled, some slots empty) then
    the chunk's own keys: the same as one attention under the whole (S, T) mask."""
    g = torch.Generator().manual_seed(S)
    start = 3 * old + 5  # positions before the chunk
    ring = torch.arange(start - old, start)[torch.randperm(old, generator=g)]
    if old:
        ring[0] = -1  # an empty slot
    positions = torch.arange(start, start + S)
    kpos = torch.cat((ring, positions))
    q, k, v = qkv(1, S, old, H, Hkv, 24, seed=S)
    ref = attend(q, k, v, visible_mask(positions, kpos, window))
    got = windowed_attention(q, k, v, positions, kpos, window)
    assert (got - ref).abs().max() < 1e-5


@pytest.fixture(scope="module")
def models():
    return {name: tiny.laneformer(seed=i, **kw) for i, (name, kw) in enumerate(MODELS.items())}


def last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device=next(model.parameters()).device))[0, -1].float()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("chunk", [17, 30, 2048])
def test_chunked_prefill_equals_the_forward(models, name, chunk):
    """Chunks past 16 tokens (the SDPA forms), crossing the rings, then a reused prefix with 23
    new tokens (the bottom-right causal bias in full layers)."""
    model = models[name]
    eng = Engine(model, max_model_len=160, prefill_chunk=chunk, decode="eager")
    g = torch.Generator().manual_seed(chunk)
    prompt = torch.randint(3, 64, (71,), generator=g).tolist()
    logits = eng.prefill(prompt)
    assert (logits.float() - last_logits(model, prompt)).abs().max() < 1e-4
    longer = prompt + torch.randint(3, 64, (23,), generator=g).tolist()
    logits = eng.prefill(longer)
    assert eng.stats.cached_tokens > 16  # a reused prefix, not a cold prefill
    assert (logits.float() - last_logits(model, longer)).abs().max() < 1e-4


def test_a_prompt_up_to_the_default_chunk_is_one_pass(models):
    """The weights are read once for the whole prompt (a chunk is one forward)."""
    model = models["llama"]
    passes = []
    hook = model.register_forward_pre_hook(lambda mod, args: passes.append(args[0].shape[1]))
    try:
        eng = Engine(model, max_model_len=2100, decode="eager")
        tokens = list(eng.generate([5] * 2000, SamplingParams(max_tokens=2)))
    finally:
        hook.remove()
    assert len(tokens) == 2 and passes == [2000, 1]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_causal_attention_on_the_gpu_in_bf16(shape):
    """The fused kernels (flash for plain causal, the bottom-right bias with repeated heads)."""
    q, k, v = qkv(*shape, dtype=torch.bfloat16, device="cuda")
    ref = masked_reference(q, k, v)
    assert (causal_attention(q, k, v).double() - ref).abs().max() < bf16_bound(ref)
    S, T = q.shape[1], k.shape[1]
    visible = (torch.arange(T)[None, :] <= torch.arange(T - S, T)[:, None]).cuda()
    assert (attend(q, k, v, visible).double() - ref).abs().max() < bf16_bound(ref)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_on_the_gpu_equals_the_cpu(models, name):
    """bf16 on the GPU: the same greedy pick and logits near the fp32 forward on the CPU."""
    model = models[name]
    gpu_model = tiny.laneformer(seed=list(MODELS).index(name), **MODELS[name])
    gpu_model = gpu_model.to("cuda", torch.bfloat16)
    prompt = torch.randint(3, 64, (94,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = last_logits(model, prompt)
    eng = Engine(gpu_model, max_model_len=160, prefill_chunk=30, decode="eager")
    eng.prefill(prompt[:71])
    got = eng.prefill(prompt).float().cpu()
    assert eng.stats.cached_tokens > 16
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
