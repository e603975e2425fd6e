"""CPU decode against llama.cpp: every engine measured once per round, rounds interleaved.

`expresslane bench MODEL --peer llama.cpp` lands here. The contestants, all in this process and
with the same thread count: our engine in each weight format asked for (fp32, 16-bit, int8:
the packed decode step, compiled with `--compile`), transformers on the same checkpoint (fp32),
and llama.cpp on the same weights written as GGUF F32, F16 and Q8_0 (bench/llamacpp.py; skipped
with a note when llama-cpp-python is not installed, or for a model it cannot run).

On a shared machine speed drifts with other processes' load: running every engine once per round,
round after round, exposes all of them to the same drift. Each row reports the min and the median
over rounds of the decode speed (each itself the median of per-token times after a warm-up) and
`same_tokens`: how many greedy tokens agree with our fp32 engine's before the first difference
(the prompt is the same random one for everyone).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..checkpoint import load_model
from ..config import ModelConfig
from ..engine import Engine
from ..gguf import find_gguf
from . import llamacpp
from .agreement import engine_for, same_prefix
from .decode import BenchConfig, bench_engine, context_needed
from .peers import PeerSetup, make_peer, prompt_ids

# our weight format -> the llama.cpp type that streams as many bytes per weight ("gguf": a GGUF
# checkpoint's own blocks, and llama.cpp runs that very file)
PEER_OF = {"float32": "F32", "bfloat16": "F16", "float16": "F16", "int8": "Q8_0",
           "int8-row": "Q8_0", "gguf": "file"}  # fmt: skip


@dataclass
class Contestant:
    name: str
    model: str  # what it runs (format, file type)
    run: Callable[[int], dict]  # context -> {ttft_ms, prefill_tok_s, decode_tok_s, token_ids}
    close: Callable[[], None] = field(default=lambda: None)


def ours_eager(checkpoint: Path, cfg: BenchConfig, max_len: int) -> Contestant:
    """The model's own forward per token (the reference path, and the CPU default before)."""
    model = load_model(checkpoint, device="cpu", dtype="float32", progress=False)
    engine = Engine(model, max_model_len=max_len, decode="eager", prefix_reuse=False,
                    kv_cache_dtype=cfg.kv_cache_dtype)  # cold  # fmt: skip
    note = "float32, model forward" + kv_note(cfg)
    return Contestant("expresslane eager", note, lambda ctx: bench_engine(engine, cfg, ctx))


def kv_note(cfg: BenchConfig) -> str:
    """What a row's weights column adds for a cache not in the model's dtype (llama.cpp's rows
    keep its own default, an f16 cache)."""
    return "" if cfg.kv_cache_dtype == "auto" else f", kv {cfg.kv_cache_dtype}"


def ours(checkpoint: Path, fmt: str, cfg: BenchConfig, max_len: int) -> Contestant:
    engine = engine_for(checkpoint, fmt, max_len, compile=cfg.compile,
                        kv_cache_dtype=cfg.kv_cache_dtype, lora=cfg.lora)  # fmt: skip
    if fmt == "gguf":
        fmt = "gguf " + "/".join(sorted(engine.model.packed.formats))
    fmt += " + LoRA merged" if cfg.lora else ""
    name = "expresslane" + ("+compile" if cfg.compile else "")
    note = f"{fmt}, compiled in {engine.compile_s:.1f} s" if cfg.compile else fmt
    note += kv_note(cfg)
    return Contestant(name, note, lambda ctx: bench_engine(engine, cfg, ctx))


def peer(spec: str, setup: PeerSetup) -> Contestant:
    """A peer of bench/peers.py (transformers, llama.cpp=TYPE, ...) as a contestant."""
    runner = make_peer(spec, setup)
    return Contestant(runner.name, runner.note, runner.measure, runner.close)


def llamacpp_peers(
    setup: PeerSetup, types: list[str], checkpoint: Path, lora=()
) -> tuple[list[Contestant], list[str]]:
    """llama.cpp on our weights, one contestant per GGUF type ("file": a GGUF checkpoint run as
    it is, with `lora`'s one adapter applied at run time); notes say what was skipped."""
    if not llamacpp.available():
        return [], [
            "llama.cpp peer skipped: llama-cpp-python is not installed (building it takes ~18 "
            'min on 2 cores: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python)'
        ]
    written = [t for t in types if t != "file"]  # the file itself: any architecture it runs
    why = llamacpp.unsupported(setup.model) if written else None
    notes = [why] if why is not None else []
    if llamacpp.has_amx():
        notes.append("llama.cpp without its extra buffer types (AMX, repacked layouts): on this "
                     "AMX CPU they crashed it (bench/llamacpp.py)")  # fmt: skip
    out = [peer(f"llama.cpp={t}", setup) for t in written] if why is None else []
    if "file" in types:
        path = find_gguf(checkpoint)
        runner = llamacpp.LlamaCppPeer(path, torch.get_num_threads(), n_ctx=setup.max_len,
                                       lora=lora[0] if lora else None,
                                       draw=(setup.shared or {}).get("draw"))  # fmt: skip
        s = setup

        def run(ctx: int) -> dict:
            prompt = prompt_ids(s.cfg.vocab_size, ctx, torch.device("cpu"))[0].tolist()
            return runner.generate(prompt, s.decode_tokens, s.warmup_tokens)

        note = f"the GGUF file ({path.name})" + (" + LoRA at run time" if lora else "")
        out.append(Contestant("llama.cpp", note, run, runner.close))
    return out, notes


def run_rounds(contestants: list[Contestant], contexts, rounds: int) -> list[dict]:
    """Every contestant once per (round, context), in order; one row per (contestant, context)."""
    got: dict[tuple[int, int], list[dict]] = {}
    for _ in range(rounds):
        for ctx in contexts:
            for i, c in enumerate(contestants):
                got.setdefault((i, ctx), []).append(c.run(ctx))
    rows = []
    for ctx in contexts:
        ref = got[(0, ctx)][0].get("token_ids", [])
        for i, c in enumerate(contestants):
            rs = [r for r in got[(i, ctx)] if r]
            if not rs:
                continue
            speeds = [r["decode_tok_s"] for r in rs]
            row = {
                "engine": c.name,
                "model": c.model,
                "devices": 1,
                "context": ctx,
                "rounds": len(rs),
                "ttft_ms": statistics.median(r["ttft_ms"] for r in rs),
                "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in rs),
                "decode_tok_s": statistics.median(speeds),
                "decode_tok_s_min": min(speeds),
            }
            if "token_ids" in rs[0]:
                row["same_tokens"] = same_prefix(rs[0]["token_ids"], ref)
                row["tokens"] = len(rs[0]["token_ids"])
            rows.append(row)
    return rows


def bench_vs_llamacpp(
    model_cfg: ModelConfig, cfg: BenchConfig, checkpoint: Path, formats: list[str], rounds: int,
    kv_cache_dtypes: list[str] | None = None,
) -> tuple[list[dict], list[str]]:  # fmt: skip
    """Rows for our formats (each with every KV cache dtype asked; default cfg's), transformers
    and llama.cpp's matching GGUF types; and notes."""
    max_len = context_needed(cfg)
    fmts = ["float32"] + [f for f in formats if f != "float32"]  # fp32 first: the reference
    kvs = kv_cache_dtypes or [cfg.kv_cache_dtype]
    t = time.perf_counter()
    contestants = [ours(checkpoint, f, replace(cfg, kv_cache_dtype=kv), max_len)
                   for f in fmts for kv in kvs]  # fmt: skip
    if not cfg.lora:  # the base model's forward and transformers' know no adapter
        contestants.append(ours_eager(checkpoint, cfg, max_len))
    model = load_model(checkpoint, device="cpu", dtype="float32", progress=False)
    draw = dict(cfg.sampling) or None  # a sampled draw: llama.cpp's own sampler chain
    setup = PeerSetup(model.cfg, model, torch.device("cpu"), torch.float32, cfg.decode_tokens,
                      cfg.warmup_tokens, max_len,
                      shared={"checkpoint": checkpoint, "draw": draw})  # fmt: skip
    if cfg.peers and not cfg.lora and draw is None:  # transformers' peer decodes greedily
        contestants.append(peer("transformers", setup))
    # with an adapter llama.cpp runs the file itself and applies it at run time (the types it
    # would write from our weights would be the base's)
    types = ["file"] if cfg.lora else list(dict.fromkeys(PEER_OF[f] for f in fmts))
    peers, notes = llamacpp_peers(setup, types, checkpoint, cfg.lora)
    contestants += peers
    if draw is not None:
        notes.append("sampled: " + ", ".join(f"{k} {v:g}" for k, v in draw.items())
                     + "; llama.cpp with its own sampler chain (bench/llamacpp.py)")  # fmt: skip
    notes.append(f"set-up (loads, compilation, GGUF writes) {time.perf_counter() - t:.0f} s")
    try:
        rows = run_rounds(contestants, cfg.contexts, rounds)
    finally:
        for c in contestants:
            c.close()
    return rows, notes


def table(rows: list[dict]) -> str:
    """One line per row: decode tok/s min and median over rounds, and greedy agreement."""
    head = (
        f"{'engine':<20} {'weights':<30} {'ctx':>5} {'TTFT ms':>8} {'decode min':>10} "
        f"{'median':>7} {'ms/tok':>7} {'x peer':>6} {'same tokens':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['speedup_vs_peer']:6.2f}" if "speedup_vs_peer" in r else f"{'':>6}"
        same = f"{r['same_tokens']}/{r['tokens']}" if "same_tokens" in r else ""
        lines.append(
            f"{r['engine']:<20} {r['model'][:30]:<30} {r['context']:>5} {r['ttft_ms']:8.1f} "
            f"{r['decode_tok_s_min']:10.1f} {r['decode_tok_s']:7.1f} "
            f"{1e3 / r['decode_tok_s']:7.2f} {ratio} {same:>12}"
        )
    return "\n".join(lines)
