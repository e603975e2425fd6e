"""A KV cache in 16 bits (--kv-cache-dtype float16 / bfloat16) against its references.

- The C step's cache write rounds each key and value as torch's `.to(dtype)` does, bit for bit.
- The C step on a half cache equals the Python layer and the model's own forward on a cache of
  the same dtype (which round the same keys and values), to fp32 summation order; a verify across
  an attention chunk boundary keeps the bits of lone steps.
- Through the engine: greedy tokens equal the eager forward's on the same cache dtype, the cache
  takes half the bytes, and a dtype that is not built, or not the model's on a GPU, is refused
  naming the flag.
"""

from __future__ import annotations

import pytest
import torch
from test_packed_step import llama
from test_packed_verify import prompt_then_new

from expresslane.cache import KV_CACHE_DTYPES, KVCache, cache_dtype
from expresslane.engine import Engine
from expresslane.errors import RequestError
from expresslane.sampling.params import SamplingParams
from expresslane.step import native
from expresslane.step.packed import PackedDecoder
from expresslane.weights.packing import pack_model

HALF = [torch.float16, torch.bfloat16]
needs_c = pytest.mark.skipif(not native.available("float32"), reason="C kernels not built here")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def gqa_llama(head_dim: int, window: int | None = None):
    """GQA 6/2 with head_dim 16 (the generic loop) or 64 (the unrolled one), odd widths."""
    over = dict(max_position_embeddings=256, num_attention_heads=6, num_key_value_heads=2,
                hidden_size=6 * head_dim, intermediate_size=88)  # fmt: skip
    if window is not None:
        over.update(model_type="mistral", sliding_window=window)
    model = llama(seed=7, **over)
    pack_model(model, "float32")
    return model


def steps(model, dtype, prompt, native_step: bool) -> tuple[torch.Tensor, KVCache]:
    """The packed step fed `prompt` token by token: (logits (S, V), its cache)."""
    cache = KVCache(model.cfg, max_len=200, dtype=dtype)
    dec = PackedDecoder(model, cache, native=native_step)
    assert (dec.step is not None) == native_step
    with torch.no_grad():
        rows = []
        for i, t in enumerate(prompt):
            cache.live = i + 1
            rows.append(dec.forward(torch.tensor([t]), torch.tensor([i])))
    return torch.cat(rows), cache


PROMPT = [(5 * i + 2) % 67 for i in range(70)]  # past one 64-slot attention chunk


@needs_c
@pytest.mark.parametrize("dtype", HALF)
def test_the_c_cache_write_rounds_as_torch_does(dtype):
    """Layer 0's keys and values do not depend on attention, so the C step's half cache must be
    its fp32 cache rounded by torch, bit for bit (ties to even, bf16 included)."""
    model = gqa_llama(16)
    _, full = steps(model, torch.float32, PROMPT, True)
    _, half = steps(model, dtype, PROMPT, True)
    n = len(PROMPT)
    assert half.k[0].dtype == dtype
    assert torch.equal(half.k[0][:n], full.k[0][:n].to(dtype))
    assert torch.equal(half.v[0][:n], full.v[0][:n].to(dtype))


@needs_c
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim,window", [(16, None), (64, None), (16, 9)])
def test_c_step_on_a_half_cache_equals_the_python_layer_and_the_forward(dtype, head_dim, window):
    """Each computes the keys in its own fp32 order, so now and then a key rounds to the next
    16-bit value in one and not the other: the logits agree to 5e-5 of their largest, where a
    misread cache (a wrong stride or conversion) is off by the logits' own size."""
    model = gqa_llama(head_dim, window)
    c_logits, _ = steps(model, dtype, PROMPT, True)
    py_logits, _ = steps(model, dtype, PROMPT, False)
    cache = KVCache(model.cfg, max_len=200, dtype=dtype)
    with torch.no_grad():
        forward = model(torch.tensor([PROMPT]), cache=cache)[0]
    tol = 5e-5 * c_logits.abs().max().item()
    torch.testing.assert_close(c_logits, py_logits, rtol=0, atol=tol)
    torch.testing.assert_close(c_logits, forward, rtol=0, atol=tol)
    # and the rounding is there: an fp32 cache's logits are further off than those flips
    fp32_logits, _ = steps(model, torch.float32, PROMPT, True)
    assert (fp32_logits - c_logits).abs().max() > 2 * (c_logits - py_logits).abs().max()


@needs_c
@pytest.mark.parametrize("dtype", HALF)
def test_a_verify_on_a_half_cache_has_the_bits_of_lone_steps(dtype):
    """7 tokens across the chunk boundary at 128 slots, in one call and one by one."""
    model = gqa_llama(16)
    prompt, new = [(7 * i + 3) % 67 for i in range(124)], [5, 9, 30, 7, 7, 12, 3]

    def run(one_call: bool) -> torch.Tensor:
        cache = KVCache(model.cfg, max_len=200, dtype=dtype, headroom=len(new))
        return prompt_then_new(PackedDecoder(model, cache), cache, prompt, new, one_call)

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_engine_greedy_on_a_half_cache_is_the_eager_forwards_and_half_the_bytes(name):
    model = gqa_llama(16)
    prompt = [(3 * i + 1) % 67 for i in range(40)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    auto = Engine(model, max_model_len=128)
    step = Engine(model, max_model_len=128, kv_cache_dtype=name)
    eager = Engine(model, max_model_len=128, kv_cache_dtype=name, decode="eager")
    assert step.cache.k[0].dtype == KV_CACHE_DTYPES[name] == eager.cache.k[0].dtype
    assert step.cache.nbytes * 2 == auto.cache.nbytes
    assert list(step.generate(prompt, params)) == list(eager.generate(prompt, params))


def test_a_cache_dtype_that_is_not_built_or_not_the_models_on_a_gpu_is_refused():
    with pytest.raises(RequestError, match="kv_cache_dtype='fp8'.*auto, float32"):
        cache_dtype("fp8", torch.float32, torch.device("cpu"))
    with pytest.raises(RequestError, match="on cuda the cache takes the model's dtype .bfloat16"):
        cache_dtype("float16", torch.bfloat16, torch.device("cuda"))
    assert cache_dtype("bfloat16", torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert cache_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    with pytest.raises(RequestError) as err:
        Engine(gqa_llama(16), max_model_len=64, kv_cache_dtype="int8")
    assert err.value.param == "kv_cache_dtype"


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_speculation_and_prefix_reuse_on_a_half_cache_keep_plain_greedy(name):
    """Drafts verified on the half cache, and a second prompt sharing the first's prefix, give
    the tokens of plain decoding from an empty cache of the same dtype."""
    from expresslane.speculative.drafting import SpeculativeConfig

    model = gqa_llama(16)
    prompt = [(3 * i + 1) % 11 + 3 for i in range(30)]  # repeats: prompt lookup finds drafts
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain = Engine(model, max_model_len=128, kv_cache_dtype=name, decode="graph")
    spec = Engine(model, max_model_len=128, kv_cache_dtype=name, decode="graph",
                  speculative=SpeculativeConfig(4, 3, 1))  # fmt: skip
    want = list(plain.generate(prompt, params))
    assert list(spec.generate(prompt, params)) == want
    assert spec.stats.extra["speculative"]["accepted_tokens"] > 0
    longer = prompt + want[:8]
    fresh = Engine(model, max_model_len=128, kv_cache_dtype=name, decode="graph")
    assert list(plain.generate(longer, params)) == list(fresh.generate(longer, params))
    assert plain.stats.cached_tokens > 0
