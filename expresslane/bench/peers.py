"""The peers a decode benchmark measures beside ExpressLane: same machine, same run, same bytes.

A peer is a named factory in `PEERS` that takes a `PeerSetup` (the model, device, dtype and
bench settings) and returns a runner: `measure(context) -> row fields` and `close()`. The bench
(bench/decode.py) builds each peer lazily and runs it under its own guard, so a peer that cannot
run on this machine's versions leaves a row saying why and the others still come. A peer that
needs an argument is named `name=ARG` (`gpt-fast=/path/to/checkout`). To add a peer: a module of
its own with a factory, and one line in `PEERS`.

- `transformers`: `generate()`, eager, its default dynamic cache.
- `transformers+static+compile`: the gpt-fast recipe on a transformers model: a StaticCache and a
  one-token decode function compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)`
  (CUDA graphs on a GPU). The model's `forward` is never rebound: `generate()` on a rebound
  forward hands the compiled function a dict of masks and dynamo fails on it.
- `gpt-fast=DIR`: a gpt-fast checkout the user provides (bench/peer_gptfast.py).
- `llama.cpp=F32|F16|Q8_0`: llama-cpp-python on the same weights as a GGUF (bench/llamacpp.py).

A Llama-family model's peer runs on a copy of the very same weights; a Laneformer's on the
equal-byte Llama of the same dims (transformers cannot run a Laneformer), with random weights.
"""

from __future__ import annotations

import importlib
import inspect
import statistics
import time
from dataclasses import dataclass
from itertools import pairwise

import torch

from ..checkpoint import hf_name, to_hf_tensor
from ..config import ModelConfig
from ..model import Laneformer
from .weights import as_llama, random_model

# name -> "module:factory"; the module is imported only when the peer is asked for.
PEERS: dict[str, str] = {
    "transformers": "expresslane.bench.peers:transformers_eager",
    "transformers+static+compile": "expresslane.bench.peers:transformers_compiled",
    "gpt-fast": "expresslane.bench.peer_gptfast:gptfast",
    "llama.cpp": "expresslane.bench.llamacpp:llamacpp_peer",
}


@dataclass
class PeerSetup:
    """What every peer is given. `model` is ours (a same-architecture peer copies its weights);
    `compile_backend` is torch.compile's (the CPU dry run uses "eager": tracing, no codegen)."""

    cfg: ModelConfig
    model: Laneformer
    device: torch.device
    dtype: torch.dtype
    decode_tokens: int
    warmup_tokens: int
    max_len: int
    arg: str | None = None
    compile_backend: str = "inductor"
    shared: dict | None = None  # built once, used by every peer that needs it (the HF model)


def make_peer(spec: str, setup: PeerSetup):
    """The runner of the peer named by `spec` ("name" or "name=ARG")."""
    name, _, arg = spec.partition("=")
    if name not in PEERS:
        raise ValueError(f"peer {name!r}: expected one of {', '.join(PEERS)}")
    module, factory = PEERS[name].split(":")
    setup.arg = arg or None
    return getattr(importlib.import_module(module), factory)(setup)


def prompt_ids(vocab: int, context: int, device: torch.device) -> torch.Tensor:
    """The random prompt of every engine at this context (ids from 3: no special tokens)."""
    g = torch.Generator().manual_seed(context)
    return torch.randint(3, vocab, (1, context), generator=g).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Per-step wall time: CUDA events on a GPU (no sync inside the loop), perf_counter else."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def steps_s(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairwise(self.marks)]
        return [b - a for a, b in pairwise(self.marks)]


def timed_decode(step, token, position, setup: PeerSetup, context: int, ttft_s: float) -> dict:
    """Run `step(token, position) -> next token` warm-up + decode_tokens times; the median of
    the steady-state steps, as for ExpressLane's rows. `position` is advanced in place."""
    timer = Timer(setup.device)
    timer.mark()
    for _ in range(setup.warmup_tokens + setup.decode_tokens):
        token = step(token, position).clone()  # a CUDA-graph output is overwritten next replay
        position += 1
        timer.mark()
    med = statistics.median(timer.steps_s()[setup.warmup_tokens :])
    return {"ttft_ms": ttft_s * 1e3, "prefill_tok_s": context / ttft_s,
            "decode_tok_s": 1.0 / med, "ms_per_token": med * 1e3}  # fmt: skip


# --- transformers -------------------------------------------------------------------------------
def hf_model(setup: PeerSetup):
    """(transformers model on the device, its ModelConfig, note): our weights copied into it for a
    Llama; for a Laneformer the equal-byte Llama, random weights made on the device. Built once
    per setup: the eager and the compiled peer share it."""
    if setup.shared is None:
        setup.shared = {}
    if "hf_model" not in setup.shared:
        setup.shared["hf_model"] = _build_hf_model(setup)
    return setup.shared["hf_model"]


def _build_hf_model(setup: PeerSetup):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, src, note = setup.cfg, setup.model, "same weights"
    if cfg.family != "llama":
        cfg = as_llama(cfg)
        src = random_model(cfg, setup.device, setup.dtype, seed=1)
        note = "equal-byte Llama of the same dims"
    d = cfg.to_hf_dict()
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=setup.dtype)
    state = model.state_dict()
    with torch.no_grad():
        for n, p in src.named_parameters():
            state[hf_name(cfg, n)].copy_(to_hf_tensor(cfg, n, p))
    return model.eval(), cfg, note


class _Stamps:
    """A generate() streamer that only notes when each token arrives (the prompt comes first)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersEager:
    """`generate()` as a transformers user runs it: eager, dynamic cache, greedy. Each token's
    arrival is stamped by a streamer, so decode speed is the median step, as for every row."""

    name = "transformers"

    def __init__(self, setup: PeerSetup):
        self.setup = setup
        self.model, self.cfg, self.note = hf_model(setup)

    def _generate(self, ids: torch.Tensor, n: int) -> tuple[float, list[float]]:
        stamps = _Stamps()
        sync(self.setup.device)
        t = time.perf_counter()
        self.model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            pad_token_id=0, streamer=stamps)  # fmt: skip
        return t, stamps.times[1:]  # [0] is the prompt

    @torch.inference_mode()
    def measure(self, context: int) -> dict:
        s = self.setup
        ids = prompt_ids(self.cfg.vocab_size, context, s.device)
        self._generate(ids, 2)  # warm-up
        t0, times = self._generate(ids, s.warmup_tokens + s.decode_tokens + 1)
        ttft = times[0] - t0
        med = statistics.median([b - a for a, b in pairwise(times)][s.warmup_tokens :])
        return {"ttft_ms": ttft * 1e3, "prefill_tok_s": context / ttft, "decode_tok_s": 1 / med,
                "ms_per_token": med * 1e3, "cuda_graph": False, "fused_kernels": False,
                "pdl": False}  # fmt: skip

    def close(self) -> None:
        del self.model


def static_cache(model, max_len: int, device: torch.device, dtype: torch.dtype):
    """A transformers StaticCache for batch 1, across its constructor's versions."""
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    kw = {"config": model.config, "max_cache_len": max_len}
    for key, value in (("max_batch_size", 1), ("batch_size", 1), ("device", device),
                       ("dtype", dtype)):  # fmt: skip
        if key in params:
            kw[key] = value
    return StaticCache(**kw)


def decode_one_token(model, token, position, cache):
    """One greedy step on a StaticCache: what torch.compile captures (gpt-fast's recipe)."""
    out = model(input_ids=token, position_ids=position[None], cache_position=position,
                past_key_values=cache, use_cache=True)  # fmt: skip
    return out.logits[:, -1].argmax(-1, keepdim=True)


class TransformersCompiled:
    """A StaticCache and a compiled one-token step; the prefill runs eagerly."""

    name = "transformers+static+compile"

    def __init__(self, setup: PeerSetup):
        self.setup = setup
        self.model, self.cfg, self.note = hf_model(setup)
        self.cache = static_cache(self.model, setup.max_len, setup.device, setup.dtype)
        self.fullgraph = True
        self.step = self._compile(fullgraph=True)
        self.first_error = None

    def _compile(self, fullgraph: bool):
        mode = "reduce-overhead" if self.setup.device.type == "cuda" else None
        backend = self.setup.compile_backend
        fn = torch.compile(decode_one_token, mode=mode if backend == "inductor" else None,
                           fullgraph=fullgraph, backend=backend)  # fmt: skip
        return lambda token, position: fn(self.model, token, position, self.cache)

    @torch.inference_mode()
    def _run(self, context: int) -> dict:
        dev = self.setup.device
        ids = prompt_ids(self.cfg.vocab_size, context, dev)
        self.cache.reset()
        sync(dev)
        t = time.perf_counter()
        out = self.model(input_ids=ids, cache_position=torch.arange(context, device=dev),
                         past_key_values=self.cache, use_cache=True)  # fmt: skip
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        ttft = time.perf_counter() - t
        position = torch.tensor([context], device=dev)
        return timed_decode(self.step, token, position, self.setup, context, ttft)

    def measure(self, context: int) -> dict:
        try:
            row = self._run(context)
        except Exception as e:
            if not self.fullgraph:
                raise
            # a graph break this version cannot avoid: compile what it can, and say so
            self.first_error = f"fullgraph=True: {type(e).__name__}: {str(e)[:300]}"
            self.fullgraph = False
            torch._dynamo.reset()
            self.step = self._compile(fullgraph=False)
            row = self._run(context)
        cuda_graph = (self.setup.device.type == "cuda" and self.setup.compile_backend == "inductor"
                      and not _cudagraph_skips())  # fmt: skip
        row.update(cuda_graph=cuda_graph, fused_kernels=False, pdl=False,
                   fullgraph=self.fullgraph, backend=self.setup.compile_backend)  # fmt: skip
        if self.first_error:
            row["first_error"] = self.first_error
        return row

    def close(self) -> None:
        del self.model, self.cache, self.step


def _cudagraph_skips() -> int:
    """How often inductor fell back from CUDA graphs in this process (its own counter)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["inductor"].get("cudagraph_skips", 0))


def transformers_eager(setup: PeerSetup) -> TransformersEager:
    return TransformersEager(setup)


def transformers_compiled(setup: PeerSetup) -> TransformersCompiled:
    return TransformersCompiled(setup)
