"""The packed step with S tokens (step/packed.py, csrc/cpu_matmul.c) against its references.

- The S-token products give, token by token, the bits of the single-token products (every
  format, odd shapes, lanes, S = 2..9 and past a call's 32 tokens, 1 and 2 threads).
- A verify of S = 1..9 tokens equals the model's own forward on the same packed storage (every
  format, lanes and DTP reduces, GQA, biases, a ring that wraps; the C layers and the Python
  path), and on the C path each row has the bits of S single-token steps, cache included.
- Through the engine, greedy speculative output equals plain greedy decoding of the packed step
  exactly (the C path and the Python layer with lanes), and a ring after rejected drafts gives
  the logits of a fresh forward.
"""

from __future__ import annotations

import pytest
import torch
from test_packed_step import MODELS, PROMPT, llama
from test_speculative import prompts
from test_speculative_runs import continuation_logits, use_oracle

from expresslane.cache import KVCache
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.step import native as cpu_kernels
from expresslane.step.packed import PackedDecoder
from expresslane.weights.packing import pack_model
from expresslane.weights.quant import FORMATS, quantize

GGUF_FORMATS = ("q8_0", "q4_1")  # those quantize() writes; the others: test_gguf_blocks.py
ALL = (*FORMATS, *GGUF_FORMATS)
needs = {
    fmt: pytest.mark.skipif(
        not cpu_kernels.available(fmt),
        reason=f"C kernels for {fmt}: not built, or this CPU lacks their instructions",
    )
    for fmt in ALL
}
NEW = [5, 9, 30, 7, 7, 12, 3, 44, 2]  # the tokens a verify scores after PROMPT


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


def ring_llama(**over):
    """One lane, GQA, head_dim 16, K % 32 == 0 (GGUF blocks), a 6-slot window that wraps."""
    cfg = dict(seed=11, model_type="mistral", sliding_window=6, num_hidden_layers=3,
               hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96)  # fmt: skip
    return llama(**{**cfg, **over})


# --- products -------------------------------------------------------------------------------
SHAPES = [(37, 70), (3, 45, 33), (130, 576), (9, 1)]
BLOCK_SHAPES = [(37, 96), (3, 5, 32), (130, 576), (7, 224)]  # K % 32 == 0


@pytest.mark.parametrize(
    "fmt", [pytest.param(f, marks=needs[f]) for f in ALL]
)  # fmt: skip
def test_s_token_products_are_the_single_token_bits(fmt):
    g = torch.Generator().manual_seed(len(fmt))
    before = torch.get_num_threads()
    try:
        for shape in BLOCK_SHAPES if fmt in GGUF_FORMATS else SHAPES:
            q = quantize(torch.randn(shape, generator=g) * 2, fmt)
            for S in (2, 3, 5, 6, 7, 8, 9, 12, 16, 17, 37, 41):  # blocks of 8, 5s; AMX of 16
                x = torch.randn((S, *shape[:-2], shape[-1]), generator=g)
                x[..., 0] = 25.0  # an outlier: the integer formats scale to it
                torch.set_num_threads(1 + S % 2)
                want = torch.stack([cpu_kernels.native_matvec(q, x[s]) for s in range(S)])
                got = cpu_kernels.native_matmul(q, x)
                assert torch.equal(got, want), (shape, S, (got - want).abs().max().item())
    finally:
        torch.set_num_threads(before)


# --- one verify step against the forward ------------------------------------------------------
def _verify(model, native, n_new):
    """(forward logits of the n_new tokens after PROMPT, verify logits, cache after the verify)."""
    tokens = torch.tensor([PROMPT + NEW[:n_new]])
    with torch.no_grad():
        full = model(tokens)[0, len(PROMPT) :]
        cache = KVCache(model.cfg, max_len=40, headroom=len(NEW))
        dec = PackedDecoder(model, cache, native=native)
        model(torch.tensor([PROMPT]), cache=cache)  # the prefill, by the model itself
        got = dec.forward(torch.tensor(NEW[:n_new]), torch.tensor([len(PROMPT)]))
    return full, got, dec


def _tolerance(fmt, full):
    """fp32 up to summation order; the C kernels round x to 16 bits (bf16 parts, or 16-bit
    fixed point for the integer formats: far below the int8 weights' own rounding)."""
    scale = full.abs().max().item()
    return {"float32": 1e-4, "float16": 1e-4, "bfloat16": 1e-4 * scale}.get(fmt, 2e-3 * scale)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_equals_the_forward_on_the_same_weights(name, fmt):
    model = MODELS[name]()
    pack_model(model, fmt)
    for n_new in (1, 4, 9):
        full, got, dec = _verify(model, None, n_new)
        torch.testing.assert_close(got, full, rtol=1e-4, atol=_tolerance(fmt, full))
    if name == "llama-tied":  # the one-lane model: the C layers (where built) and Python
        full, got, dec = _verify(model, False, 7)
        assert dec.step is None
        torch.testing.assert_close(got, full, rtol=1e-4, atol=_tolerance(fmt, full) + 1e-4)


def prompt_then_new(dec, cache, prompt, new, one_call: bool) -> torch.Tensor:
    """The prompt by plain steps, then the logits of `new`: one verify call (live bound None,
    as the verify step reads), or a plain step each (live bound its own position + 1)."""
    with torch.no_grad():
        for i, t in enumerate(prompt):
            cache.live = i + 1
            dec.forward(torch.tensor([t]), torch.tensor([i]))
        p = len(prompt)
        if one_call:
            cache.live = None
            return dec.forward(torch.tensor(new), torch.tensor([p]))
        rows = []
        for j, t in enumerate(new):
            cache.live = p + j + 1
            rows.append(dec.forward(torch.tensor([t]), torch.tensor([p + j])))
        return torch.cat(rows)


@pytest.mark.parametrize("fmt", [pytest.param(f, marks=needs[f]) for f in ALL])
def test_c_verify_rows_are_the_bits_of_single_steps(fmt):
    """S tokens in one call (a ring that wraps, GQA) against S packed decode steps on another
    cache: identical logits and caches, for S = 1..9; and both close to the forward."""
    model = ring_llama()
    pack_model(model, fmt)
    for S in (1, 2, 6, 9):
        out = []
        for one_call in (False, True):
            cache = KVCache(model.cfg, max_len=40, headroom=S)
            dec = PackedDecoder(model, cache)
            assert dec.step is not None
            out.append((prompt_then_new(dec, cache, PROMPT, NEW[:S], one_call), cache))
        (a, ca), (b, cb) = out
        assert torch.equal(a, b), (S, (a - b).abs().max().item())
        for i in range(len(ca.k)):
            assert torch.equal(ca.pos[i], cb.pos[i])
            assert torch.equal(ca.k[i], cb.k[i]) and torch.equal(ca.v[i], cb.v[i])
    full = _verify(model, None, 9)
    torch.testing.assert_close(full[1], full[0], rtol=1e-4, atol=_tolerance(fmt, full[0]))


def test_long_verify_goes_in_chunks():
    model = ring_llama(num_hidden_layers=2, max_position_embeddings=128)
    pack_model(model)
    n = cpu_kernels.MAX_TOKENS + 5
    tokens = [3 + (7 * i) % 60 for i in range(n)]
    with torch.no_grad():
        full = model(torch.tensor([PROMPT + tokens]))[0, len(PROMPT) :]
        cache = KVCache(model.cfg, max_len=64, headroom=n)
        model(torch.tensor([PROMPT]), cache=cache)
        got = PackedDecoder(model, cache).forward(torch.tensor(tokens), torch.tensor([len(PROMPT)]))
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


# --- through the engine -----------------------------------------------------------------------
def spec(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize("fmt", ["float32", pytest.param("int8", marks=needs["int8"])])
def test_greedy_speculation_is_plain_packed_decoding_bit_for_bit(fmt):
    """The C path: a verify's rows are the plain step's bits, so no flip at all, k = 1..8."""
    model = ring_llama(max_position_embeddings=256, vocab_size=64)
    pack_model(model, fmt)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain_engine = Engine(model, max_model_len=128, decode="graph")
    drafted = kept = 0
    for prompt in prompts(3, seed=2):
        plain = list(plain_engine.generate(prompt, params))
        for k in (1, 3, 5, 8):
            eng = Engine(model, max_model_len=128, decode="graph", speculative=spec(k))
            assert list(eng.generate(prompt, params)) == plain, (prompt, k)
            assert isinstance(eng.step, PackedDecoder) and eng.speculator.graphs
            fig = eng.stats.extra["speculative"]
            drafted, kept = drafted + fig["draft_tokens"], kept + fig["accepted_tokens"]
    assert drafted > kept > 0


def test_python_verify_path_through_the_engine_and_rings_after_rejections(monkeypatch):
    """Lanes (no C layers): greedy output of plain packed decoding exactly (each row computed
    as if alone), oracle drafts with 0..k kept; the rings then give a fresh forward's logits."""
    import tiny

    model = tiny.laneformer(seed=5)
    params = SamplingParams(max_tokens=90, ignore_eos=True)
    plain = list(Engine(model, max_model_len=128, decode="graph").generate(PROMPT, params))
    use_oracle(monkeypatch, PROMPT + plain, lambda i, k: i % (k + 1))
    eng = Engine(model, max_model_len=128, decode="graph", speculative=spec(5))
    got = list(eng.generate(PROMPT, params))
    assert isinstance(eng.step, PackedDecoder) and eng.step.step is None
    assert got == plain
    ref = PROMPT + plain
    with torch.no_grad():
        fresh = model(torch.tensor([ref]))[0, -1]
    assert (continuation_logits(model, eng.cache, ref) - fresh).abs().max() < 1e-4
    fig = eng.stats.extra["speculative"]
    assert fig["verify_steps"] > 10 and 0 < fig["accepted_tokens"] < fig["draft_tokens"]


@needs["float32"]
@pytest.mark.parametrize("window", [None, 70])
def test_c_attention_in_chunks_gives_every_row_the_same_bits(window):
    """The C attention runs in 64-slot chunks merged in slot order (csrc/cpu_layer.c): past 128
    slots, a verify of 7 tokens that straddles a chunk boundary has the bits of 7 lone steps
    (which read fewer slots), 1 and 2 threads give the same bits, and the logits stay those of
    the Python layer (which attends in one piece) to rounding; with and without a window."""
    over = dict(
        max_position_embeddings=256,
        vocab_size=67,
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_size=96,
    )  # head_dim 16: the generic path
    model = llama(seed=5, **over) if window is None else llama(
        seed=5, model_type="mistral", sliding_window=window, **over)  # fmt: skip
    pack_model(model, "float32")
    prompt = [(7 * i + 3) % 67 for i in range(124)]
    new = [5, 9, 30, 7, 7, 12, 3]  # positions 124..130: across the chunk boundary at 128

    def run(native: bool, one_call: bool, threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        cache = KVCache(model.cfg, max_len=200, headroom=len(new))
        return prompt_then_new(PackedDecoder(model, cache, native=native), cache, prompt, new,
                               one_call)  # fmt: skip

    lone = run(True, False, 1)
    assert torch.equal(run(True, True, 1), lone)
    assert torch.equal(run(True, True, 2), lone) and torch.equal(run(True, False, 2), lone)
    torch.testing.assert_close(lone, run(False, True, 1), rtol=1e-4, atol=1e-4)


@needs["float32"]
@pytest.mark.parametrize("window", [None, 70])
def test_a_prompt_in_one_call_on_two_threads_has_the_bits_of_lone_steps(window):
    """A prompt's queries go round the threads (csrc/cpu_layer.c attend_tokens, where the scratch
    holds a share per thread: a cache of 400 slots against 124 live ones), and its norms, RoPE,
    cache writes and SiLU too: 124 tokens in one forward (calls of the step's 40) on two threads
    give every row's logits and the cache with the bits of 124 lone steps on one thread; with
    and without a window."""
    over = dict(max_position_embeddings=512, vocab_size=67, num_attention_heads=6,
                num_key_value_heads=2, hidden_size=96)  # fmt: skip
    model = llama(seed=5, **over) if window is None else llama(
        seed=5, model_type="mistral", sliding_window=window, **over)  # fmt: skip
    pack_model(model, "float32")
    prompt = torch.tensor([(7 * i + 3) % 67 for i in range(124)])
    runs, before = [], torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        cache = KVCache(model.cfg, max_len=400, headroom=8)
        dec = PackedDecoder(model, cache)
        with torch.no_grad():
            if threads == 1:
                rows = []
                for i in range(len(prompt)):
                    cache.live = i + 1
                    rows.append(dec.forward(prompt[i : i + 1], torch.tensor([i])))
                logits = torch.cat(rows)
            else:
                cache.live = len(prompt)
                logits = dec.forward(prompt, torch.tensor([0]))
        runs.append((logits, cache))
    torch.set_num_threads(before)
    (a, ca), (b, cb) = runs
    assert torch.equal(a, b), (a - b).abs().max().item()
    for i in range(len(ca.k)):
        assert torch.equal(ca.pos[i], cb.pos[i])
        assert torch.equal(ca.k[i], cb.k[i]) and torch.equal(ca.v[i], cb.v[i])
