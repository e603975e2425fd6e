"""`expresslane bench`: TTFT, prefill and decode tokens/s against a transformers peer.

A preset builds random weights of a real shape (on the device); a folder benchmarks that
checkpoint. Each row is printed as soon as it is measured (its table line, then `{"row": ...}`),
so a run that is killed keeps what it measured; then the whole table with the ratios, and one
JSON line last.

`--devices N` (or a torchrun launch) benchmarks the parallel engine: N ranks through
parallel/launch.py (gloo on CPUs, NCCL with one GPU per rank), every rank running the same
generations; rank 0 reports. A preset's random weights are written once to a temporary
checkpoint that every rank loads its slices from. The transformers peer is single-device only:
skipped there, with a note.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from ..bench import rounds, table
from ..bench.bandwidth import copy_bandwidth_gb_s, datasheet_tb_s
from ..bench.ceiling import bytes_per_token
from ..bench.decode import BenchConfig, parallel_rows, run_bench
from ..bench.weights import random_checkpoint
from ..cache import KV_CACHE_DTYPES
from ..checkpoint import load_config, resolve_device, resolve_model_dir
from ..config import ModelConfig
from ..errors import ConfigError
from ..parallel import launch
from ..presets import get_preset, preset_names
from ..speculative.drafting import SpeculativeConfig
from ..step.threads import choose_threads, usable_cores
from .model_flags import (
    add_lora_arguments,
    add_prefill_dtype_argument,
    add_speculative_argument,
    lora_from_args,
    speculative_from_args,
)
from .sampling import add_draw_arguments, bench_draw

HELP = "benchmark time to first token, prefill and batch-1 decode speed (with a peer baseline)"


PEER_FORMATS = ("float32", "bfloat16", "int8")  # --formats' default with --peer llama.cpp


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (or use --preset)")
    p.add_argument("--preset", default=None,
                   help=f"random weights of a real shape: {', '.join(preset_names())}")  # fmt: skip
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    add_prefill_dtype_argument(p)
    add_lora_arguments(p)
    p.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        choices=list(KV_CACHE_DTYPES),
        help="our engine's KV cache (run's flag); with --peer llama.cpp several, each a row of "
        "every format, in the same rounds (llama.cpp keeps its f16 cache)",
    )
    p.add_argument("--no-peer", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--peer",
        choices=("transformers", "llama.cpp"),
        default="transformers",
        help="llama.cpp: also llama-cpp-python on the same weights as GGUF F32/F16/Q8_0, every "
        "engine once per round (--rounds), min and median (expresslane/bench/rounds.py)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        choices=("float32", "bfloat16", "float16", "int8", "int8-row", "gguf"),
        default=None,
        help="with --peer llama.cpp: our CPU weight formats to run (gguf: a GGUF checkpoint's own "
        f"blocks, against llama.cpp on that very file; default: {' '.join(PEER_FORMATS)})",
    )
    p.add_argument("--rounds", type=int, default=3, help="with --peer llama.cpp: rounds")
    p.add_argument(
        "--peer-compile",
        action="store_true",
        help="also run transformers with its static cache and a compiled decode step (gpt-fast's "
        "recipe)",
    )
    p.add_argument(
        "--peer-compile-backend",
        default="inductor",
        choices=("inductor", "aot_eager", "eager"),
        help="torch.compile backend of the compiled peers (eager: trace only, a quick CPU check)",
    )
    p.add_argument(
        "--peer-gptfast",
        metavar="DIR",
        default=None,
        help="also time a gpt-fast checkout (its model.py and generate.py) on the same shape",
    )
    p.add_argument("--compile", action="store_true", help="also our engine's compiled step")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for both engines (default: run's rule)")  # fmt: skip
    p.add_argument(
        "--kernels",
        choices=("auto", "on", "off", "both", "persistent"),
        default="auto",
        help="the fused Triton decode step: auto = on CUDA; both = a row each (what they buy); "
        "persistent = the fused kernels' bodies as one launch a step",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=1,
        help="benchmark the parallel engine on N processes (gloo on CPU, NCCL on GPU); "
        "no peer baseline there",
    )
    add_speculative_argument(p)
    add_draw_arguments(p)  # sampled rows, with --peer llama.cpp
    p.add_argument("--quantization", choices=["int8", "int8-row"], default=None,
                   help="--speculative-config: weights as run's --quantization")  # fmt: skip
    p.add_argument("--repeats", type=int, default=1,
                   help="--speculative-config: runs per workload, alternating")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print only the JSON line")


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(args: argparse.Namespace) -> int:
    spec = speculative_from_args(args)  # exit 2 on a bad config, before anything loads
    if args.formats is not None and args.peer != "llama.cpp":  # else silently not what was asked
        raise ConfigError("--formats: only with --peer llama.cpp (the formats it is compared "
                          "with); without it the checkpoint runs as it loads")  # fmt: skip
    model_cfg, checkpoint = _source(args)
    if spec is not None:
        return _main_speculative(args, spec, model_cfg, checkpoint)
    if args.quantization is not None:
        raise ConfigError("--quantization: only with --speculative-config (the decode bench "
                          "compares formats with --peer llama.cpp --formats)")  # fmt: skip
    name = args.preset or str(checkpoint)
    if args.devices != 1 or launch.torchrun_env():
        return _main_parallel(args, model_cfg, checkpoint, name)
    device = resolve_device(args.device, model_cfg)
    if device.type == "cpu":  # the same thread count for our engine and the peer
        torch.set_num_threads(_threads(args, model_cfg, 1))
    cfg = _bench_config(args, str(device), peer=not args.no_peer)
    machine = _machine(device)
    if args.peer == "llama.cpp":  # our weight formats and llama.cpp's, in rounds
        if device.type != "cpu" or checkpoint is None:
            raise ConfigError("--peer llama.cpp: a checkpoint on the CPU (--device cpu)")
        fmts, n = args.formats or list(PEER_FORMATS), args.rounds
        kvs = list(dict.fromkeys(args.kv_cache_dtype))
        rows, notes = rounds.bench_vs_llamacpp(model_cfg, cfg, checkpoint, fmts, n, kvs)
        return _report(args, name, rows, machine, 1, notes, render=rounds.table)
    if not args.json:
        print(table.HEADER, flush=True)
    emit = None if args.json else _emitter(machine)
    rows = run_bench(model_cfg, cfg, checkpoint, emit=emit)
    return _report(args, name, rows, machine, devices=1)


def _emitter(machine: dict):
    """Print each row when it is measured: its table line and its JSON, flushed."""
    seen: list[dict] = []

    def emit(row: dict) -> None:
        _utilisation(row, machine)
        seen.append(row)
        table.compare(seen)
        print(table.line(row), flush=True)
        print(table.dumps({"row": row}), flush=True)
        note = table.versus(row, seen)
        if note:
            print(note, flush=True)

    return emit


def _source(args: argparse.Namespace) -> tuple[ModelConfig, Path | None]:
    """(config, checkpoint folder or None for a preset's random weights)."""
    if (args.model is None) == (args.preset is None):
        raise ConfigError("give either a checkpoint folder or --preset NAME")
    if args.preset:
        return get_preset(args.preset), None
    checkpoint = resolve_model_dir(args.model)
    return load_config(checkpoint), checkpoint


def _bench_config(args: argparse.Namespace, device: str, peer: bool) -> BenchConfig:
    peers = []
    if peer:
        peers.append("transformers")
        if args.peer_compile:
            peers.append("transformers+static+compile")
        if args.peer_gptfast:
            if not (Path(args.peer_gptfast).expanduser() / "generate.py").is_file():
                raise ConfigError(f"--peer-gptfast {args.peer_gptfast}: no generate.py there "
                                  "(expected a gpt-fast checkout)")  # fmt: skip
            peers.append(f"gpt-fast={args.peer_gptfast}")
    return BenchConfig(
        contexts=tuple(args.contexts),
        decode_tokens=args.decode_tokens,
        device=device,
        dtype=args.dtype,
        peers=tuple(peers),
        compile=args.compile,
        kernels=args.kernels,
        compile_backend=args.peer_compile_backend,
        prefill_dtype=args.prefill_dtype,
        kv_cache_dtype=_one_kv_cache_dtype(args),
        lora=_lora(args),
        sampling=bench_draw(args),
    )


def _lora(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--lora / --lora-scaled: in the llama.cpp rounds, one adapter (llama-cpp-python's one)."""
    pairs = lora_from_args(args)
    if pairs and (args.peer != "llama.cpp" or len(pairs) > 1):
        raise ConfigError("--lora: one adapter, with --peer llama.cpp (ours merged at load, "
                          "llama.cpp's applied at run time, in the same rounds)")  # fmt: skip
    return pairs


def _one_kv_cache_dtype(args: argparse.Namespace) -> str:
    """The first --kv-cache-dtype; several only where rounds compare them (--peer llama.cpp)."""
    if len(set(args.kv_cache_dtype)) > 1 and args.peer != "llama.cpp":
        raise ConfigError("--kv-cache-dtype: several only with --peer llama.cpp (its rounds "
                          "compare them); otherwise one")  # fmt: skip
    return args.kv_cache_dtype[0]


def _threads(args: argparse.Namespace, cfg: ModelConfig, devices: int) -> int:
    """--threads; else on one device the rule of threads.py, on N one per 128 MB per rank."""
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads {args.threads}: must be at least 1")
        return args.threads
    nbytes = bytes_per_token(cfg, 1, dtype_bytes=4, devices=devices)["per_device"]["weights"]
    if devices == 1:  # idle cores and the bytes a step streams (expresslane/step/threads.py)
        return choose_threads(nbytes)
    cores = max(1, usable_cores() // devices)
    return min(cores, max(1, nbytes // (128 << 20)))


def _machine(device: torch.device) -> dict:
    """What the figures were measured on, with its copy bandwidth (the utilisation denominator)."""
    sheet = datasheet_tb_s(device)
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "copy_gb_s": copy_bandwidth_gb_s(device),
        "datasheet": sheet,
    }


# --- --speculative-config: plain vs speculative decoding on the shipped workloads -----------------
def _main_speculative(args, spec: SpeculativeConfig, model_cfg, checkpoint: Path | None) -> int:
    from ..bench.speculative import run_speculative_bench, spec_table
    from ..step.choose import default_decode
    from ..tokenizer import Tokenizer
    from ..weights.packing import load_packed

    if checkpoint is None:
        raise ConfigError("--speculative-config: the workloads are text: give a checkpoint "
                          "folder with a tokenizer instead of --preset")  # fmt: skip
    if args.repeats < 1:
        raise ConfigError(f"--repeats {args.repeats}: must be at least 1")
    device = resolve_device(args.device, model_cfg)
    if device.type == "cpu":
        torch.set_num_threads(_threads(args, model_cfg, 1))
    # both engines as `run` builds them here: on a CPU the packed step (and the packed verify)
    model = load_packed(checkpoint, str(device), args.dtype, args.quantization, progress=False)
    tok = Tokenizer.from_dir(checkpoint)
    machine = _machine(device)
    rows, by_kind, cost = run_speculative_bench(
        model, tok, spec, repeats=args.repeats, compile=args.compile, decode=default_decode(device)
    )
    summary = {
        "model": str(checkpoint),
        "device": machine["device"],
        "device_name": machine["device_name"],
        "threads": machine["threads"],
        "commit": _commit(),
        "speculative_config": {"method": spec.method, **{
            k: getattr(spec, k) for k in ("num_speculative_tokens", "prompt_lookup_max",
                                          "prompt_lookup_min")}},
        "repeats": args.repeats,
        "weights": getattr(getattr(model, "packed", None), "fmt", args.dtype),
        "decode": cost["path"],
        "note": "plain and speculative runs interleaved in one process (order alternates)",
        "geomean_speedup": by_kind,
        "verify_cost": cost,
        "rows": rows,
    }  # fmt: skip
    if not args.json:
        print(spec_table(rows, by_kind, cost))
    print(table.dumps(summary), flush=True)
    return 0


# --- --devices N: one process per device -------------------------------------------------------
def _main_parallel(args, model_cfg: ModelConfig, checkpoint: Path | None, name: str) -> int:
    env = launch.torchrun_env()
    world = env[1] if env else args.devices
    launch.check_devices(world, model_cfg, args.device)
    if args.compile:
        raise ConfigError(
            f"--compile: the parallel engine (--devices {world}) has no compiled step"
        )
    if args.kernels not in ("auto", "off"):
        raise ConfigError(
            f"--kernels {args.kernels}: the parallel engine (--devices {world}) has no fused step"
        )
    cfg = _bench_config(args, args.device, peer=False)
    threads = _threads(args, model_cfg, world)
    with tempfile.TemporaryDirectory(prefix="expresslane-bench-") as tmp:
        if checkpoint is None:  # under torchrun every rank writes the same seeded weights
            checkpoint = random_checkpoint(model_cfg, Path(tmp) / "model")
        if env is None:
            ranks = launch.spawn(
                _rank, world, str(checkpoint), cfg, device=args.device, threads=threads
            )
            out = ranks[0]
        else:
            dev = launch.init_distributed(env[0], world, args.device, threads=threads)
            out = _rank(env[0], world, dev, str(checkpoint), cfg)
            if env[0] > 0:
                return 0
    notes = []
    if not args.no_peer:
        notes.append("transformers peer skipped: it runs on one device (--devices 1 runs it)")
    return _report(args, name, out["rows"], out["machine"], world, notes)


def _rank(rank: int, world: int, device: str, checkpoint: str, cfg: BenchConfig) -> dict | None:
    """Every rank decodes; rank 0 then measures its device's copy bandwidth and reports."""
    rows = parallel_rows(rank, world, device, checkpoint, cfg)
    return {"rows": rows, "machine": _machine(torch.device(device))} if rank == 0 else None


def _utilisation(r: dict, machine: dict) -> None:
    """The row's achieved bandwidth over the copy measured here and over the datasheet."""
    copy_gb_s, sheet = machine["copy_gb_s"], machine["datasheet"]
    if "achieved_gb_s" in r:
        r["copy_bw_util"] = r["achieved_gb_s"] / copy_gb_s
        if sheet:
            r["datasheet_bw_util"] = r["achieved_gb_s"] / (sheet[1] * 1e3)


def _report(args, name: str, rows: list, machine: dict, devices: int, notes=(), render=None) -> int:
    copy_gb_s, sheet = machine["copy_gb_s"], machine["datasheet"]
    for r in rows:
        _utilisation(r, machine)
    table.compare(rows)
    summary = {
        "model": name,
        "device": machine["device"],
        "devices": devices,
        "device_name": machine["device_name"],
        "threads": machine["threads"],
        "copy_gb_s": round(copy_gb_s, 1),
        "datasheet_tb_s": sheet[1] if sheet else None,
        "commit": _commit(),
        "notes": list(notes),
        "rows": rows,
    }
    if not args.json:
        print((render or table.table)(rows))
        print(
            f"copy bandwidth {copy_gb_s:.1f} GB/s (read+write) on {summary['device_name']}"
            + (f" (rank 0 of {devices})" if devices > 1 else "")
            + (f"; datasheet {sheet[0]} {sheet[1]} TB/s" if sheet else "")
        )
        for note in notes:
            print(f"note: {note}")
    print(table.dumps(summary), flush=True)
    return 0
