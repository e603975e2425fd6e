"""Short prompt chunks prefilled through the packed CPU step (step/prefill.py StepPrefill).

Against the model's forward on the same weights: the last position's logits, the cache the
decode steps then read (keys and values to fp32 rounding, positions exactly) and the greedy
tokens, for a Llama and for a Mistral whose ring is smaller than the prompt (chunks bounded by
the ring's headroom); the long chunks through the model's layers and the step's head (fp32
weights: the forward's cache bit for bit; quantized ones: bf16 products, the C decoder's weights
against the reference's bit for bit), every-row logits and hooked models through the forward.
"""

from __future__ import annotations

import json

import pytest
import tiny
import torch

from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.step.native import MAX_TOKENS, available, native_step_built
from expresslane.step.prefill import BF16_PRODUCTS, LOWP_BY_DTYPE, StepPrefill
from expresslane.weights.packed_modules import products_in
from expresslane.weights.packing import pack_model

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not native_step_built(), reason="the C step is not built"),
]
MODELS = {
    "llama": dict(model_type="llama", num_lanes=1, sliding_window=None, num_hidden_layers=2),
    "mistral": dict(model_type="mistral", num_lanes=1, num_hidden_layers=2,
                    layer_types=["sliding_attention", "full_attention"]),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return tiny.laneformer(seed=7, **MODELS[request.param])


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engines(model, **kw):
    """(through the step, through the forward): the same packed weights and step."""
    a = Engine(model, max_model_len=128, decode="graph", **kw)
    b = Engine(model, max_model_len=128, decode="graph", **kw)
    assert isinstance(a._prefill, StepPrefill)
    b._prefill.max_tokens = 0  # never the step
    return a, b


def same_cache(a, b, tol: float = 1e-5) -> None:
    """The same positions, and keys and values at them to `tol` (0: bit for bit)."""
    for pa, pb, ka, kb, va, vb in zip(a.pos, b.pos, a.k, b.k, a.v, b.v, strict=True):
        assert torch.equal(pa, pb)
        held = pa >= 0
        torch.testing.assert_close(ka[held], kb[held], rtol=tol, atol=tol)
        torch.testing.assert_close(va[held], vb[held], rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [1, 5, 23, 40])
def test_short_prompts_through_the_step_equal_the_forward(model, n):
    a, b = engines(model)
    calls = []
    real = a._prefill.step.prefill_logits
    a._prefill.step.prefill_logits = lambda t, p, lowp: (calls.append(t.numel()), real(t, p, lowp))[
        1
    ]
    ids = prompt(n, seed=n)
    la, lb = a.prefill(ids), b.prefill(ids)
    assert calls == [n]  # the whole prompt in one call of the step
    torch.testing.assert_close(la.float(), lb.float(), rtol=1e-4, atol=1e-4)
    same_cache(a.cache, b.cache)
    assert a.cache.length == b.cache.length == n and a.cache.tokens == ids
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert list(a.generate(ids, params)) == list(b.generate(ids, params))


def test_a_ring_smaller_than_the_prompt_in_chunks_of_its_headroom(model):
    """Rings of exactly `window` slots: one token a call keeps every window whole."""
    a, b = engines(model, ring_headroom=0)
    step = a._prefill.step
    rings = any(a.cache.windows)
    assert step.prefill_chunk() == (1 if rings else MAX_TOKENS)
    ids = prompt(40, seed=3)  # longer than the tiny window (16)
    torch.testing.assert_close(a.prefill(ids).float(), b.prefill(ids).float(), rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    same_cache(a.cache, b.cache)


def test_long_chunks_every_row_and_hooks_go_through_the_forward(model):
    a, _ = engines(model)
    a._prefill.max_tokens = 8
    used = []
    real = a._prefill.step.prefill_logits
    a._prefill.step.prefill_logits = lambda t, p, lowp: (used.append(t.numel()), real(t, p, lowp))[
        1
    ]
    a.prefill(prompt(9))  # one past the bound
    assert used == []
    a.cache.reset()
    assert a.prompt_logprobs(prompt(5)).shape == (5, 64)  # every row: the forward
    assert used == []
    hits = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *args: hits.append(1))
    try:
        a.cache.reset()
        a.prefill(prompt(5))
    finally:
        hook.remove()
    assert hits and used == []  # a hooked model runs its own forward
    a.cache.reset()
    a.prefill(prompt(5))
    assert used == [5]


def test_long_prompts_run_the_layers_then_the_steps_head(model):
    """fp32 weights: the layers are the forward's own (the cache bit for bit), the head the
    step's C head (the logits to fp32 rounding), and greedy decoding goes on the same."""
    a, b = engines(model)
    a._prefill.max_tokens = 8
    assert a._prefill.products is None and a._prefill.layers_alone
    heads = []
    real = a._prefill.step.head_logits
    a._prefill.step.head_logits = lambda h: (heads.append(h.shape), real(h))[1]
    ids = prompt(30, seed=5)
    la, lb = a.prefill(ids), b.model(torch.tensor([ids]), None, b.cache, True).view(-1)
    assert heads == [(1, 1, model.cfg.hidden_size)]  # the last row only
    torch.testing.assert_close(la.float(), lb.float(), rtol=1e-4, atol=1e-4)
    same_cache(a.cache, b.cache, tol=0)
    assert a.cache.length == b.cache.length == 30


@pytest.mark.parametrize("biases", [False, True])
def test_quantized_long_prompts_are_exact_by_default(biases):
    """Q8_0 weights, fp32 products (the default): the C decoder's weights are the reference's
    bit for bit, so the layers write the fp32 forward's cache bit for bit (with qwen2's
    attention biases too)."""
    kw = dict(MODELS["llama"], model_type="qwen2", attention_bias=True) if biases else {}
    model = tiny.laneformer(seed=11, **(kw or MODELS["llama"]))
    pack_model(model, "q8_0")
    a, b = engines(model)
    a._prefill.max_tokens = 8
    assert a._prefill.products is None
    ids = prompt(33, seed=2)
    la = a.prefill(ids)
    with torch.inference_mode():
        lb = b.model(torch.tensor([ids]), None, b.cache, True).view(-1)
    same_cache(a.cache, b.cache, tol=0)
    torch.testing.assert_close(la.float(), lb.float(), rtol=1e-4, atol=1e-4)  # the C head


def test_q8_0_prompts_near_the_forward_and_a_decodes_bits_only_without_tiles():
    """Q8_0 weights: a prompt's chunk through the step runs in AMX tiles where the CPU has them
    (csrc/cpu_amx_blocks.c, EL_PROMPT): its logits and cache as near the fp32 forward's as the
    vpdpbusd kernel's; the cache is the bits of the same tokens decoded one at a time (that
    kernel's, which decode steps keep) only where there are no tiles."""
    from expresslane.step.native import FEATURES, HAS_AMX

    model = tiny.laneformer(seed=11, **MODELS["llama"])
    pack_model(model, "q8_0")
    a, b = engines(model)
    a._prefill.max_tokens = MAX_TOKENS
    ids = prompt(33, seed=6)
    la = a.prefill(ids).float().view(-1)
    with torch.inference_mode():
        lb = b.model(torch.tensor([ids]), None, b.cache, True).float().view(-1)
    torch.testing.assert_close(la, lb, rtol=1e-3, atol=1e-3)
    same_cache(a.cache, b.cache, tol=1e-3)
    c, _ = engines(model)
    for i, t in enumerate(ids):  # one token a call: below prompt_min, the decode kernel
        c._prefill.step.prefill_logits(torch.tensor([t]), i)
    c.cache.advance(len(ids))
    held = a.cache.pos[0] >= 0
    bits = all(torch.equal(x[held], y[held]) for x, y in zip(a.cache.k, c.cache.k, strict=True))
    assert bits == (not FEATURES & HAS_AMX)


@pytest.mark.skipif(not available("bfloat16"), reason="no AVX512_BF16: products stay fp32")
def test_prefill_dtype_bfloat16_multiplies_in_bf16_with_the_c_decoders_weights():
    """Q8_0 weights, `prefill_dtype="bfloat16"`: the cache equals the forward's under the same
    bf16 products with the reference's weights, bit for bit; the logits stay within bf16's
    rounding of the fp32 forward's, and outside the block the products are fp32 again."""
    model = tiny.laneformer(seed=11, **MODELS["llama"])
    pack_model(model, "q8_0")
    a, b = engines(model, prefill_dtype="bfloat16")
    a._prefill.max_tokens = 8
    assert a._prefill.products == torch.bfloat16
    ids = prompt(33, seed=2)
    la = a.prefill(ids)
    with torch.inference_mode(), products_in(torch.bfloat16):  # the reference's dequantize
        h = b.model.hidden(torch.tensor([ids]), None, b.cache)
    same_cache(a.cache, b.cache, tol=0)
    assert torch.equal(la.view(-1), b._prefill.step.head_logits(h[0, -1:].float()).view(-1))
    b.cache.reset()
    with torch.inference_mode():
        fp32 = b.model(torch.tensor([ids]), None, b.cache, True).float().view(-1)
    assert 0 < (la.float() - fp32).abs().max() < 0.05 * fp32.abs().max()
    b.cache.reset()
    with torch.inference_mode():
        again = b.model(torch.tensor([ids]), None, b.cache, True).float().view(-1)
    assert torch.equal(again, fp32)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
def test_prefill_dtype_int8_is_the_forward_with_each_products_input_rounded_per_block(
    fmt, monkeypatch
):
    """`prefill_dtype="int8"`: a prompt through the step with 8-bit activations is the model's
    fp32 forward with every layer product's input rounded to 8 bits per 32-value block
    (llama.cpp's q8_0 activations): logits and cache to fp32's rounding; not the exact
    prefill's."""
    from expresslane.step.native import lowp_activations
    from expresslane.weights import packed_modules

    model = tiny.laneformer(seed=13, **MODELS["llama"])
    pack_model(model, fmt)
    a, b = engines(model, prefill_dtype="int8")
    a._prefill.max_tokens = MAX_TOKENS
    assert a._prefill.lowp and a._prefill.products == (
        torch.bfloat16 if available("bfloat16") else None)  # fmt: skip
    ids = prompt(33, seed=4)
    la = a.prefill(ids).float().view(-1)
    own, head = packed_modules.PackedProj.forward, set(model.lm_head.modules())

    def rounded(self, x):  # the layers' products, not the head's
        return own(self, x if self in head else lowp_activations(x, fmt))

    with monkeypatch.context() as m, torch.inference_mode():
        m.setattr(packed_modules.PackedProj, "forward", rounded)
        lb = b.model(torch.tensor([ids]), None, b.cache, True).float().view(-1)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    same_cache(a.cache, b.cache, tol=1e-4)
    exact = Engine(model, max_model_len=128, decode="graph")
    exact._prefill.max_tokens = MAX_TOKENS
    assert not exact._prefill.lowp
    assert not torch.equal(exact.prefill(ids).float().view(-1), la)  # 8 bits, not 16


def test_the_main_format_is_the_one_holding_most_of_the_layers_bytes():
    model = tiny.laneformer(seed=3, **MODELS["llama"])
    weights = pack_model(model, "q8_0")
    assert weights.layers_format == "q8_0"
    w2 = weights.layers[0].w2
    weights.layers[0].w2 = type(w2)("q4_1", *w2.parts)  # one matrix of another name: not main
    assert weights.layers_format == "q8_0"
    weights.layers[0].w2 = w2


def test_products_follow_the_request_and_the_weights_formats():
    """bf16 products only when asked for, where every format is quantized, bf16 or fp16 (not
    fp32) and the CPU has bf16 dot products; an unknown prefill_dtype is refused by name."""
    from types import SimpleNamespace

    from expresslane.errors import RequestError

    def products(*formats, dtype=torch.bfloat16):
        weights = SimpleNamespace(formats=set(formats), layers_format=formats[0])
        step = SimpleNamespace(weights=weights, cache=None)
        return StepPrefill(None, step, products=dtype).products

    bf16 = torch.bfloat16 if available("bfloat16") else None
    assert products("q4_k", "q6_k") == products("q8_0", "bfloat16") == bf16
    assert products("q4_k", dtype=torch.float32) is None  # the default: fp32
    assert products("float32") is None and products("q8_0", "float32") is None
    assert products("float16") == products("q8_0", "float16") == bf16  # fp16: asked for
    assert "float32" not in BF16_PRODUCTS
    with pytest.raises(RequestError, match="prefill_dtype"):
        Engine(tiny.laneformer(seed=1, **MODELS["llama"]), max_model_len=32, prefill_dtype="fp8")


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel", ""])
def test_the_bound_follows_the_products_and_the_weights_formats(monkeypatch, vendor):
    """The measured crossings (step/prefill.py STEP_PREFILL_MAX, Intel's entries over it on an
    Intel CPU): by the products and each format, a mix taking its smallest, or with AMX tiles
    its main format's (the first listed here)."""
    from types import SimpleNamespace

    from expresslane.step import prefill

    monkeypatch.setattr(prefill, "cpu_info", lambda field: vendor)
    amx = bool(prefill.FEATURES & prefill.HAS_AMX)
    table = prefill.step_prefill_max(vendor, amx)

    def bound(*formats, dtype=torch.float32, lowp=frozenset()):
        weights = SimpleNamespace(formats=set(formats), layers_format=formats[0])
        step = SimpleNamespace(weights=weights, cache=None)
        return StepPrefill(None, step, products=dtype, lowp=lowp).max_tokens

    def want(key, *formats):
        return min(table[key].get(f, table[key][None]) for f in (formats[:1] if amx else formats))

    fp32 = table[None]
    for formats in [("float32",), ("q8_0",), ("q4_k",), ("q6_k",), ("q4_k", "q8_0"),
                    ("q4_k", "q6_k"), ("q6_k", "q4_k")]:  # fmt: skip
        assert bound(*formats) == want(None, *formats), formats
    assert bound("float32") == fp32["float32"] < bound("q4_k") == fp32.get("q4_k", fp32[None])
    if available("bfloat16"):
        assert bound("q4_k", dtype=torch.bfloat16) == want(torch.bfloat16, "q4_k") < bound("q4_k")
        assert bound("q8_0", dtype=torch.bfloat16) == want(torch.bfloat16, "q8_0")
        assert bound("float32", dtype=torch.bfloat16) == fp32["float32"]  # fp32 weights: fp32
    every = LOWP_BY_DTYPE["int8"]  # the low-precision step's
    assert bound("q4_k", dtype=torch.bfloat16, lowp=every) == want("lowp", "q4_k")
    assert bound("q4_k", "q6_k", dtype=torch.bfloat16, lowp=every) == want("lowp", "q4_k", "q6_k")
    assert bound("float32", lowp=every) == fp32["float32"]  # nothing of the step's would change
    if available("bfloat16"):
        assert bound("bfloat16") == want(None, "bfloat16")
        assert bound("bfloat16", lowp=every) == want("lowp", "bfloat16")


def test_intel_takes_its_measured_crossings_and_the_others_elsewhere():
    from expresslane.step.prefill import (
        INTEL_STEP_PREFILL_MAX,
        STEP_PREFILL_MAX,
        step_prefill_max,
    )

    assert step_prefill_max("AuthenticAMD") is STEP_PREFILL_MAX
    intel = step_prefill_max("GenuineIntel")
    assert intel.keys() == STEP_PREFILL_MAX.keys()
    for key, row in STEP_PREFILL_MAX.items():
        mine = INTEL_STEP_PREFILL_MAX.get(key, {})
        assert intel[key] == {**row, **mine} and all(intel[key][f] == n for f, n in mine.items())
    assert intel[None][None] < STEP_PREFILL_MAX[None][None]  # the 4- to 6-bit formats' fp32


def test_amx_tiles_take_bf16_and_int8_prompts_further_through_the_step():
    """Where the bf16 products run in AMX tiles, their crossings over the vendor's table; the
    other formats' as they were."""
    from expresslane.step.prefill import AMX_STEP_PREFILL_MAX, step_prefill_max

    for vendor in ("GenuineIntel", "AuthenticAMD"):
        plain, tiles = step_prefill_max(vendor), step_prefill_max(vendor, amx=True)
        for key, row in plain.items():
            assert tiles[key] == {**row, **AMX_STEP_PREFILL_MAX.get(key, {})}
        assert tiles[None]["bfloat16"] > plain[None]["bfloat16"]
        assert tiles["lowp"]["bfloat16"] > plain["lowp"]["bfloat16"]
        for key in (None, torch.bfloat16):  # int8-row's products and Q8_0 prompts in tiles
            for fmt in ("int8", "q8_0"):  # AMD's vpdpbusd step crossed Q8_0's at 768 too
                was = plain[key].get(fmt, plain[key][None])
                assert tiles[key][fmt] > was or (vendor, fmt) == ("AuthenticAMD", "q8_0")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_which_steps_take_x_at_llama_cpps_precision(dtype):
    """int8: every step with a block format or bf16 weights; bfloat16: bf16 weights only, and
    not beside a block format (a Q8_0 matrix would otherwise take 8 bits); float32: none."""
    from types import SimpleNamespace

    def lowp(*formats):
        weights = SimpleNamespace(formats=set(formats), layers_format=formats[0])
        step = SimpleNamespace(weights=weights, cache=None)
        return StepPrefill(None, step, lowp=LOWP_BY_DTYPE[dtype]).lowp

    blocks, bf16 = available("q8_0"), available("bfloat16")
    assert lowp("q4_k", "q6_k") == (dtype == "int8" and blocks)
    assert lowp("bfloat16") == (dtype != "float32" and bf16)
    assert lowp("bfloat16", "q8_0") == (dtype == "int8" and blocks and bf16)
    assert not lowp("float32") and not lowp("float16", "int8")  # nothing that would change


def test_cpu_prefill_bench_refuses_bad_counts(capsys):
    from expresslane.bench import cpu_prefill

    assert cpu_prefill.main(["--lengths", "0"]) == 2
    assert "cpu_prefill:" in capsys.readouterr().err
    assert cpu_prefill.main(["/no/such/model.gguf"]) == 2  # the message, not a traceback
    assert "no such folder or file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's refusal, exit code 2
        cpu_prefill.main(["model.gguf", "--quantization", "int4"])
    assert e.value.code == 2


def test_cpu_prefill_bench_hands_its_quantization_to_the_engine(monkeypatch, capsys):
    from expresslane.bench import cpu_prefill

    seen = []
    monkeypatch.setattr(cpu_prefill, "measure", lambda *a: seen.append(a) or [])
    assert cpu_prefill.main(["m.gguf", "--lengths", "4", "--quantization", "int8-row"]) == 0
    assert cpu_prefill.main(["m.gguf", "--lengths", "4"]) == 0
    assert [a[-1] for a in seen] == ["int8-row", None]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == []


def test_logprob_requests_decode_through_the_step(model):
    """A logprobs request on the static step decodes through it, not the model's forward (on a
    packed CPU model that forward dequantizes every block per token: 3.6 against 154 tok/s for
    SmolLM2 Q4_K_M): the tokens of the same request without logprobs, and logprobs that are
    the log-softmax of the step's own logits."""
    eng = Engine(model, max_model_len=128, decode="graph")
    ids = prompt(60, seed=11)  # past the prefill bound: the prefill's one forward call
    eng._prefill.max_tokens = 16
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        lp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
        steps = list(eng.generate_steps(ids, lp))
    finally:
        hook.remove()
    assert len(calls) == 1  # the prefill; every decode step went through the step
    plain = list(eng.generate(ids, SamplingParams(max_tokens=10, ignore_eos=True)))
    assert [s.token for s in steps] == plain
    for s in steps:
        assert s.logprob <= 0 and len(s.top_logprobs) == 3
        assert s.top_logprobs[0] == (s.token, s.logprob)  # greedy: the chosen is the top one
