"""The decode benchmark: TTFT, prefill and batch-1 decode speed, with a transformers peer.

For each context length: a random prompt of that many tokens is prefilled (time to first token,
prefill tokens/s), then `decode_tokens` tokens are generated; decode speed is the median of the
steady-state per-step times (CUDA events on a GPU, perf_counter on a CPU). Bytes read per token
come from the ceiling calculator (weights streamed + KV at that context), so utilisation is
bytes/token x tokens/s over the device's bandwidth. The peer is `transformers` generation on the
very same weights (a Llama-architecture model; for a Laneformer, the equal-byte Llama of the
same dims, said so in the table).

`parallel_rows` is one rank of `bench --devices N`: every rank runs the same generations on its
ParallelEngine (role "spmd", no per-token flag), so the timings are those of `run --devices N`.
Bytes per token there count the whole model (all ranks), with the busiest rank's share beside.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import torch

from ..checkpoint import load_model, resolve_device, resolve_dtype, save_model
from ..config import ModelConfig, SamplingParams
from ..engine import Engine
from ..model import Laneformer, init_weights
from .ceiling import bytes_per_token


@dataclass(frozen=True)
class BenchConfig:
    contexts: tuple[int, ...] = (128, 1024)
    decode_tokens: int = 64
    warmup_tokens: int = 8
    device: str = "auto"
    dtype: str = "auto"
    peer: bool = True
    peer_compile: bool = False
    compile: bool = False  # also run our engine with the torch.compile'd static step
    kernels: str = "auto"  # the fused Triton step: auto (on CUDA), on, off, or both (ablation)


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


def random_checkpoint(cfg: ModelConfig, out: Path, seed: int = 0) -> Path:
    """Random weights of real shape, saved as a checkpoint both engines can read."""
    model = init_weights(Laneformer(cfg), seed=seed)
    return save_model(model, out, dtype=cfg.dtype if cfg.dtype != "float32" else None)


def as_llama(cfg: ModelConfig) -> ModelConfig:
    """The Llama of equal byte count: same dims, one lane, replicate head (the peer's shape)."""
    d = cfg.to_hf_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        "sliding_window",
        "layer_types",
    )
    llama = {k: d[k] for k in keep}
    llama.update(model_type="llama", head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps)
    if "sliding_attention" in cfg.layer_types:
        llama.update(model_type="mistral")
    return ModelConfig.from_hf_dict(llama)


def bench_engine(engine: Engine, cfg: BenchConfig, context: int) -> dict:
    vocab = engine.cfg.vocab_size
    g = torch.Generator().manual_seed(context)
    prompt = torch.randint(3, vocab, (context,), generator=g).tolist()
    params = SamplingParams(max_tokens=cfg.decode_tokens + cfg.warmup_tokens, ignore_eos=True)
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


def bench_transformers(
    path: Path,
    cfg: BenchConfig,
    context: int,
    device: torch.device,
    dtype: torch.dtype,
    compiled: bool,
) -> dict | None:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    kw = {}
    if compiled:  # static cache + torch.compile, transformers' own fast path
        kw = {"cache_implementation": "static"}
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    g = torch.Generator().manual_seed(context)
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=g).to(device)

    def run(n: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        run(2)  # warm-up (and compile)
        first = min(run(1) for _ in range(2))
        n = cfg.decode_tokens
        total = run(n + 1)
    return {
        "ttft_ms": first * 1e3,
        "prefill_tok_s": context / first,
        "decode_tok_s": n / max(total - first, 1e-9),
    }


def run_bench(
    model_cfg: ModelConfig,
    cfg: BenchConfig,
    checkpoint: Path | None = None,
    bandwidth_tb_s: float | None = None,
) -> list[dict]:
    """One row per (engine, context). The same checkpoint feeds our engine and the peer."""
    tmp = tempfile.TemporaryDirectory()
    if checkpoint is None:
        checkpoint = random_checkpoint(model_cfg, Path(tmp.name) / "ours")
    model = load_model(checkpoint, device=cfg.device, dtype=cfg.dtype, progress=False)
    rows = []
    for compiled, kernels in _variants(cfg):
        engine = Engine(model, max_model_len=_max_len(cfg), compile=compiled, kernels=kernels)
        name = "expresslane" + ("+compile" if compiled else "")
        if cfg.kernels == "both":
            name += "+kernels" if kernels == "on" else " (no kernels)"
        rows += _engine_rows(engine, cfg, name, bandwidth_tb_s)
        del engine
    del model
    if cfg.peer:
        rows += _peer_rows(model_cfg, cfg, checkpoint, Path(tmp.name))
    tmp.cleanup()
    return rows


def _variants(cfg: BenchConfig) -> list[tuple[bool, str]]:
    """(compile, kernels) per engine row group; `both` measures what the fused kernels buy."""
    kernels = ("off", "on") if cfg.kernels == "both" else (cfg.kernels,)
    return [(c, k) for c in ((False, True) if cfg.compile else (False,)) for k in kernels]


def _max_len(cfg: BenchConfig) -> int:
    return max(cfg.contexts) + cfg.decode_tokens + cfg.warmup_tokens + 1


def parallel_rows(rank: int, world: int, device: str, checkpoint: str, cfg: BenchConfig) -> list:
    """One rank of `bench --devices N`: its slices of `checkpoint`, the same rows on every rank."""
    from ..parallel import ParallelEngine

    engine = ParallelEngine.from_pretrained(
        checkpoint, rank, world, device=device, dtype=cfg.dtype, max_model_len=_max_len(cfg)
    )
    return _engine_rows(engine, cfg, "expresslane", None, devices=world)


def _engine_rows(
    engine: Engine, cfg: BenchConfig, name: str, bandwidth_tb_s, devices: int = 1
) -> list[dict]:
    dtype_bytes = engine.dtype.itemsize
    # one-time costs (imports, torch.compile, graph capture) stay out of the measured rows
    list(engine.generate([1, 2, 3], SamplingParams(max_tokens=cfg.warmup_tokens, ignore_eos=True)))
    rows = []
    for ctx in cfg.contexts:
        r = bench_engine(engine, cfg, ctx)
        # engine.cfg is the whole model's config (a ParallelEngine's too)
        b = bytes_per_token(engine.cfg, ctx + 1, dtype_bytes=dtype_bytes, devices=devices)
        r.update(
            engine=name,
            model=engine.cfg.model_type,
            context=ctx,
            devices=devices,
            bytes_per_token=b["total"],
            achieved_gb_s=b["total"] * r["decode_tok_s"] / 1e9,
        )
        if devices > 1:
            r["bytes_per_token_per_device"] = b["per_device"]["total"]
        if bandwidth_tb_s:
            r["bw_util"] = r["achieved_gb_s"] / (bandwidth_tb_s * 1e3)
        rows.append(r)
    return rows


def _peer_rows(model_cfg: ModelConfig, cfg: BenchConfig, checkpoint: Path, tmp: Path) -> list:
    """transformers on the same weights (a Laneformer's peer: the equal-byte Llama)."""
    peer_path, note = checkpoint, "same weights"
    if model_cfg.family != "llama":
        peer_path = random_checkpoint(as_llama(model_cfg), tmp / "peer")
        note = "equal-byte Llama of the same dims"
    dev = resolve_device(cfg.device)
    dt = resolve_dtype(cfg.dtype, model_cfg, dev)
    rows = []
    for compiled in (False, True) if cfg.peer_compile else (False,):
        for ctx in cfg.contexts:
            r = bench_transformers(peer_path, cfg, ctx, dev, dt, compiled)
            if r is None:
                return rows
            name = "transformers" + ("+static+compile" if compiled else "")
            r.update(engine=name, model=note, context=ctx, devices=1)
            rows.append(r)
    return rows
