"""The decode benchmark: TTFT, prefill and batch-1 decode speed, beside its peers, row by row.

For each context length: a random prompt of that many tokens is prefilled (time to first token,
prefill tokens/s), then `decode_tokens` tokens are generated; decode speed is the median of the
steady-state per-step times (CUDA events on a GPU, perf_counter on a CPU). Bytes read per token
come from the ceiling calculator (weights streamed + KV at that context), so utilisation is
bytes/token x tokens/s over the device's bandwidth. The peers (bench/peers.py) run on the very
same weights (a Llama-architecture model; for a Laneformer, the equal-byte Llama of the same
dims, said so in the table).

The run keeps what it measured. Rows come context-major (every engine and peer at the first
context before any at the next, so `--contexts 1024 128 4000` gives the headline comparison
first) and each is handed to `emit` as soon as it is measured. Every ExpressLane variant and every
peer runs under its own guard: a failure becomes a row with its error and the others go on. A
fused-kernel variant that fails is retried once with PDL off (EXPRESSLANE_PDL=0). Every row says
what really ran: the CUDA graph, the fused Triton kernels, PDL. Random weights are made on the
device (bench/weights.py).

`parallel_rows` is one rank of `bench --devices N`: every rank runs the same generations on its
ParallelEngine (role "spmd", no per-token flag), so the timings are those of `run --devices N`.
Bytes per token there count the whole model (all ranks), with the busiest rank's share beside.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import load_model, resolve_device, resolve_dtype
from ..config import ModelConfig
from ..engine import Engine
from ..sampling.params import SamplingParams
from ..step.choose import default_decode
from .ceiling import bytes_per_token
from .peers import PeerSetup, Timer, make_peer, prompt_ids


@dataclass(frozen=True)
class BenchConfig:
    contexts: tuple[int, ...] = (128, 1024)
    decode_tokens: int = 64
    warmup_tokens: int = 8
    device: str = "auto"
    dtype: str = "auto"
    # peers by name (bench/peers.py PEERS), "name=ARG" where one takes an argument
    peers: tuple[str, ...] = ("transformers",)
    compile: bool = False  # also run our engine with the torch.compile'd static step
    kernels: str = "auto"  # the fused Triton step: auto (on CUDA), on, off, or both (ablation)
    compile_backend: str = "inductor"  # the compiled peers' torch.compile backend
    prefill_dtype: str = "float32"  # a CPU's long prompts: fp32 or bf16 products (Engine)
    kv_cache_dtype: str = "auto"  # the model's, or on a CPU float16 / bfloat16 (Engine)
    lora: tuple[tuple[str, float], ...] = ()  # (adapter, scale): --peer llama.cpp rounds only
    # SamplingParams fields of a sampled draw (temperature, top_k, ...): () is greedy; with
    # --peer llama.cpp only, whose sampler chain draws the same way (bench/llamacpp.py)
    sampling: tuple[tuple[str, float], ...] = ()


def bench_engine(engine: Engine, cfg: BenchConfig, context: int) -> dict:
    prompt = prompt_ids(engine.cfg.vocab_size, context, torch.device("cpu"))[0].tolist()
    params = SamplingParams(max_tokens=cfg.decode_tokens + cfg.warmup_tokens, ignore_eos=True,
                            **dict(cfg.sampling))  # fmt: skip
    timer = Timer(engine.device)
    t0 = time.perf_counter()
    ttft, tokens = None, []
    for tok in engine.generate(prompt, params):
        timer.mark()
        tokens.append(tok)
        if ttft is None:
            ttft = time.perf_counter() - t0
    steps = timer.steps_s()[cfg.warmup_tokens :]
    med = statistics.median(steps)
    return {
        "ttft_ms": ttft * 1e3,
        "prefill_tok_s": context / ttft,
        "decode_tok_s": 1.0 / med,
        "ms_per_token": med * 1e3,
        "token_ids": tokens,
    }


def describe(e: BaseException) -> str:
    """An exception as one line for a row: its type and the start of its message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:400]}"


def fused_kernels(engine: Engine) -> bool:
    """Whether the engine's step runs the fused Triton kernels (not their reference twins)."""
    return engine.step_name == "fused kernels" and bool(engine.step.kernels)


class EngineRunner:
    """One ExpressLane variant (compile, kernels) over the shared model, built at its first row."""

    def __init__(self, model, cfg: BenchConfig, name: str, compiled: bool, kernels: str):
        self.model, self.cfg, self.name = model, cfg, name
        self.compiled, self.kernels = compiled, kernels
        self.engine: Engine | None = None
        self.pdl_error: str | None = None  # the failure a retry without PDL followed

    def _build(self) -> None:
        # prefix_reuse off: TTFT and prefill figures are those of whole prompts
        # the decode path `run` takes on this device (on a CPU: the packed step, C kernels)
        decode = default_decode(next(self.model.parameters()).device)
        self.engine = Engine(self.model, max_model_len=context_needed(self.cfg), decode=decode,
                             compile=self.compiled, kernels=self.kernels,
                             prefix_reuse=False, grammar_graphs=False,
                             prefill_dtype=self.cfg.prefill_dtype,
                             kv_cache_dtype=self.cfg.kv_cache_dtype)  # fmt: skip
        # one-time costs (imports, torch.compile, graph capture) stay out of the measured rows
        warm = SamplingParams(max_tokens=self.cfg.warmup_tokens, ignore_eos=True)
        list(self.engine.generate([1, 2, 3], warm))

    def _measure(self, context: int) -> dict:
        if self.engine is None:
            self._build()
        return bench_engine(self.engine, self.cfg, context)

    def measure(self, context: int) -> dict:
        try:
            row = self._measure(context)
        except Exception as e:
            if self.pdl_error is not None or not self._pdl_now():
                raise
            self.pdl_error = describe(e)  # once: the same kernels without PDL
            os.environ["EXPRESSLANE_PDL"] = "0"
            self.engine = None
            row = self._measure(context)
        row.update(self.flags())
        if self.pdl_error:
            row["pdl_retry_after"] = self.pdl_error
        return row

    def _pdl_now(self) -> bool:
        """Would this variant's kernels launch with PDL now?"""
        from ..kernels import use_triton

        p = next(self.model.parameters())
        if self.kernels == "off" or not use_triton(p):
            return False
        from ..kernels.gemv import pdl_enabled

        return pdl_enabled(p)

    def flags(self) -> dict:
        """What this variant really ran: a captured CUDA graph, Triton kernels, PDL."""
        eng = self.engine
        graph = any(g.graphs for g in eng.captures.graphs.values())
        if eng.step_name.startswith("packed"):  # a CPU
            return {"cuda_graph": graph, "fused_kernels": False, "pdl": False,
                    "step": eng.step_name}  # fmt: skip
        fused = fused_kernels(eng)
        pdl = fused and self._pdl_now()
        step = "fused" if fused else eng.step_name
        if eng.step_name == "fused kernels" and not fused:
            step = "fused (reference twins)"
        return {"cuda_graph": graph, "fused_kernels": fused, "pdl": pdl, "step": step}

    def close(self) -> None:
        self.engine = None


class PeerRunner:
    """A peer, built at its first row (its build's failure is that row's error)."""

    def __init__(self, spec: str, setup: PeerSetup):
        self.spec, self.setup = spec, setup
        self.name = spec.partition("=")[0]
        self.peer = None
        self.build_error: str | None = None

    def measure(self, context: int) -> dict:
        if self.build_error:  # said once in full; not built again for every context
            raise RuntimeError(f"not built: {self.build_error}")
        if self.peer is None:
            try:
                self.peer = make_peer(self.spec, self.setup)
            except Exception as e:
                self.build_error = describe(e)
                raise
        row = self.peer.measure(context)
        b = bytes_per_token(self.peer.cfg, context + 1, dtype_bytes=self.setup.dtype.itemsize)
        row.update(model=self.peer.note, bytes_per_token=b["total"],
                   achieved_gb_s=b["total"] * row["decode_tok_s"] / 1e9)  # fmt: skip
        return row

    def close(self) -> None:
        if self.peer is not None:
            self.peer.close()
        self.peer = None


def guarded_row(runner, context: int, model: str, devices: int = 1) -> dict:
    """runner.measure(context) as a row; any failure is the row's `error`, never the run's."""
    base = {"engine": runner.name, "model": model, "context": context, "devices": devices}
    try:
        return {**base, **runner.measure(context)}
    except Exception as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {**base, "error": describe(e)}


def run_bench(
    model_cfg: ModelConfig,
    cfg: BenchConfig,
    checkpoint: Path | None = None,
    bandwidth_tb_s: float | None = None,
    emit: Callable[[dict], None] | None = None,
) -> list[dict]:
    """One row per (engine or peer, context), context-major, each emitted when measured."""
    dev = resolve_device(cfg.device)
    dt = resolve_dtype(cfg.dtype, model_cfg, dev)
    if checkpoint is None:
        from .weights import random_model

        model = random_model(model_cfg, dev, dt)
    else:
        model = load_model(checkpoint, device=cfg.device, dtype=cfg.dtype, progress=False)
    runners = [
        EngineRunner(model, cfg, _variant_name(cfg, compiled, kernels), compiled, kernels)
        for compiled, kernels in _variants(cfg)
    ]
    setup = PeerSetup(model.cfg, model, dev, dt, cfg.decode_tokens, cfg.warmup_tokens,
                      context_needed(cfg), compile_backend=cfg.compile_backend)  # fmt: skip
    runners += [PeerRunner(spec, setup) for spec in cfg.peers]
    rows = []
    for ctx in cfg.contexts:
        for runner in runners:
            row = guarded_row(runner, ctx, model.cfg.model_type)
            if "decode_tok_s" in row and "bytes_per_token" not in row:
                _add_bytes(row, model.cfg, ctx, dt.itemsize, 1, bandwidth_tb_s)
            rows.append(row)
            if emit is not None:
                emit(row)
    for runner in runners:
        runner.close()
    setup.shared = None
    return rows


def _variants(cfg: BenchConfig) -> list[tuple[bool, str]]:
    """(compile, kernels) per engine; `both` measures what the fused kernels buy, fused first."""
    kernels = ("on", "off") if cfg.kernels == "both" else (cfg.kernels,)
    return [(c, k) for c in ((False, True) if cfg.compile else (False,)) for k in kernels]


def _variant_name(cfg: BenchConfig, compiled: bool, kernels: str) -> str:
    name = "expresslane" + ("+compile" if compiled else "")
    if cfg.kernels == "both":
        name += "+kernels" if kernels == "on" else " (no kernels)"
    elif kernels == "persistent":
        name += "+persistent"
    return name


def context_needed(cfg: BenchConfig) -> int:
    return max(cfg.contexts) + cfg.decode_tokens + cfg.warmup_tokens + 1


def _add_bytes(row: dict, model_cfg, ctx: int, dtype_bytes: int, devices: int, bw_tb_s) -> None:
    # the whole model's config (a ParallelEngine's too)
    b = bytes_per_token(model_cfg, ctx + 1, dtype_bytes=dtype_bytes, devices=devices)
    row.update(bytes_per_token=b["total"], achieved_gb_s=b["total"] * row["decode_tok_s"] / 1e9)
    if devices > 1:
        row["bytes_per_token_per_device"] = b["per_device"]["total"]
    if bw_tb_s:
        row["bw_util"] = row["achieved_gb_s"] / (bw_tb_s * 1e3)


def parallel_rows(rank: int, world: int, device: str, checkpoint: str, cfg: BenchConfig) -> list:
    """One rank of `bench --devices N`: its slices of `checkpoint`, the same rows on every rank."""
    from ..parallel import ParallelEngine

    engine = ParallelEngine.from_pretrained(
        checkpoint, rank, world, device=device, dtype=cfg.dtype, max_model_len=context_needed(cfg),
        prefix_reuse=False,  # cold prefill figures
    )  # fmt: skip
    list(engine.generate([1, 2, 3], SamplingParams(max_tokens=cfg.warmup_tokens, ignore_eos=True)))
    rows = []
    for ctx in cfg.contexts:
        row = {"engine": "expresslane", "model": engine.cfg.model_type, "context": ctx,
               "devices": world, **bench_engine(engine, cfg, ctx)}  # fmt: skip
        _add_bytes(row, engine.cfg, ctx, engine.dtype.itemsize, world, None)
        rows.append(row)
    return rows
