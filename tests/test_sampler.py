"""Sampling: greedy = argmax, seeds reproduce, filters never pick a masked token."""

from __future__ import annotations

import pytest
import torch

from expresslane.config import SamplingParams
from expresslane.errors import RequestError
from expresslane.sampler import filter_logits, make_generator, sample


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
