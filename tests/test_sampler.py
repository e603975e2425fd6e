"""Sampling: greedy = argmax, seeds reproduce, filters never pick a masked token."""

from __future__ import annotations

import pytest
import torch

from expresslane.errors import RequestError
from expresslane.sampling.params import SamplingParams
from expresslane.sampling.sampler import (
    argmax,
    draw,
    filter_logits,
    make_generator,
    race,
    sample,
    top_k_draw,
    top_p_candidates,
    top_p_sorted,
)


def _logits(seed=0, v=50):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def _draws(params, logits, n=400):
    g = make_generator(params, logits.device)
    return [int(sample(logits, params, g)) for _ in range(n)]


def test_greedy_is_argmax_and_temperature_zero_is_greedy():
    x = _logits()
    assert int(sample(x, SamplingParams(temperature=0.0), None)) == int(x.argmax())
    assert _draws(SamplingParams(temperature=0.0), x, 5) == [int(x.argmax())] * 5
    assert _draws(SamplingParams(temperature=1.0, top_k=1, seed=3), x, 5) == [int(x.argmax())] * 5


@pytest.mark.parametrize("shape", [(1,), (7,), (49153,), (3, 1001), (5, 49152)])
def test_fast_argmax_is_torchs_on_ties_nans_infs_and_strides(shape):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randint(-3, 3, shape, generator=g).float()  # many ties: the first max must win
    variants = [x, x.transpose(0, -1).contiguous().transpose(0, -1), -x]
    y = x.clone()
    y.view(-1)[:: max(1, y.numel() // 3)] = float("-inf")
    z = x.clone()
    z.view(-1)[-1] = float("nan")
    for v in [*variants, y, z, torch.full(shape, float("-inf"))]:
        got = argmax(v)
        assert got.dtype == torch.long and got.shape == v.shape[:-1]
        assert torch.equal(got, v.argmax(-1))
    assert torch.equal(argmax(x.bfloat16()), x.bfloat16().argmax(-1))  # torch's own path


@pytest.mark.parametrize("pick", [draw, race])
def test_draws_follow_unnormalised_weights_and_never_pick_a_zero(pick):
    """The CPU's inverse-CDF draw and the race (the GPU's, its reference) against the weights:
    rows drawn together are independent, zero weights (first, middle, last) never come."""
    w = torch.tensor([0.0, 3.0, 1.0, 0.0, 6.0, 0.0])  # unnormalised: sums to 10
    rows = torch.stack((w, w.flip(0) * 7))  # (2, 6)
    g, n = torch.Generator().manual_seed(4), 6000
    got = torch.stack([pick(rows, g) for _ in range(n)])  # (n, 2)
    assert got.shape == (n, 2) and got.dtype == torch.long
    for r in range(2):
        freq = torch.bincount(got[:, r], minlength=6).double() / n
        want = rows[r].double() / rows[r].sum()
        assert torch.all(freq[want == 0] == 0)
        assert torch.allclose(freq, want, atol=0.025), (freq, want)


def test_a_cpu_draw_whose_uniform_rounds_up_to_the_total_stays_on_a_positive_weight(
    monkeypatch,
):
    w = torch.tensor([[0.0, 2.0, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw["dtype"]))
    assert draw(w, None).tolist() == [2, 0]  # u = 1 (beyond rand's range): the last positive
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.zeros(shape, dtype=kw["dtype"]))
    assert draw(w, None).tolist() == [1, 0]  # u = 0: the first positive


@pytest.mark.parametrize("shape", [(1,), (7,), (3, 1001), (2, 49152)])
@pytest.mark.parametrize("top_p", [0.0, 1e-9, 0.3, 0.9, 0.95, 0.99995, torch.tensor([0.8])])
def test_top_p_over_candidates_is_the_full_sorts(shape, top_p):
    g = torch.Generator().manual_seed(shape[-1])
    for scale in (0.5, 3.0, 12.0):  # flat to peaked
        x = torch.randn(shape, generator=g) * scale
        x.view(-1)[1::5] = float("-inf")  # as top-k leaves it
        got, want = top_p_candidates(x, top_p), top_p_sorted(x, top_p)
        assert torch.equal(got.isfinite(), want.isfinite()), (scale, top_p)
        assert torch.equal(got[got.isfinite()], x[want.isfinite()])
        assert got.isfinite().any(-1).all()  # never a row with nothing left


def test_top_p_over_candidates_keeps_as_many_tied_tokens_as_the_sort():
    x = torch.tensor([[2.0, 1.0, 2.0, 2.0, 0.0, 1.0], [0.0] * 6])
    for top_p in (0.2, 0.5, 0.7, 0.9):
        got, want = top_p_candidates(x, top_p), top_p_sorted(x, top_p)
        assert torch.equal(got.isfinite().sum(-1), want.isfinite().sum(-1))


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.6}, {"min_p": 0.2}, {"top_p": 0.8, "min_p": 0.1}])
def test_top_k_over_the_k_best_follows_the_whole_vocabularys_filters(kw):
    """top_k_draw (the CPU's, over k values) against the whole vocabulary's filters: the same
    support and the same frequencies, for top-k alone and with top-p and min-p after it."""
    x = torch.randn(301, generator=torch.Generator().manual_seed(9)) * 2
    params = SamplingParams(temperature=0.9, top_k=7, **kw)
    want = filter_logits(x, params).softmax(-1).double()
    g, n = torch.Generator().manual_seed(2), 6000
    got = torch.stack([top_k_draw(x, params, None, g) for _ in range(n)])
    freq = torch.bincount(got, minlength=301).double() / n
    assert torch.all(freq[want == 0] == 0) and (want > 0).sum() >= 2
    assert torch.allclose(freq, want, atol=0.025), (freq[want > 0], want[want > 0])
    rows = torch.stack([x, x.flip(0)])  # (2, V): a row each
    assert top_k_draw(rows, params, None, g).shape == (2,)


def test_top_k_over_the_k_best_leaves_ties_and_masked_rows_to_the_whole_vocabulary():
    params = SamplingParams(temperature=1.0, top_k=3)
    tie = torch.tensor([5.0, 1.0, 4.0, 2.0, 2.0, 0.0])  # the 3rd best ties with the 4th
    assert top_k_draw(tie, params, None, None) is None
    masked = torch.tensor([1.0, float("-inf"), 3.0, float("-inf"), float("-inf")])
    assert top_k_draw(masked, params, None, None) is None  # 2 finite: -inf ties at the 3rd
    g = torch.Generator().manual_seed(0)
    assert int(sample(tie, params, g)) in (0, 2, 3, 4)  # the dense path: every tie stays


def test_same_seed_same_tokens_other_seed_other_tokens():
    x = _logits()
    a = _draws(SamplingParams(temperature=1.0, seed=7), x, 50)
    assert a == _draws(SamplingParams(temperature=1.0, seed=7), x, 50)
    assert a != _draws(SamplingParams(temperature=1.0, seed=8), x, 50)


@pytest.mark.parametrize(
    "kw", [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.2), dict(top_k=10, top_p=0.7, min_p=0.05)]
)
def test_filters_never_pick_a_masked_token(kw):
    x = _logits(1)
    params = SamplingParams(temperature=1.3, seed=0, **kw)
    allowed = set(torch.nonzero(torch.isfinite(filter_logits(x, params))).flatten().tolist())
    probs = (x / 1.3).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if "top_k" in kw:
        assert allowed <= set(order[: kw["top_k"]])
    if "top_p" in kw:  # the smallest prefix of the sorted distribution reaching top_p
        mass, keep = 0.0, set()
        for t in order:
            keep.add(t)
            mass += float(probs[t])
            if mass >= kw["top_p"]:
                break
        assert allowed <= keep
    if "min_p" in kw:
        assert all(probs[t] >= kw["min_p"] * probs.max() for t in allowed)
    assert set(_draws(params, x)) <= allowed


def test_sampling_follows_the_distribution():
    x = torch.tensor([0.0, 1.0, 2.0, -1.0])
    draws = _draws(SamplingParams(temperature=1.0, seed=0), x, 4000)
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / 4000
    assert (freq - x.softmax(-1)).abs().max() < 0.03


@pytest.mark.parametrize(
    "kw,param",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=-1), "max_tokens"),
    ],
)
def test_bad_sampling_values_name_the_parameter(kw, param):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw).validate()
    assert e.value.param == param and param in str(e.value)


def test_tiny_temperature_and_top_p_are_greedy_not_garbage():
    # 1e-38 overflows the logits to inf (NaN after softmax); 1e-46 rounds to 0 in fp32, which
    # used to mask every token. vLLM treats temperature < 1e-5 as greedy; so do we.
    x = _logits(2)
    assert int(x.argmax()) != 0  # NaN garbage would come out as token 0
    for kw in (dict(temperature=1e-38), dict(temperature=9e-6), dict(top_p=1e-46)):
        params = SamplingParams(**{"temperature": 1.0, **kw, "seed": 5})
        params.validate()
        assert _draws(params, x, 20) == [int(x.argmax())] * 20, kw
    assert SamplingParams(temperature=1e-38).greedy and not SamplingParams(temperature=1e-5).greedy


def test_engine_with_tiny_temperature_equals_greedy():
    from tiny import laneformer

    from expresslane.engine import Engine

    engine = Engine(laneformer(seed=3), max_model_len=64)
    prompt = [5, 9, 17, 33]
    want = list(engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    for kw in (dict(temperature=1e-38), dict(temperature=0.7, top_p=1e-46)):
        got = engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, seed=1, **kw))
        assert list(got) == want, kw
