"""A request's path through the layers: how often it climbs back up them.

Imports run down the layers (test_imports.py), but a call can still climb: a callback, a hook or
an object handed down and called back. Each climb is a place where a lower layer depends on
what a higher one does. This test runs `Engine.generate_steps` under `sys.setprofile` (plain
and speculative decoding on the packed CPU step, greedy and sampled, and the eager engine with
logprobs) and lists every distinct call from a function of ours to a function of ours in a
higher layer of LAYERS (the nearest frame of ours counts as the caller; a generator resumed is a
call). Issue 25 asks for at most 8 on this path.
"""

from __future__ import annotations

import sys

import pytest
import tiny
from test_imports import layer_of

from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams
from expresslane.speculative.drafting import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work

MOST = 8
PROMPT = [5, 9, 5, 9, 11, 5, 9, 5]


def _ours(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "expresslane" or name.startswith("expresslane.") else None


def climbs(run) -> dict[tuple[str, str], int]:
    """{(caller, callee): calls} for every call of `run()` that climbs the layers."""
    found: dict[tuple[str, str], int] = {}

    def profile(frame, event, arg):
        if event != "call" or (callee := _ours(frame)) is None:
            return
        back = frame.f_back
        while back is not None and _ours(back) is None:
            back = back.f_back
        if back is None:
            return
        caller = _ours(back)
        up, down = layer_of(callee), layer_of(caller)
        if up is not None and down is not None and up < down:
            key = (f"{caller}.{back.f_code.co_name}", f"{callee}.{frame.f_code.co_name}")
            found[key] = found.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return found


def test_a_request_climbs_the_layers_at_most_8_times():
    model = tiny.laneformer(seed=2)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    packed = Engine(model, max_model_len=64, decode="graph", speculative=spec)
    plain = Engine(model, max_model_len=64, decode="graph")
    eager = Engine(model, max_model_len=64, speculative=spec)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    with_lp = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True)

    def run():
        for eng, params in ((packed, greedy), (packed, sampled), (plain, greedy),
                            (eager, with_lp)):  # fmt: skip
            steps = list(eng.generate_steps(PROMPT, params))
            assert len(steps) == 12

    found = climbs(run)
    print("\nclimbs:", *(f"{a} -> {b} ({n})" for (a, b), n in sorted(found.items())), sep="\n  ")
    assert packed.stats.extra is not None
    assert len(found) <= MOST, sorted(found)


def test_the_tracer_sees_a_climb():
    """The checker itself: a call from the engine into the sampler runs down; the prefix
    module calling an engine method back is a climb."""
    from expresslane import prefix

    eng = Engine(tiny.laneformer(seed=2), max_model_len=16)
    found = climbs(lambda: prefix.PrefixReuse(eng.cache).start([1, 2, 3], eng._agree_starts))
    assert ("expresslane.prefix.start", "expresslane.engine._agree_starts") in found
