"""The graph-capable decode step (static buffers), run eagerly here, equals the model's forward."""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

from expresslane.engine import Engine
from expresslane.generation import reference_generate
from expresslane.sampling.params import SamplingParams
from expresslane.step.fused import FusedDecoder
from expresslane.step.protocol import EagerStep


@pytest.fixture(scope="module")
def model():
    return tiny.laneformer(seed=5)


PROMPT = [1, 7, 9, 30, 11, 12, 40]


@pytest.mark.parametrize("steps", [1, 4])
def test_static_decode_equals_forward_for_200_greedy_steps(model, steps):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    ref = reference_generate(model, PROMPT, params, stop_ids=set())
    eng = Engine(model, max_model_len=220, decode="graph", steps_per_replay=steps)
    assert list(eng.generate(PROMPT, params)) == ref
    assert len(ref) == 200


def test_stop_token_in_the_middle_of_a_multi_step_replay(model):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    ref = reference_generate(model, PROMPT, params, stop_ids=set())
    # a stop id first produced at an index that is not a replay boundary (4 steps per replay)
    idx = next(i for i, t in enumerate(ref) if i % 4 in (1, 2) and i > 5 and t not in ref[:i])
    stop = SamplingParams(max_tokens=200, ignore_eos=True, stop_token_ids=(ref[idx],))
    eng = Engine(model, max_model_len=220, decode="graph", steps_per_replay=4)
    got = list(eng.generate(PROMPT, stop))
    assert got == ref[: idx + 1]
    assert eng.stats.finish_reason == "stop"
    # the engine is free and exact for the next request after stopping mid-replay
    assert list(eng.generate(PROMPT, params)) == ref


def test_seeded_sampling_same_in_graph_and_eager_modes(model):
    params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    eager = list(Engine(model, max_model_len=64, decode="eager").generate(PROMPT, params))
    graph = list(
        Engine(model, max_model_len=64, decode="graph", steps_per_replay=3).generate(PROMPT, params)
    )
    assert eager == graph


def clear_prefix(model, prompt, steps: int, min_gap: float = 1e-3) -> tuple[list[int], int]:
    """Eager greedy tokens and how many of them lie before the first near-tie: a step whose top-2
    logits are closer than `min_gap`, where another summation order (cuBLAS vs the fused
    kernels, graph vs eager) may pick the other token and every later token then differs."""
    params = SamplingParams(max_tokens=steps, ignore_eos=True, logprobs=2)
    eng = Engine(model, max_model_len=steps + len(prompt) + 8, decode="eager")
    tokens, clear = [], None
    for i, step in enumerate(eng.generate_steps(prompt, params)):
        tokens.append(step.token)
        (_, lp1), (_, lp2) = step.top_logprobs
        if clear is None and lp1 - lp2 < min_gap:  # a logprob gap is the logit gap
            clear = i
    return tokens, steps if clear is None else clear


def test_clear_prefix_stops_at_the_first_near_tie(model):
    """The guard the CUDA comparison below relies on, checked where it runs everywhere."""
    tokens, n = clear_prefix(model, PROMPT, 40, min_gap=1e-3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert tokens == reference_generate(model, PROMPT, params, stop_ids=set())
    _, n_strict = clear_prefix(model, PROMPT, 8, min_gap=10.0)  # every step counts as a tie
    assert n_strict == 0 and n == 40  # this fixture's first near-tie is at step 75


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_equals_eager_decode_256_steps(model):
    """Graph replay (the fused kernels where they run) gives eager's tokens up to the first
    near-tie of eager's logits; past it, either token is right and the sequences part."""
    m = model.to("cuda")
    try:
        eager, n = clear_prefix(m, PROMPT, 256)
        assert n >= 32, f"a near-tie at step {n}: too early to compare (pick another prompt)"
        params = SamplingParams(max_tokens=256, ignore_eos=True)
        for steps in (1, 4):
            eng = Engine(m, max_model_len=300, decode="graph", steps_per_replay=steps)
            graph = list(eng.generate(PROMPT, params))
            assert graph[:n] == eager[:n], (steps, n)
    finally:
        model.to("cpu")  # the module fixture: later tests expect it on the CPU


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"replicated_rmsn_scale": False, "lm_head_type": "lane"},
        {"lm_head_type": "replicate", "pre_norm_lane_agg": True, "broadcast_delay": 1},
    ],
)
def test_fused_step_with_reference_kernels_equals_forward(extra):
    m = tiny.laneformer(seed=6, **extra)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = reference_generate(m, PROMPT, params, stop_ids=set())
    eng = Engine(m, max_model_len=80, decode="graph", kernels="on", steps_per_replay=2)
    assert isinstance(eng.step, FusedDecoder) and not eng.step.kernels
    assert list(eng.generate(PROMPT, params)) == ref
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=4, ignore_eos=True)
    eager = list(Engine(m, max_model_len=80, decode="eager").generate(PROMPT, sampled))
    assert list(eng.generate(PROMPT, sampled)) == eager


def test_fused_logits_equal_the_model_forward(model):
    from expresslane.cache import KVCache
    from expresslane.step.fused import FusedDecoder

    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(model.cfg, max_len=32)
        cache.static = True
        dec = FusedDecoder(model, cache, kernels=False)
        got = torch.stack(
            [dec.forward(tokens[:, i : i + 1], torch.tensor([i]))[0] for i in range(len(PROMPT))]
        )
    assert (full - got).abs().max().item() <= 1e-4


def test_compiled_static_step_equals_forward(model):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = reference_generate(model, PROMPT, params, stop_ids=set())
    eng = Engine(model, max_model_len=40, compile=True, steps_per_replay=2)
    assert eng.decode == "graph" and eng.compile
    assert list(eng.generate(PROMPT, params)) == ref
    assert list(eng.generate(PROMPT[:3], params)) == reference_generate(
        model, PROMPT[:3], params, stop_ids=set()
    )


def test_warm_up_leaves_cache_inputs_and_rng_as_they_were(model):
    """Capture warms the step up first; on a full ring that must not eat keys still in the
    window, nor draws from the request's generator. The plain step does change them."""
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    eng = Engine(model, max_model_len=64, decode="graph", steps_per_replay=4)
    prompt = list(range(3, 3 + 30))  # longer than the 16-slot ring of the sliding layers
    graph = eng.captures.graph_for(params)
    logits = eng.prefill(prompt)
    graph.load(logits.argmax(), position=len(prompt))

    def state():
        c = eng.cache
        return [t.clone() for t in (*c.k, *c.v, *c.pos, graph.token, graph.pos, graph.out)] + [
            graph.generator.get_state()
        ]

    before = state()
    graph.warm_up()
    assert all(torch.equal(a, b) for a, b in zip(before, state(), strict=True))
    graph._body()  # what warm-up undoes
    assert not all(torch.equal(a, b) for a, b in zip(before, state(), strict=True))


def test_one_graph_serves_every_temperature_and_top_p(model):
    """The sampler values live in device buffers: a new temperature needs no new capture and
    gives the eager path's tokens for the same seed."""
    eng = Engine(model, max_model_len=64, decode="graph", steps_per_replay=2)
    eager = Engine(model, max_model_len=64, decode="eager")
    for temperature, top_p, min_p in [(0.7, 0.9, 0.05), (1.4, 0.6, 0.2), (1.0, 0.95, 0.01)]:
        p = SamplingParams(max_tokens=24, temperature=temperature, top_p=top_p, min_p=min_p,
                           seed=9, ignore_eos=True)  # fmt: skip
        assert list(eng.generate(PROMPT, p)) == list(eager.generate(PROMPT, p))
    assert len(eng.captures.graphs) == 1


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square(df), Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a**0.5) ** 3


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])],
)  # fmt: skip
def test_graph_sampling_follows_the_filtered_distribution(model, device):
    """Replays from one state draw from softmax(filter(logits)) (chi-square, p = 0.001): the
    graph's RNG advances per replay and the device-side filters are the CPU path's."""
    from expresslane.sampling.sampler import filter_logits
    from expresslane.step.graph import DecodeGraph

    m = copy.deepcopy(model).to(device)
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)  # peaked logits (std ~3): a wrong filter would show
    params = SamplingParams(temperature=1.5, top_k=12, top_p=0.9, seed=1)
    eng = Engine(m, max_model_len=32, decode="graph")
    eng.prefill(PROMPT)
    with torch.no_grad():
        ref = m(torch.tensor([[5]], device=device), cache=eng.cache)[0, -1]
    eng.prefill(PROMPT)  # the reference step above advanced the cache: start over
    probs = filter_logits(ref.cpu().double(), params).softmax(-1)
    graph = DecodeGraph(EagerStep(m, eng.cache), params, steps=1)
    n = 4000 if device == "cuda" else 2000
    counts = torch.zeros(probs.shape[0], dtype=torch.float64)
    for _ in range(n):
        graph.load(torch.tensor(5, device=device), position=len(PROMPT))
        counts[graph.run()[0].item()] += 1
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    expected = probs[support] * n
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    assert stat < chi_square_critical(int(support.sum()) - 1), stat


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_synchronisation_inside_the_replay_loop(model):
    """After capture, replays and the pinned copies run with CUDA's sync debug mode on 'error'."""
    from expresslane.step.graph import DecodeGraph

    m = model.to("cuda")
    try:
        params = SamplingParams(temperature=0.9, top_p=0.9, seed=2)
        eng = Engine(m, max_model_len=300, decode="graph")
        eng.prefill(PROMPT)
        graph = DecodeGraph(EagerStep(m, eng.cache), params, steps=4)
        graph.load(torch.tensor(5, device="cuda"), position=len(PROMPT))
        graph.capture_buckets([graph.live()])  # synchronises, by design: never in a request
        host = torch.empty(4, dtype=torch.long, pin_memory=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(50):
                host.copy_(graph.run(), non_blocking=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        model.to("cpu")  # the module fixture: later tests expect it on the CPU


def test_fused_step_refuses_what_it_cannot_run(model):
    from expresslane.config import ModelConfig
    from expresslane.errors import RequestError
    from expresslane.model import Laneformer

    with pytest.raises(RequestError, match="decode='eager'"):
        Engine(model, max_model_len=32, decode="eager", kernels="on")
    qwen2 = ModelConfig.from_hf_dict(
        dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    )  # fmt: skip
    # attention biases (and q/k norms) are the kernels' own since the fused norm_qkv took them
    assert Engine(Laneformer(qwen2), max_model_len=32, kernels="on").step_name == "fused kernels"
    with pytest.raises(RequestError, match="quantized projections"):
        from expresslane.kernels.qlinear import quantize_model

        Engine(quantize_model(Laneformer(qwen2), "int8"), max_model_len=32, kernels="on")
