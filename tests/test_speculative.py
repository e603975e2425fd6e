"""Speculative decoding by prompt lookup: exact against plain decoding, on every path.

Greedy output equals plain decoding token for token (k = 1..8, a Laneformer with delays and
sliding-window rings, and a Llama), on the eager path and on the static verify step that a GPU
captures (run eagerly here). A flip at a near tie (top-2 logit gap < 1e-5) is the one allowed
difference; it is reported, not hidden. Sampling follows the filtered distribution (chi-square
against the plain sampler's probabilities). Rings after rejected drafts give the logits of a
fresh full forward. Stops, max_tokens, the context limit, logprobs and cancellation act inside
an accepted run.
"""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.errors import ConfigError
from expresslane.model import Laneformer, init_weights
from expresslane.sampling.params import SamplingParams
from expresslane.speculative.drafting import NgramDrafter, SpeculativeConfig

NEAR_TIE = 1e-5


def spec(k: int, hi: int = 3, lo: int = 1) -> SpeculativeConfig:
    return SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


@pytest.fixture(scope="module")
def lane():
    return tiny.laneformer(seed=5)


@pytest.fixture(scope="module")
def llama():
    cfg = ModelConfig.from_hf_dict(
        dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, eos_token_id=2)
    )  # fmt: skip
    return init_weights(Laneformer(cfg), seed=3).eval()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts with a repeated span in each, so that lookup finds drafts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        body = torch.randint(3, 64, (6 + i % 5,), generator=g).tolist()
        out.append([1, *body, *torch.randint(3, 64, (3,), generator=g).tolist(), *body[:4]])
    return out


def first_flip(model, prompt, plain, got) -> tuple[int, float] | None:
    """(index, top-2 gap of the plain path there) of the first difference, or None."""
    i = next((j for j, (a, b) in enumerate(zip(plain, got, strict=False)) if a != b), None)
    if i is None:
        assert len(plain) == len(got)
        return None
    dev = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + plain[:i]], device=dev))[0, -1]
    top = logits.topk(2).values
    return i, float(top[0] - top[1])


def assert_identical(model, prompt, plain, got, flips: list) -> None:
    flip = first_flip(model, prompt, plain, got)
    if flip is not None:
        i, gap = flip
        assert gap < NEAR_TIE, f"token {i} differs at a top-2 gap of {gap:.3g}"
        flips.append(flip)  # allowed: reported below


@pytest.mark.parametrize("which", ["lane", "llama"])
def test_greedy_identity_over_prompts_and_k(which, request):
    model = request.getfixturevalue(which)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain_engine = Engine(model, max_model_len=128)
    flips, drafted, kept = [], 0, 0
    for prompt in prompts(6, seed=len(which)):
        plain = list(plain_engine.generate(prompt, params))
        for k in range(1, 9):
            eng = Engine(model, max_model_len=128, speculative=spec(k))
            assert_identical(model, prompt, plain, list(eng.generate(prompt, params)), flips)
            fig = eng.stats.extra["speculative"]
            drafted, kept = drafted + fig["draft_tokens"], kept + fig["accepted_tokens"]
    print(f"\n{which}: {len(flips)} near-tie flips {flips}; {kept}/{drafted} drafts kept")
    assert kept > 0 and drafted > kept  # drafts were made, kept and rejected


@pytest.mark.parametrize("k, steps", [(1, 1), (3, 1), (8, 1), (4, 3)])
def test_static_verify_step_equals_plain_greedy(lane, k, steps):
    """The graph-capable verify (static buffers, acceptance on the device), run eagerly, with
    plain steps from the decode graph (`steps` per replay). kernels="off": the model's forward
    as the step (on a CPU kernels="auto" is the packed step, test_packed_verify.py)."""
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    flips = []
    for prompt in prompts(3, seed=k):
        plain = list(Engine(lane, max_model_len=128).generate(prompt, params))
        eng = Engine(lane, max_model_len=128, decode="graph", steps_per_replay=steps,
                     kernels="off", speculative=spec(k))  # fmt: skip
        assert_identical(lane, prompt, plain, list(eng.generate(prompt, params)), flips)
        assert eng.stats.extra["speculative"]["verify_steps"] > 0
        assert eng.speculator.graphs  # the verify went through the static step
    assert not flips, flips


@pytest.mark.parametrize("kernels", ["on", "off"])  # the fused step (its references), forward
def test_greedy_speculation_is_the_plain_step_bit_for_bit(lane, kernels):
    """The verify runs the engine's own step over k + 1 rows (DecodeGraph(step, width=k + 1)),
    so greedy speculation is plain greedy decoding of that step exactly: for the fused GPU step
    (here its reference kernels, the wiring a GPU runs) and for the model's forward."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    drafted = 0
    for prompt in prompts(2, seed=3):
        plain = Engine(lane, max_model_len=128, decode="graph", kernels=kernels)
        want = list(plain.generate(prompt, params))
        for k in (2, 5):
            eng = Engine(lane, max_model_len=128, decode="graph", kernels=kernels,
                         speculative=spec(k))  # fmt: skip
            assert type(eng.step) is type(plain.step)
            assert list(eng.generate(prompt, params)) == want, (prompt, k)
            drafted += eng.stats.extra["speculative"]["draft_tokens"]
    assert drafted > 0


def test_verify_step_is_the_forward_and_the_acceptance_rule(lane):
    """One verify of the same drafts through DecodeGraph(step, width=k + 1): the tokens of
    `accept` on the model's forward over the k + 1 rows, the same sampled draw, and a cache
    that holds the kept drafts only (the rejected slots emptied)."""
    from expresslane.speculative.drafting import accept
    from expresslane.step.graph import DecodeGraph
    from expresslane.step.protocol import EagerStep

    prompt = prompts(1)[0]
    drafts = [9, 30, 11, 5]
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=4)):
        a = Engine(lane, max_model_len=64, speculative=spec(4))
        a.prefill(prompt)
        g = None if params.greedy else torch.Generator().manual_seed(7)
        with torch.no_grad():
            logits = lane(torch.tensor([[7, *drafts]]), cache=a.cache)[0].float()
        kept, tokens = accept(logits, torch.tensor(drafts), params, g)
        want = tokens[: int(kept) + 1].tolist()
        b = Engine(lane, max_model_len=64, speculative=spec(4))
        b.prefill(prompt)
        g = None if params.greedy else torch.Generator().manual_seed(7)
        vg = DecodeGraph(EagerStep(lane, b.cache), params, width=5, generator=g)
        vg.load_drafts(7, drafts, position=len(prompt))
        out = vg.run().tolist()
        assert out[1 : out[0] + 2] == want
        torch.testing.assert_close(vg.rows, logits, rtol=1e-5, atol=1e-5)
        for pa, pb in zip(a.cache.pos, b.cache.pos, strict=True):
            kept_upto = len(prompt) + int(kept) + 1
            assert torch.equal(pa.masked_fill(pa >= kept_upto, -1), pb)


# --- sampling -------------------------------------------------------------------------------
def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    n = counts.sum()
    expected = probs[support] * n
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    return stat, chi_square_critical(int(support.sum()) - 1)


def test_acceptance_rule_follows_the_filtered_distribution():
    """accept() on fixed logits: the 1st token ~ p_0, the 2nd given the 1st draft ~ p_1, the
    3rd given both ~ p_2 (chi-square, p = 0.001), against the plain sampler's filter."""
    from expresslane.sampling.sampler import filter_logits
    from expresslane.speculative.drafting import accept

    V, k, n = 24, 3, 6000
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(2)) * 2.0
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95, seed=0)
    probs = filter_logits(logits.double(), params).softmax(-1)
    # drafts of middling probability: both outcomes happen often
    order = probs[:k].argsort(-1, descending=True)
    drafts = torch.stack([order[0, 1], order[1, 0], order[2, 0]])  # not always the favourite
    gen = torch.Generator().manual_seed(11)
    counts = torch.zeros(k, V, dtype=torch.float64)
    for _ in range(n):
        kept, tokens = accept(logits, drafts, params, gen)
        out = tokens[: int(kept) + 1].tolist()
        for j, t in enumerate(out):
            counts[j, t] += 1
            if j + 1 == k or t != drafts[j]:
                break
    for j in range(k):
        stat, crit = chi_square(counts[j], probs[j])
        assert stat < crit, (j, stat, crit)
    assert counts[k - 1].sum() > 300  # the deepest row was reached often enough to test


def second_token_marginal(model, prompt, params, adjust=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(p(t1), the exact marginal of the 2nd token sum_t1 p(t1) p(t2 | t1)) under the plain
    sampler's filter, from cache-free forwards; `adjust(logits, t1)` changes the 2nd step's
    logits in place first (a penalty written out)."""
    from expresslane.sampling.sampler import filter_logits

    with torch.no_grad():
        p1 = filter_logits(model(torch.tensor([prompt]))[0, -1].double(), params).softmax(-1)
        expected = torch.zeros(p1.shape[-1], dtype=torch.float64)
        for t1 in p1.nonzero()[:, 0].tolist():
            logits = model(torch.tensor([prompt + [t1]]))[0, -1].double()
            if adjust is not None:
                adjust(logits, t1)
            expected += p1[t1] * filter_logits(logits, params).softmax(-1)
    return p1, expected


def test_engine_samples_follow_the_model_distribution(lane):
    """Engine level: the 2nd generated token (from a verify step that has a draft) over many
    seeds against its exact marginal sum_t1 p(t1) p(t2 | t1) under the plain sampler's filter
    (chi-square, p = 0.001)."""
    prompt = [1, *range(3, 64)]  # every token the first step can draw has a draft after it
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True)
    _, expected = second_token_marginal(lane, prompt, params)
    eng = Engine(lane, max_model_len=80, speculative=spec(3, 2, 1))
    counts = torch.zeros(64, dtype=torch.float64)
    verified = 0
    for seed in range(300):
        p = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True, seed=seed)
        counts[list(eng.generate(prompt, p))[1]] += 1
        verified += eng.stats.extra["speculative"]["verify_steps"]
    assert verified > 270  # nearly every request verified a draft
    stat, crit = chi_square(counts, expected)
    assert stat < crit, (stat, crit)


def test_seeded_speculative_sampling_is_reproducible(lane):
    p = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    for decode in ("eager", "graph"):
        eng = Engine(lane, max_model_len=64, decode=decode, speculative=spec(4))
        first = list(eng.generate(prompts(1)[0], p))
        assert list(eng.generate(prompts(1)[0], p)) == first


# --- configuration and drafting -----------------------------------------------------------------
def test_config_parses_vllm_spelling():
    text = (
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}'
    )
    assert SpeculativeConfig.from_json(text) == SpeculativeConfig(5, 4, 2)
    only_max = SpeculativeConfig.from_json('{"num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    neither = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (neither.prompt_lookup_min, neither.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize(
    "text, names",
    [
        ("{bad", "not valid JSON"),
        ("[5]", "expected a JSON object"),
        ('{"num_speculative_tokens": 5, "draft": 1}', "unknown field 'draft'"),
        ('{"method": "eagle", "num_speculative_tokens": 5}', "method='eagle'"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens=0"),
        ('{"num_speculative_tokens": "5"}', "num_speculative_tokens='5'"),
        ('{"num_speculative_tokens": true}', "num_speculative_tokens=True"),
        ('{"num_speculative_tokens": 5, "prompt_lookup_min": 0}', "prompt_lookup_min=0"),
        ('{"num_speculative_tokens": 5, "prompt_lookup_max": 2, "prompt_lookup_min": 3}',
         "prompt_lookup_min=3 is larger than prompt_lookup_max=2"),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(text, names):
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpeculativeConfig.from_json(text)
    assert names in str(e.value)


def test_drafter_proposes_what_followed_the_longest_latest_match():
    d = NgramDrafter(spec(3, hi=3, lo=1), [5, 6, 7, 8, 9, 5, 6, 7])
    assert d.propose(3) == [8, 9, 5]  # (5, 6, 7) ended at index 2
    assert d.propose(1) == [8]
    assert d.propose(6) == [8, 9, 5, 6, 7, 8]  # the repeat goes on past the sequence's end
    assert NgramDrafter(spec(5, hi=2, lo=1), [3, 4, 3, 4]).propose(5) == [3, 4, 3, 4, 3]
    d = NgramDrafter(spec(2, hi=2, lo=1), [1, 2, 3, 1, 2, 4, 1, 2])
    assert d.propose(2) == [4, 1]  # the latest of two occurrences of (1, 2)
    d = NgramDrafter(spec(2, hi=2, lo=1), [1, 2, 3, 9, 2, 4, 1, 2])
    assert d.propose(2) == [3, 9]  # the bigram (1, 2) beats the later unigram (2)
    assert NgramDrafter(spec(2, hi=2, lo=1), [1, 2, 3]).propose(2) == []  # no self-match
    assert NgramDrafter(spec(2, hi=3, lo=2), [1, 2, 9, 2]).propose(2) == []  # n >= 2 only
    d = NgramDrafter(spec(4, hi=2, lo=2), [4, 5, 6])
    assert d.propose(4) == []
    d.extend([7, 4, 5])  # incremental: the index catches up
    assert d.propose(4) == [6, 7, 4, 5]
    assert d.propose(0) == []


def test_drafter_keeps_copying_from_the_previous_source():
    """Two places end with (a, b); the latest would jump to the second copy, but a copy in
    progress from the first goes on from there."""
    a, b = 20, 21
    src = [1, 2, a, b, 3, 4, 5, 6, 7, 8, 9]  # the text being copied
    other = [30, a, b, 40, 41]  # a later line that also has (a, b)
    d = NgramDrafter(spec(3, hi=2, lo=2), [*src, *other, 1, 2])
    assert d.propose(3) == [a, b, 3]  # (1, 2) only matches the source
    d.extend([a, b])  # the first two drafts were kept, then the model's own token
    assert d.propose(3) == [3, 4, 5]  # from the source, not [40, 41, 1] after the later (a, b)
    fresh = NgramDrafter(spec(3, hi=2, lo=2), [*src, *other, 1, 2, a, b])
    assert fresh.propose(3) == [40, 41, 1]  # without a copy in progress: the latest


def test_drafter_says_when_a_match_is_full_length():
    d = NgramDrafter(spec(2, hi=3, lo=2), [5, 6, 7, 8, 6, 7])
    assert d.propose(2) == [8, 6] and d.match_n == 2 and not d.strong
    d.extend([8])
    assert d.propose(2) == [6, 7] and d.match_n == 3 and d.strong
    same = NgramDrafter(spec(2, hi=2, lo=2), [5, 6, 7, 5, 6])
    assert same.propose(2) == [7, 5] and not same.strong  # hi == lo: no match stands out


# --- on a GPU: the captured verify step ----------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_cuda_captured_verify_equals_eager_decoding(lane):
    m = copy.deepcopy(lane).to("cuda")
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    flips = []
    step = Engine(m, max_model_len=128, decode="graph")  # the fused step where triton runs
    for prompt in prompts(4, seed=9):
        plain = list(Engine(m, max_model_len=128, decode="eager").generate(prompt, params))
        eng = Engine(m, max_model_len=128, decode="graph", speculative=spec(5))
        got = list(eng.generate(prompt, params))
        assert got == list(step.generate(prompt, params))  # the same step: bit for bit
        assert_identical(m, prompt, plain, got, flips)  # the forward: a near tie may flip
        assert all(g.graphs and not g.missing for g in eng.speculator.graphs.values())
        assert eng.stats.extra["speculative"]["verify_steps"] > 0
    print(f"\ncuda: {len(flips)} near-tie flips against the forward {flips}")


@pytest.mark.gpu
@cuda
def test_cuda_captured_and_eager_verify_draw_the_same_tokens(lane):
    """One sampled verify step, captured and not, from the same state and seed."""
    from expresslane.step.graph import DecodeGraph

    m = copy.deepcopy(lane).to("cuda")
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1)
    prompt = prompts(1)[0]
    outs = []
    for capture in (True, False):
        eng = Engine(m, max_model_len=64, speculative=spec(4))
        eng.prefill(prompt)
        gen = torch.Generator("cuda").manual_seed(3)
        vg = DecodeGraph(eng.step, params, width=5, capture=capture, generator=gen)
        vg.load_drafts(5, [6, 7, 8, 9], len(prompt))
        vg.capture_buckets([vg.live()])
        got = []
        for _ in range(6):  # same inputs each step (the cache is rewritten alike)
            vg.load_drafts(5, [6, 7, 8, 9], len(prompt))
            got.append(vg.run().tolist())
        outs.append(got)
    assert outs[0] == outs[1]


@pytest.mark.gpu
@cuda
def test_cuda_verify_replays_do_not_synchronise(lane):
    from expresslane.step.graph import DecodeGraph

    m = copy.deepcopy(lane).to("cuda")
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=2)
    eng = Engine(m, max_model_len=64, speculative=spec(4))
    prompt = prompts(1)[0]
    eng.prefill(prompt)
    gen = torch.Generator("cuda").manual_seed(2)
    vg = DecodeGraph(eng.step, params, width=5, generator=gen)
    vg.load_drafts(5, [6, 7, 8, 9], len(prompt))
    vg.capture_buckets([vg.live()])  # synchronises, by design: never in a request
    host = torch.empty(6, dtype=torch.long, pin_memory=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(30):
            host.copy_(vg.run(), non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
