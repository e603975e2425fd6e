"""`--devices N`: one process per device, lanes (or heads) split over them.

`run_parallel(args, generate)` is `expresslane run` on N ranks: it spawns N processes (torch
multiprocessing, gloo on CPUs, NCCL with one GPU per rank), or, when launched by `torchrun`
(RANK / WORLD_SIZE / LOCAL_RANK in the environment), is itself one rank. Every rank loads only
its slices and runs the same generation (ParallelEngine role "spmd"); rank 0 prints exactly what
`run` prints, the others stay silent.

Across hosts (`--nnodes M --node-rank R --rdzv-endpoint HOST:PORT`, torchrun's flags; see
parallel/rendezvous.py) this host starts its devices/M ranks, which join the other hosts' at
HOST:PORT; a single local rank runs in this process. Every join and collective is bounded by
`--rdzv-timeout`.

For serve, `launch(args, main)` runs the command's own `main(args)` on rank 0 with a lead
engine (`load_engine(args)` returns it there) while ranks > 0 follow (ParallelEngine role
"lead"/"follow"). `spawn(fn, world, ...)` is the plain helper tests and benchmarks use
(`bench --devices N` spawns ranks that all run the same generations, like run).
`check_devices` turns a bad N (< 1, not dividing the lanes or heads, more GPUs than visible) into
one ConfigError (exit 2) before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ConfigError, ExpressLaneError
from ..step.threads import usable_cores
from . import rendezvous

_ROLE = {"role": "spmd"}  # the role load_engine gives this process's engine


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return r, w, int(os.environ.get("LOCAL_RANK", r))
    return None


def backend_for(device: str) -> str:
    """NCCL for GPUs, gloo for CPUs."""
    gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return "nccl" if gpu else "gloo"


def init_distributed(
    rank: int,
    world: int,
    device: str = "auto",
    port: int | None = None,
    threads: int = 0,
    rdzv: rendezvous.Rendezvous | None = None,
    timeout_s: float = rendezvous.DEFAULT_TIMEOUT_S,
) -> str:
    """Join the process group (at `rdzv`, 127.0.0.1:`port`, or torchrun's env); returns the
    device this rank computes on."""
    backend = backend_for(device)
    local = torchrun_env()[2] if torchrun_env() else rank
    if rdzv is not None:  # this host's GPUs count from 0
        local = rank - rdzv.local_ranks(world)[0]
    dev = f"cuda:{local}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(local)  # NCCL path: selectable, not exercised in our CI (no GPUs)
    else:
        torch.set_num_threads(threads or max(1, usable_cores() // world))
    if not dist.is_initialized():
        init, flags = "env://", "torchrun's MASTER_ADDR:MASTER_PORT"
        if rdzv is not None:
            init, flags, timeout_s = rdzv.init_method, "--rdzv-endpoint", rdzv.timeout_s
        elif port is not None:
            init = f"tcp://127.0.0.1:{port}"
        rendezvous.join(backend, rank, world, init, timeout_s, flags)
    return dev


def check_devices(devices: int, cfg, device: str = "auto") -> None:
    """Raise ConfigError, naming the flag, for a world the model or the machine cannot take."""
    from .placement import Placement

    if devices < 1:
        raise ConfigError(f"--devices {devices}: must be >= 1")
    Placement(cfg, 0, devices)  # must divide the lanes (a Llama: its heads and FFN units)
    if backend_for(device) == "nccl" and devices > torch.cuda.device_count():
        raise ConfigError(
            f"--devices {devices}: NCCL needs one GPU per rank, {torch.cuda.device_count()} visible"
        )


def _check_args(args: argparse.Namespace) -> None:
    """check_devices for run/serve, on the config of the model they would load."""
    from ..assets import model_path
    from ..checkpoint import load_config

    cfg = load_config(model_path(args.model))
    check_devices(args.devices, cfg, args.device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_one(rank, fn, world, port, device, threads, rdzv, args):
    """One rank in this process: join, run fn, leave the group (also after an error)."""
    dev = init_distributed(rank, world, device, port, threads, rdzv)
    try:
        return fn(rank, world, dev, *args)
    finally:
        dist.destroy_process_group()


def _entry(local, fn, world, port, device, threads, rdzv, offset, queue, args):
    rank = offset + local
    try:
        buf = io.BytesIO()  # tensors as bytes: shared-memory handles die with this process
        torch.save(_run_one(rank, fn, world, port, device, threads, rdzv, args), buf)
        queue.put((rank, buf.getvalue(), None))
    except BaseException as e:  # report, then let the other ranks fail on their collectives
        user = isinstance(e, ExpressLaneError) and len(e.args) == 1  # re-raised as itself
        queue.put((rank, None, e if user else f"{type(e).__name__}: {e}"))
        if not user:
            raise


def spawn(
    fn: Callable,
    world: int,
    *args,
    device: str = "cpu",
    threads: int = 0,
    rdzv: rendezvous.Rendezvous | None = None,
) -> list:
    """Run fn(rank, world, device, *args) on this host's ranks of `world` (all of them without
    `rdzv`), each in a new process (or in this one when it is the host's only rank); their
    results in rank order. A rank's ExpressLaneError is raised here as itself."""
    if world < 1:
        raise ConfigError(f"--devices {world}: must be >= 1")
    ranks = rdzv.local_ranks(world) if rdzv is not None else range(world)
    port = None if rdzv is not None else free_port()
    if rdzv is not None and len(ranks) == 1:
        return [_run_one(ranks[0], fn, world, port, device, threads, rdzv, args)]
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.spawn(
        _entry,
        args=(fn, world, port, device, threads, rdzv, ranks[0], queue, args),
        nprocs=len(ranks),
        join=False,
    )
    got = []  # read while they run: a big result blocks its sender until it is read
    while len(got) < len(ranks):
        if not queue.empty():
            got.append(queue.get())
        elif procs.join(timeout=0.05) and queue.empty():
            raise RuntimeError(f"{len(ranks) - len(got)} rank(s) exited without a result")
    with contextlib.suppress(Exception):  # a rank re-raising a user error exits non-zero
        while not procs.join():
            pass
    results = {r: (out, err) for r, out, err in got}
    for _, err in sorted(results.items()):
        if isinstance(err[1], ExpressLaneError):
            raise err[1]
    errors = [f"rank {r}: {e}" for r, (_, e) in sorted(results.items()) if e]
    if errors:
        raise RuntimeError("; ".join(errors))
    return [torch.load(io.BytesIO(results[r][0]), weights_only=False) for r in ranks]


# --- expresslane run --devices N ----------------------------------------------------------------
def load_engine(args: argparse.Namespace, device: str | None = None):
    """(ParallelEngine, Tokenizer) for this rank: its slices only."""
    from ..assets import model_path
    from ..tokenizer import Tokenizer
    from . import ParallelEngine

    path = str(model_path(args.model))
    engine = ParallelEngine.from_pretrained(
        path,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        device=device or _device_of_rank(args.device),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        role=_ROLE["role"],
        prefix_reuse=not getattr(args, "no_prefix_reuse", False),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        lora=getattr(args, "lora_pairs", ()),  # cli/run.py lora_from_args, set before launch
    )
    return engine, Tokenizer.from_dir(path)


def _device_of_rank(device: str) -> str:
    if backend_for(device) == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


# The command's own generation: (args, engine, tokenizer, extra figures) -> exit code. run.py
# passes it in (a module-level function, so it pickles into the spawned ranks), so this file
# never imports the command it serves.
Generate = Callable[[argparse.Namespace, object, object, dict], int]


def _run_rank(rank: int, world: int, device: str, args: argparse.Namespace, gen: Generate) -> int:
    engine, tok = load_engine(args, device)
    out = sys.stdout if rank == 0 else open(os.devnull, "w")  # noqa: SIM115
    with contextlib.redirect_stdout(out):  # every rank generates; rank 0 prints
        return gen(args, engine, tok, {"devices": world, "backend": dist.get_backend()})


def parallel_requested(args: argparse.Namespace) -> bool:
    """Several ranks: --devices N, a torchrun launch, or the multi-host flags."""
    multi = getattr(args, "nnodes", 1) != 1 or getattr(args, "rdzv_endpoint", None) is not None
    return args.devices != 1 or torchrun_env() is not None or multi


def _rendezvous(args: argparse.Namespace) -> rendezvous.Rendezvous | None:
    """The multi-host flags of the command line (None: one host, or a torchrun launch)."""
    rdzv = rendezvous.from_args(args, args.devices)
    if rdzv is not None and torchrun_env() is not None:
        raise ConfigError(
            "--nnodes/--node-rank/--rdzv-endpoint: torchrun started this process and placed "
            "the ranks already; give those flags to torchrun only"
        )
    return rdzv


def _torchrun_join(args: argparse.Namespace) -> tuple[int, int, str]:
    """(rank, world, device) of a torchrun rank, joined within --rdzv-timeout."""
    rank, world, _ = torchrun_env()
    timeout = getattr(args, "rdzv_timeout", None) or rendezvous.DEFAULT_TIMEOUT_S
    return rank, world, init_distributed(rank, world, args.device, timeout_s=timeout)


def run_parallel(args: argparse.Namespace, generate: Generate) -> int:
    """`expresslane run --devices N` (or one torchrun rank of it); returns the exit code."""
    rdzv = _rendezvous(args)
    if torchrun_env() is not None:  # torchrun started us: we are one rank
        return _run_rank(*_torchrun_join(args), args, generate)
    _check_args(args)
    return spawn(_run_rank, args.devices, args, generate, device=args.device, rdzv=rdzv)[0]


# --- serve: rank 0 runs the command, the others follow ----------------------------------------
_LEAD: dict = {}  # rank 0's lead engine inside launch(), to shut the followers down at the end


def in_launch() -> bool:
    """True on rank 0 inside launch(): cli.run.load_engine should call load_lead_engine."""
    return _ROLE["role"] == "lead"


def load_lead_engine(args: argparse.Namespace):
    """Rank 0's (ParallelEngine, Tokenizer) inside launch(): every call is mirrored by the rest."""
    engine, tok = load_engine(args)
    _LEAD["engine"] = engine
    return engine, tok


def _lead_entry(rank: int, world: int, device: str, args, main: Callable) -> int:
    _ROLE["role"] = "lead" if rank == 0 else "follow"
    try:
        if rank > 0:
            engine, _ = load_engine(args, device)
            engine.follow()  # raises GroupLostError when the group breaks
            return 0
        code = main(args)
        if _LEAD.get("engine") is not None and _LEAD["engine"].lost is not None:
            raise _LEAD["engine"].lost  # served its last answers; now say why, exit 1
        return code
    finally:
        if rank == 0 and "engine" in _LEAD:
            _LEAD.pop("engine").shutdown()
        _ROLE["role"] = "spmd"


def launch(args: argparse.Namespace, main: Callable[[argparse.Namespace], int]) -> int:
    """Run a command's `main` on rank 0 of `args.devices` ranks; ranks > 0 follow it."""
    rdzv = _rendezvous(args)
    if torchrun_env() is not None:
        return _lead_entry(*_torchrun_join(args), args, main)
    _check_args(args)
    return spawn(_lead_entry, args.devices, args, main, device=args.device, rdzv=rdzv)[0]
