"""Prefix reuse equals a cold prefill: logits (fp32, 1e-5), cache contents and greedy tokens.

Conversations of agent turns (each prompt = the previous prompt + its answer + new tokens) run
on an engine that reuses its cache and on one that prefills every prompt whole; every picked
token's logits, the tokens and the KV cache (positions exactly, keys and values to 1e-5) must
agree, and the reused length must be what the rules in prefix.py promise. Models: the tiny
Laneformer (two sliding-window rings of 16, then a full layer; DTP delay 2, so layer 2 adds
layer 0's delayed partials), a delay-1 Laneformer, a Llama (full attention only) and a
Mistral-style Llama with rings. Then the cases where the cache was left by something else: an
edited answer, a divergent prompt, a decode graph that ran ahead, a cancel or an error in the
middle of a prefill or a decode, an echo scoring pass.
"""

from __future__ import annotations

import threading

import pytest
import tiny
import torch

from expresslane.cache import KVCache
from expresslane.engine import Engine
from expresslane.prefix import common_prefix, ring_starts
from expresslane.sampling.params import SamplingParams
from expresslane.step.pooling import pooled

TOL = 1e-5
WINDOW = 16  # tiny.BASE's sliding window
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)

MODELS = {
    "laneformer-d2": {},
    "laneformer-d1": dict(broadcast_delay=1, num_hidden_layers=4, lm_head_type="replicate"),
    "llama": dict(model_type="llama", num_lanes=1, sliding_window=None, num_hidden_layers=2,
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_lanes=1, num_hidden_layers=2,
                    layer_types=["sliding_attention", "full_attention"]),
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


@pytest.fixture(scope="module")
def models():
    return {name: tiny.laneformer(seed=i, **kw) for i, (name, kw) in enumerate(MODELS.items())}


class Recorder(Engine):
    """An Engine that keeps the logits of every token it picks (eager decode: every token)."""

    def _pick(self, logits, params, generator):
        self.picked.append(logits.float().clone())
        return super()._pick(logits, params, generator)


def engine(model, reuse: bool = True, **kw) -> Recorder:
    # rings of exactly `window` slots: the cases below are counted for them
    kw = {"max_model_len": 160, "prefill_chunk": 7, "ring_headroom": 0, **kw}
    eng = Recorder(model, prefix_reuse=reuse, **kw)
    eng.picked = []
    return eng


def turn(eng: Recorder, prompt: list[int], params=GREEDY, cancel=None) -> tuple[list, list]:
    """(tokens, logits of each pick) of one request."""
    eng.picked = []
    return list(eng.generate(prompt, params, cancel)), eng.picked


def assert_same(hot: Recorder, cold: Recorder, prompt: list[int], params=GREEDY) -> list[int]:
    """One request on both engines: same tokens, logits to TOL, same cache; the tokens."""
    toks, logits = turn(hot, prompt, params)
    ref, ref_logits = turn(cold, prompt, params)
    assert toks == ref
    assert len(logits) == len(ref_logits)
    for a, b in zip(logits, ref_logits, strict=True):
        assert (a - b).abs().max().item() <= TOL
    assert_same_cache(hot.cache, cold.cache)
    return toks


def assert_same_cache(a: KVCache, b: KVCache) -> None:
    assert a.tokens == b.tokens
    for i in range(len(a.k)):
        assert torch.equal(a.pos[i], b.pos[i]), f"layer {i}: positions differ"
        held = a.pos[i] >= 0
        for x, y in ((a.k[i], b.k[i]), (a.v[i], b.v[i])):
            assert (x[held] - y[held]).abs().max().item() <= TOL, f"layer {i}"


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the rule for rings, against a brute force -------------------------------------------------
def test_ring_starts_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        cap = int(torch.randint(1, 12, (1,), generator=g))
        window = cap if trial % 3 else int(torch.randint(1, cap + 1, (1,), generator=g))
        limit = int(torch.randint(0, 40, (1,), generator=g))
        # a ring after writes up to some position, some slots emptied or overwritten
        top = int(torch.randint(0, 45, (1,), generator=g))
        pos = torch.full((cap,), -1, dtype=torch.long)
        for p in range(top):
            pos[p % cap] = p
        pos[torch.rand(cap, generator=g) < 0.15] = -1
        got = ring_starts(pos, window, limit, limit + 3).tolist()
        held = set(pos.tolist())
        want = [
            r <= limit and all(p in held for p in range(max(0, r - window + 1), r))
            for r in range(limit + 3)
        ]
        assert got == want, (cap, window, limit, pos.tolist())


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], (1, 5)) == 1
    assert common_prefix([], [1]) == 0


def test_truncate_forgets_positions_and_refuses_uncommitted(models):
    m = models["laneformer-d2"]
    eng = engine(m)
    turn(eng, prompt_of(10))
    c = eng.cache
    assert len(c.tokens) == 10 + GREEDY.max_tokens - 1 == c.length
    c.truncate(12)
    assert c.length == 12 and len(c.tokens) == 12
    assert all(int(p.max()) == 11 for p in c.pos)  # rings and the full layer
    with pytest.raises(ValueError, match="truncate"):
        c.truncate(21)


# --- agent turns: the common case hits, and equals a cold prefill -----------------------------
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("first", [3, 9, 30])  # reused at turn 2: 10, 16, 37 (window 16)
def test_agent_turns_equal_cold(models, name, first):
    model = models[name]
    hot, cold = engine(model), engine(model, reuse=False)
    prompt, reused = prompt_of(first, seed=first), 0
    for k in range(3):
        toks = assert_same(hot, cold, prompt)
        assert hot.stats.cached_tokens == reused
        assert cold.stats.cached_tokens == 0
        reused = len(prompt) + len(toks) - 1  # every token but the last was fed
        prompt = prompt + toks + prompt_of(3, seed=k)
    assert hot.prefix.hits == 2 and hot.prefix.snapshot_hits == 0


@pytest.mark.parametrize("name", ["laneformer-d2", "llama"])
def test_edited_answer_resumes_at_the_previous_prompt(models, name):
    """The answer comes back changed after 2 tokens: a ring has lost the window before the
    change, so the rings start from their snapshot at the end of the previous prompt; full
    attention keeps everything up to the change."""
    model = models[name]
    hot, cold = engine(model), engine(model, reuse=False)
    first = prompt_of(30)
    toks = assert_same(hot, cold, first)
    edited = first + toks[:2] + [(toks[2] + 1) % 64, 5, 6]
    assert_same(hot, cold, edited)
    rings = name != "llama"
    assert hot.stats.cached_tokens == (30 if rings else 32)
    assert hot.prefix.snapshot_hits == int(rings)


@pytest.mark.parametrize("name", ["laneformer-d2", "llama"])
def test_prompt_diverging_inside_the_history(models, name):
    """Changed at position 20 of 40: full attention keeps 20; a ring holds 24..39, not the
    window before 20, so the prompt is prefilled whole."""
    model = models[name]
    hot, cold = engine(model), engine(model, reuse=False)
    first = prompt_of(40)
    assert_same(hot, cold, first)
    changed = first[:20] + [(first[20] + 1) % 64] + first[21:]
    assert_same(hot, cold, changed)
    assert hot.stats.cached_tokens == (0 if name == "laneformer-d2" else 20)


def test_same_prompt_again_prefills_only_its_last_token(models):
    hot, cold = engine(models["laneformer-d2"]), engine(models["laneformer-d2"], reuse=False)
    p = prompt_of(25)
    assert_same(hot, cold, p)
    assert_same(hot, cold, p)
    assert hot.stats.cached_tokens == 24


# --- caches left by something else ---------------------------------------------------------------
@pytest.mark.parametrize("steps", [1, 4])
def test_after_a_decode_graph_that_ran_ahead(models, steps):
    """The static decode step writes positions the host learns of one replay later; 4 steps per
    replay overwrite ring slots past the last token. The rings fall back to their snapshot."""
    model = models["laneformer-d2"]
    hot = engine(model, decode="graph", steps_per_replay=steps)
    cold = engine(model, reuse=False)
    prompt = prompt_of(20)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expect = 0
    for _ in range(3):
        toks = turn(hot, prompt, params)[0]
        assert toks == turn(cold, prompt, params)[0]
        assert hot.stats.cached_tokens == expect
        expect = len(prompt) + 9 if steps == 1 else len(prompt)
        prompt = prompt + toks + [4, 5]
    nxt = turn(hot, prompt, params)[1][0]  # the graph path picks only its first token here
    assert (nxt - turn(cold, prompt, params)[1][0]).abs().max().item() <= TOL


class CancelAfter(threading.Event):
    """Set once `is_set` has been asked `n` times: before the n-th prefill chunk or step."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def is_set(self) -> bool:
        self.n -= 1
        return self.n < 0


@pytest.mark.parametrize("name", ["laneformer-d2", "mistral"])
def test_cancel_mid_prefill_reuses_only_the_chunks_written(models, name):
    model = models[name]
    hot, cold = engine(model), engine(model, reuse=False)
    prompt = prompt_of(40)
    toks, _ = turn(hot, prompt, cancel=CancelAfter(3))  # 3 chunks of 7 in, then the cancel
    assert toks == [] and hot.stats.finish_reason == "abort"
    assert hot.cache.tokens == prompt[:21]
    assert_same(hot, cold, prompt)
    assert hot.stats.cached_tokens == 21


def test_cancel_mid_decode_then_the_next_turn(models):
    model = models["laneformer-d2"]
    hot, cold = engine(model), engine(model, reuse=False)
    prompt = prompt_of(30)
    chunks = -(-30 // 7)
    toks, _ = turn(hot, prompt, cancel=CancelAfter(chunks + 1 + 4))  # after the 5th token
    assert len(toks) == 5 and hot.stats.finish_reason == "abort"
    nxt = prompt + toks + [7, 8]
    assert_same(hot, cold, nxt)
    assert hot.stats.cached_tokens == 30 + 4


class Boom(RuntimeError):
    pass


def fail_once(model, layer: int, when):
    """Make `layer` raise on the first forward for which when(tokens in it) is true."""
    box = {"armed": True}

    def hook(mod, args):
        if box["armed"] and when(args[0].shape[1]):
            box["armed"] = False
            raise Boom("injected")

    return model.model.layers[layer].register_forward_pre_hook(hook)


@pytest.mark.parametrize(
    "chunks_done,expect",
    [(1, 7), (2, 0)],  # the 3rd chunk (14..20) wraps the 16-slot rings over positions 0..4
)
def test_error_mid_prefill(models, chunks_done, expect):
    """Layer 2 (full attention) raises inside a chunk, after the rings (layers 0, 1) wrote it:
    those positions were never committed, and a ring that lost its window is not reused."""
    model = models["laneformer-d2"]
    hot, cold = engine(model), engine(model, reuse=False)
    prompt = prompt_of(40)
    calls = iter(range(100))
    handle = fail_once(model, 2, lambda n: next(calls) == chunks_done)
    try:
        with pytest.raises(Boom):
            turn(hot, prompt)
    finally:
        handle.remove()
    assert hot.cache.tokens == prompt[: 7 * chunks_done]
    assert_same(hot, cold, prompt)
    assert hot.stats.cached_tokens == expect


def test_error_mid_decode(models):
    model = models["mistral"]
    hot, cold = engine(model), engine(model, reuse=False)
    prompt = prompt_of(30)
    calls = iter(range(100))
    handle = fail_once(model, 1, lambda n: n == 1 and next(calls) == 3)  # the 4th decode step
    try:
        with pytest.raises(Boom):
            turn(hot, prompt)
    finally:
        handle.remove()
    assert len(hot.cache.tokens) == 30 + 3
    nxt = hot.cache.tokens + [9, 9]
    assert_same(hot, cold, nxt)
    assert hot.stats.cached_tokens == 33


def test_echo_scoring_then_generation(models):
    """prompt_logprobs computes every position and leaves the prompt in the cache."""
    model = models["laneformer-d2"]
    hot, cold = engine(model), engine(model, reuse=False)
    prompt = prompt_of(33)
    scores = hot.prompt_logprobs(prompt)
    assert hot.cache.tokens == prompt
    assert_same(hot, cold, prompt)
    assert hot.stats.cached_tokens == 32
    with torch.no_grad():
        full = model(torch.tensor([prompt]))[0].float().log_softmax(-1)
    assert (scores - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["laneformer-d2", "llama"])
def test_embedding_then_generation(models, name):
    """/v1/embeddings' pooling (step/pooling.py) leaves its input in the cache, in chunks that
    wrap the rings: a prompt extending it reuses it and runs as a cold engine's."""
    model = models[name]
    hot, cold = engine(model), engine(model, reuse=False)
    text = prompt_of(33)
    vec = pooled(hot, text, "last", None)
    assert hot.cache.tokens == text
    with torch.no_grad():
        want = model.head_input(model.hidden(torch.tensor([text])))[0, -1].float()
    assert (vec - want).abs().max().item() <= 1e-4
    assert_same(hot, cold, text + [5, 6])
    assert hot.stats.cached_tokens > 0


def test_embedding_cancelled_then_generation(models):
    """A cancelled pooling stops after its first chunk; the next prompt reuses what it wrote."""
    model = models["laneformer-d2"]
    hot, cold = engine(model), engine(model, reuse=False)
    cancel = threading.Event()
    cancel.set()
    assert pooled(hot, prompt_of(33), "last", cancel) is None
    assert hot.cache.tokens == prompt_of(33)[:7]  # one chunk, committed
    assert_same(hot, cold, prompt_of(33) + [5])
    assert hot.stats.cached_tokens == 7


def test_no_prefix_reuse_prefills_every_prompt_whole(models):
    off = engine(models["llama"], reuse=False)
    p = prompt_of(20)
    toks = turn(off, p)[0]
    turn(off, p + toks)
    assert off.stats.cached_tokens == 0
    assert off.prefix.requests == 0 and off.prefix.snapshot is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_agent_turns_on_cuda_graphs_equal_cold(models):
    """Captured decode graphs (and the fused kernels where they run) with reuse, against the
    eager engine prefilling every prompt whole."""
    import copy

    model = copy.deepcopy(models["laneformer-d2"]).to("cuda")
    hot, cold = engine(model, decode="graph"), engine(model, reuse=False, decode="eager")
    prompt, expect = prompt_of(30), 0
    for _ in range(3):
        toks, logits = turn(hot, prompt)
        ref, ref_logits = turn(cold, prompt)
        assert toks == ref
        assert (logits[0] - ref_logits[0]).abs().max().item() <= TOL
        assert hot.stats.cached_tokens == expect
        expect = len(prompt) + len(toks) - 1
        prompt = prompt + toks + [4, 5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_embedding_on_cuda_graphs_then_generation(models):
    """The pooling on a graph-captured engine: the model's own vector, then generation as a
    cold eager engine's."""
    import copy

    model = copy.deepcopy(models["laneformer-d2"]).to("cuda")
    hot, cold = engine(model, decode="graph"), engine(model, reuse=False, decode="eager")
    text = prompt_of(30)
    turn(hot, prompt_of(12, seed=1))  # a request before: the graphs have run
    vec = pooled(hot, text, "mean", None)
    with torch.no_grad():
        want = model.head_input(model.hidden(torch.tensor([text], device="cuda")))[0].float()
    assert (vec - want.mean(0).cpu()).abs().max().item() <= 1e-4
    toks, _ = turn(hot, text + [7])
    assert toks == turn(cold, text + [7])[0]
