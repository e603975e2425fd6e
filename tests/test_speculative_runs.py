"""Speculative decoding inside a request: the cache after rejected drafts (rings included),
stops / max_tokens / the context limit / cancellation inside an accepted run, logprobs, back-off.

An oracle drafter proposes the plain greedy continuation with the first j drafts right and the
rest wrong (j chosen per step), so every case (all kept, some kept, none) happens on purpose.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import tiny
import torch

from expresslane.cache import KVCache
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.speculative import decoder as spec_decode
from expresslane.speculative.drafting import BackOff, NgramDrafter, SpeculativeConfig

PROMPT = [1, 7, 9, 30, 11, 12, 40, 7, 9]
GREEDY = SamplingParams(max_tokens=90, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


@pytest.fixture(scope="module")
def model():
    return tiny.laneformer(seed=5)  # two 16-token sliding-window layers, then a full one


@pytest.fixture(scope="module")
def plain(model) -> list[int]:
    return list(Engine(model, max_model_len=128).generate(PROMPT, GREEDY))


def spec(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1)


class _Always(BackOff):
    def ready(self) -> bool:
        return True


def use_oracle(monkeypatch, reference: list[int], right, backoff: bool = False) -> list:
    """Drafts: `reference` from the current length on, the first right(step, k) correct, the
    rest off by one. Returns the list of (position, drafts) proposed."""
    steps, calls = itertools.count(), []

    def propose(self, k):
        n = len(self.seq)
        true = reference[n : n + k]
        j = right(next(steps), k)
        drafts = true[:j] + [(t + 1) % 64 for t in true[j:]]
        if drafts:
            calls.append((n, drafts))
        return drafts

    monkeypatch.setattr(NgramDrafter, "propose", propose)
    if not backoff:
        monkeypatch.setattr(spec_decode, "BackOff", _Always)
    return calls


def continuation_logits(model, cache: KVCache, seq: list[int]) -> torch.Tensor:
    """The next token's logits from `cache` holding seq[:-1]: one static step at len(seq) - 1."""
    was, cache.static = cache.static, True
    try:
        with torch.no_grad():
            pos = torch.tensor([len(seq) - 1])
            return model(torch.tensor([[seq[-1]]]), positions=pos, cache=cache)[0, -1]
    finally:
        cache.static = was


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_rings_after_rejections_equal_a_fresh_forward(model, plain, monkeypatch, decode):
    ref = PROMPT + plain
    calls = use_oracle(monkeypatch, ref, lambda i, k: i % (k + 1))  # 0..k kept, in turn
    eng = Engine(model, max_model_len=128, decode=decode, speculative=spec(5))
    assert list(eng.generate(PROMPT, GREEDY)) == plain
    fig = eng.stats.extra["speculative"]
    assert fig["verify_steps"] > 10 and 0 < fig["accepted_tokens"] < fig["draft_tokens"]
    assert len(ref) > 5 * 16  # the rings wrapped several times
    with torch.no_grad():
        fresh = model(torch.tensor([ref]))[0, -1]
    assert (continuation_logits(model, eng.cache, ref) - fresh).abs().max() < 1e-4
    assert calls


def test_cache_holds_what_plain_decoding_would(model, plain, monkeypatch):
    """Slot by slot: every key a later query can see is the plain cache's, and no slot holds a
    rejected draft's position."""
    ref = PROMPT + plain
    use_oracle(monkeypatch, ref, lambda i, k: i % (k + 1))
    eng = Engine(model, max_model_len=128, speculative=spec(5))
    list(eng.generate(PROMPT, GREEDY))
    L = len(ref) - 1  # positions written: all but the last token
    assert eng.cache.length == L
    want = Engine(model, max_model_len=128, speculative=spec(5))
    want.prefill(ref[:L])
    for layer, w in enumerate(eng.cache.windows):
        got_pos, want_pos = eng.cache.pos[layer], want.cache.pos[layer]
        held = set(got_pos[got_pos >= 0].tolist())
        assert held <= set(want_pos[want_pos >= 0].tolist())  # nothing beyond L, no draft
        visible = range(max(0, L - w + 1) if w else 0, L)
        assert set(visible) <= held
        for p in visible:
            a, b = (got_pos == p).nonzero()[0, 0], (want_pos == p).nonzero()[0, 0]
            assert torch.allclose(eng.cache.k[layer][a], want.cache.k[layer][b], atol=1e-5)
            assert torch.allclose(eng.cache.v[layer][a], want.cache.v[layer][b], atol=1e-5)


def test_without_ring_headroom_rejected_drafts_corrupt_the_window(model, plain, monkeypatch):
    """Why rings get headroom: the same run on rings of exactly `window` slots goes wrong."""
    ref = PROMPT + plain
    use_oracle(monkeypatch, ref, lambda i, k: i % (k + 1))
    eng = Engine(model, max_model_len=128, speculative=spec(5))
    eng.cache = KVCache(model.cfg, 128)  # no headroom
    got = list(eng.generate(PROMPT, GREEDY))
    with torch.no_grad():
        fresh = model(torch.tensor([ref]))[0, -1]
    wrong = (continuation_logits(model, eng.cache, ref) - fresh).abs().max() > 1e-2
    assert got != plain or wrong


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_prefix_reuse_after_rejected_drafts(model, plain, monkeypatch, decode):
    """The next turn reuses what a speculative request left in the cache (its committed tokens;
    rejected drafts emptied, rings wrapped) and decodes what a cold engine decodes."""
    with monkeypatch.context() as m:
        use_oracle(m, PROMPT + plain, lambda i, k: i % (k + 1))
        eng = Engine(model, max_model_len=160, decode=decode, speculative=spec(5))
        first = list(eng.generate(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True)))
    assert first == plain[:60] and eng.stats.extra["speculative"]["verify_steps"] > 5
    turn = PROMPT + first + [3, 4, 5, 6]
    cold = Engine(model, max_model_len=160, prefix_reuse=False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert list(eng.generate(turn, params)) == list(cold.generate(turn, params))
    assert eng.stats.cached_tokens >= len(PROMPT) + 50  # most of the first turn was reused


# --- inside an accepted run -------------------------------------------------------------------
def mid_run_index(calls: list, plain: list[int], k: int) -> int:
    """An output index in the middle of a fully kept run whose token did not occur before."""
    for n, drafts in calls:
        i = n - len(PROMPT) + k // 2  # output index of the middle draft
        if len(drafts) == k and 0 < i < len(plain) and plain[i] not in plain[:i]:
            return i
    pytest.skip("no run with a fresh token in the middle (the model's output changed)")


def test_stop_token_inside_an_accepted_run(model, plain, monkeypatch):
    calls = use_oracle(monkeypatch, PROMPT + plain, lambda i, k: k)  # every draft right
    eng = Engine(model, max_model_len=128, speculative=spec(6))
    list(eng.generate(PROMPT, GREEDY))
    i = mid_run_index(calls, plain, 6)
    stop = SamplingParams(max_tokens=90, ignore_eos=True, stop_token_ids=(plain[i],))
    assert list(eng.generate(PROMPT, stop)) == plain[: i + 1]
    assert eng.stats.finish_reason == "stop"
    assert list(eng.generate(PROMPT, GREEDY)) == plain  # the engine is exact afterwards


def test_max_tokens_inside_an_accepted_run(model, plain, monkeypatch):
    calls = use_oracle(monkeypatch, PROMPT + plain, lambda i, k: k)
    eng = Engine(model, max_model_len=128, speculative=spec(6))
    list(eng.generate(PROMPT, GREEDY))
    i = mid_run_index(calls, plain, 6)
    short = SamplingParams(max_tokens=i + 1, ignore_eos=True)
    assert list(eng.generate(PROMPT, short)) == plain[: i + 1]
    assert eng.stats.finish_reason == "length"


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_context_limit_with_drafts_pending(model, monkeypatch, decode):
    ctx = len(PROMPT) + 23
    ref_params = SamplingParams(max_tokens=100, ignore_eos=True)
    want = list(Engine(model, max_model_len=ctx).generate(PROMPT, ref_params))
    assert len(want) == 23
    use_oracle(monkeypatch, PROMPT + want + [5] * 10, lambda i, k: k)
    eng = Engine(model, max_model_len=ctx, decode=decode, speculative=spec(8))
    assert list(eng.generate(PROMPT, ref_params)) == want
    assert eng.stats.finish_reason == "length"


def test_stop_string_inside_an_accepted_run(random_laneformer_dir, monkeypatch):
    from expresslane.textgen import stream_text
    from expresslane.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(random_laneformer_dir)
    base = Engine.from_pretrained(str(random_laneformer_dir), device="cpu", progress=False)
    prompt = tok.encode("def add(a, b):")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    out = list(base.generate(prompt, params))
    texts = [tok.decode(out[: i + 1]) for i in range(len(out))]
    # a stop string that first appears with token i, in the middle of the output
    i = next(i for i in range(8, len(out)) if texts[i][len(texts[i - 1]) :].strip()
             and texts[i][len(texts[i - 1]) :] not in texts[i - 1])  # fmt: skip
    stop = [texts[i][len(texts[i - 1]) :]]
    use_oracle(monkeypatch, prompt + out, lambda j, k: k)
    eng = Engine(base.model, max_model_len=base.max_len, speculative=spec(8))

    def run(engine):
        steps = [(t, s.token) for t, s in stream_text(engine, tok, prompt, params, stop)]
        return "".join(t for t, _ in steps), [s for _, s in steps], engine.stats.finish_reason

    want = run(base)
    got = run(eng)
    assert got == want and want[2] == "stop"
    assert eng.stats.extra["speculative"]["accepted_tokens"] > len(want[1]) // 2


def test_logprobs_are_those_of_the_accepted_tokens(model, plain, monkeypatch):
    use_oracle(monkeypatch, PROMPT + plain, lambda i, k: i % (k + 1))
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3)
    want = list(Engine(model, max_model_len=128).generate_steps(PROMPT, params))
    eng = Engine(model, max_model_len=128, speculative=spec(4))
    got = list(eng.generate_steps(PROMPT, params))
    assert [s.token for s in got] == [s.token for s in want]
    assert eng.stats.extra["speculative"]["accepted_tokens"] > 5
    for a, b in zip(got, want, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_cancellation_is_seen_inside_an_accepted_run(model, plain, monkeypatch):
    use_oracle(monkeypatch, PROMPT + plain, lambda i, k: k)
    eng = Engine(model, max_model_len=128, speculative=spec(8))
    cancel = threading.Event()
    got = []
    for step in eng.generate_steps(PROMPT, GREEDY, cancel):
        got.append(step.token)
        if len(got) == 5:  # token 5 is the 4th of the first verify's 9
            cancel.set()
            verified = eng.stats.extra["speculative"]["verify_steps"]
    assert got == plain[:5]
    assert eng.stats.finish_reason == "abort"
    assert eng.stats.extra["speculative"]["verify_steps"] == verified  # no verify after


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_back_off_bounds_the_verify_steps_of_useless_drafts(model, plain, monkeypatch, decode):
    use_oracle(monkeypatch, PROMPT + plain, lambda i, k: 0, backoff=True)  # every draft wrong
    eng = Engine(model, max_model_len=128, decode=decode, speculative=spec(5))
    assert list(eng.generate(PROMPT, GREEDY)) == plain
    fig = eng.stats.extra["speculative"]
    # pauses of 2, 4, 8, 16, 32, 64 plain tokens: 6 verify steps in 90 tokens, not 90
    assert fig["accepted_tokens"] == 0 and 4 <= fig["verify_steps"] <= 7, fig


def test_full_length_matches_draft_through_a_pause(model, plain, monkeypatch):
    use_oracle(monkeypatch, PROMPT + plain, lambda i, k: 0, backoff=True)
    eng = Engine(model, max_model_len=128, speculative=spec(5))
    list(eng.generate(PROMPT, GREEDY))
    paused = eng.stats.extra["speculative"]["verify_steps"]
    monkeypatch.setattr(NgramDrafter, "strong", property(lambda self: True))
    assert list(eng.generate(PROMPT, GREEDY)) == plain
    assert eng.stats.extra["speculative"]["verify_steps"] > 2 * paused  # no pause held them


def test_back_off_schedule():
    b = BackOff(draft_cost=0.15, max_pause=16)
    pauses = []
    for _ in range(6):
        assert b.ready()
        b.verified(5, 0)
        pauses.append(b.pause)
        b.plain(b.pause)
    assert pauses == [2, 4, 8, 16, 16, 16]
    b.verified(5, 0)
    b.plain(3)
    assert not b.ready()
    b.verified(5, 1)  # 2 tokens for ~1.75 steps: it paid; the count resets, not the pause
    assert b.misses == 0 and not b.ready()
    b.verified(12, 1)  # 2 tokens for ~2.8 steps: a miss
    assert b.misses == 1
