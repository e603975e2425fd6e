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
from expresslane.sampling.params import SamplingParams
from expresslane.sampling.sampler import SamplerKnobs, logprobs_of, sample
from expresslane.step import graph as graph_mod
from expresslane.step.fused import FusedDecoder
from expresslane.step.protocol import EagerStep

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


@pytest.mark.parametrize("width", [1, 4], ids=["decode", "verify"])
@pytest.mark.parametrize("fused", [False, True], ids=["forward", "fused-reference"])
@pytest.mark.parametrize("name", SAMPLERS)
def test_decode_step_has_no_host_traffic(meta_model, monkeypatch, name, fused, width):
    """The body a CUDA graph captures (DecodeGraph's eager twin): two decode steps a replay,
    or one verify of the last token and 3 drafts (acceptance on the device)."""
    monkeypatch.setattr(graph_mod, "make_generator", lambda params, dev: None)
    cache = KVCache(meta_model.cfg, 64, device="meta", headroom=width - 1)  # rings: the drafts
    cache.static = True
    step = FusedDecoder(meta_model, cache, kernels=False) if fused else EagerStep(meta_model, cache)
    steps = 2 if width == 1 else 1
    g = graph_mod.DecodeGraph(step, SAMPLERS[name], width=width, steps=steps, capture=False)
    g.load(torch.zeros((width,), dtype=torch.long, device="meta"), position=20)  # past the window
    with NoHostTraffic():
        g._body()
    assert g.out.device.type == "meta" and g.out.shape == ((2,) if width == 1 else (width + 1,))


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


# --- on a GPU (the session's tests stage): the same samplers captured for real ---------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("fused", [False, True], ids=["forward", "fused"])
def test_every_sampler_is_captured_and_replayed_on_the_gpu(name, fused):
    """Capture, then 20 replays of 2 steps with CUDA's sync debug mode on 'error'; the tokens
    come from the vocabulary. The embedded model's shapes (random weights): the fused kernels
    run at them in `run --device cuda`."""
    from expresslane.assets import default_model_dir
    from expresslane.checkpoint import load_config
    from expresslane.engine import Engine
    from expresslane.model import Laneformer, init_weights

    cfg = load_config(default_model_dir())
    m = init_weights(Laneformer(cfg).to("cuda")).eval()
    eng = Engine(m, max_model_len=300, decode="graph")
    eng.prefill([1, 7, 9, 30, 11])
    step = FusedDecoder(m, eng.cache) if fused else EagerStep(m, eng.cache)
    g = graph_mod.DecodeGraph(step, SAMPLERS[name], steps=2)
    g.load(torch.tensor(5, device="cuda"), position=5)
    g.capture_buckets([g.live()])  # synchronises, by design: at load, never in a request
    assert g.graph is not None
    host = torch.empty(2, dtype=torch.long, pin_memory=True)
    token = torch.tensor(5, device="cuda")  # a host-to-device copy: made before the sync check
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            g.load(token, position=5)
            host.copy_(g.run(), non_blocking=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    assert ((host >= 0) & (host < cfg.vocab_size)).all()


@pytest.mark.gpu
@needs_cuda
def test_logprobs_are_captured_on_the_gpu():
    """logprobs_of inside a CUDA graph equals it eagerly."""
    logits = torch.randn(V, device="cuda")
    token = torch.tensor(3, device="cuda")
    eager = logprobs_of(logits, token, 4)
    for _ in range(2):  # warm-up on a side stream, as capture wants
        logprobs_of(logits, token, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = logprobs_of(logits, token, 4)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, eager, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_run_samples_with_top_p_on_the_gpu(capsys):
    """The first GPU run's crash: `run --device cuda --temperature 0.8 --top-p 0.9`. EOS is
    ignored: the embedded model may end sooner, and the count below is the check."""
    from expresslane.__main__ import main

    argv = ["run", "--device", "cuda", "--prompt", "def f(", "--max-tokens", "8", "--json",
            "--temperature", "0.8", "--top-p", "0.9", "--min-p", "0.01",
            "--top-k", "40", "--ignore-eos"]  # fmt: skip
    assert main(argv) == 0
    assert '"completion_tokens": 8' in capsys.readouterr().out
