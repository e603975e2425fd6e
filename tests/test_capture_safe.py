"""Every sampler and the decode step hold no host traffic: what a CUDA graph capture needs.

The first GPU run crashed every top_p request at `drop[..., 0] = False` ("Cannot copy between
CPU and CUDA tensors during CUDA graph capture") while 830 CPU tests passed. Here the decode
step (the model's forward on the static cache and the fused step's reference wiring, with the
sampler) and the sampler alone run on the `meta` device under `NoHostTraffic`
(tests/host_traffic.py), which fails on any sync, host-to-device copy or host tensor inside.
`meta` holds no generator: the draws take the default one, which changes no op of the step.
"""

from __future__ import annotations

import pytest
import torch
from host_traffic import HostTraffic, NoHostTraffic
from tiny import laneformer

from expresslane.cache import KVCache
from expresslane.config import SamplingParams
from expresslane.sampler import SamplerKnobs, logprobs_of, sample
from expresslane.step import graph as graph_mod
from expresslane.step.fused import FusedDecoder

SAMPLERS = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "top_k": SamplingParams(temperature=0.8, top_k=5),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p": SamplingParams(temperature=0.8, min_p=0.05),
    "all": SamplingParams(temperature=0.7, top_k=7, top_p=0.8, min_p=0.02, seed=3),
}
V = 64
HOST_VECTOR = torch.ones(V)  # made outside the step, on the host


@pytest.fixture(scope="module")
def meta_model():
    return laneformer().to("meta")


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("knobs", [False, True], ids=["floats", "knobs"])
def test_sampler_has_no_host_traffic(name, knobs):
    """Both forms: the captured step's (values in device buffers) and the eager pick's."""
    params = SAMPLERS[name]
    k = SamplerKnobs("meta") if knobs else None
    logits = torch.empty(V, device="meta")
    with NoHostTraffic():
        tok = sample(logits, params, None, k)
    assert tok.shape == () and tok.device.type == "meta"


@pytest.mark.parametrize("top_n", [0, 3])
def test_logprobs_have_no_host_traffic(top_n):
    logits, token = torch.empty(V, device="meta"), torch.zeros((), dtype=torch.long, device="meta")
    with NoHostTraffic():
        lp, ids, vals = logprobs_of(logits, token, top_n)
    assert lp.shape == () and (ids is None) == (top_n == 0)
    if top_n:
        assert ids.shape == vals.shape == (top_n,)


@pytest.mark.parametrize("fused", [False, True], ids=["forward", "fused-reference"])
@pytest.mark.parametrize("name", SAMPLERS)
def test_decode_step_has_no_host_traffic(meta_model, monkeypatch, name, fused):
    """The body a CUDA graph captures (DecodeGraph's eager twin), two steps a replay."""
    monkeypatch.setattr(graph_mod, "make_generator", lambda params, dev: None)
    cache = KVCache(meta_model.cfg, 64, device="meta")
    cache.static = True
    decoder = FusedDecoder(meta_model, cache, kernels=False) if fused else None
    g = graph_mod.DecodeGraph(meta_model, cache, SAMPLERS[name], steps=2, capture=False,
                              decoder=decoder)  # fmt: skip
    g.load(torch.zeros((), dtype=torch.long, device="meta"), position=20)  # past the window
    with NoHostTraffic():
        g._body()
    assert g.out.device.type == "meta" and g.out.shape == (2,)


def test_the_mode_catches_the_top_p_crash():
    """The first GPU run's line: the mode fails where the CUDA capture failed."""
    drop = torch.empty(V, device="meta") > 0
    with NoHostTraffic(), pytest.raises(HostTraffic, match="Python scalar written"):
        drop[..., 0] = False


@pytest.mark.parametrize(
    "leak, match",
    [
        (lambda x: x.sum().item(), "sync"),
        (lambda x: x[torch.zeros((), dtype=torch.long, device="meta")], "sync"),
        (lambda x: x * torch.tensor(2.0), "host data"),
        (lambda x: x + HOST_VECTOR, "host tensors mixed"),
        (lambda x: x.cpu(), "host tensors mixed"),
        (lambda x: torch.arange(V) + x, "made on the host"),
    ],
    ids=["item", "tensor-index", "torch.tensor", "cpu-tensor", "cpu()", "factory"],
)
def test_the_mode_catches_each_kind_of_host_traffic(leak, match):
    with NoHostTraffic(), pytest.raises(HostTraffic, match=match):
        leak(torch.empty(V, device="meta"))
