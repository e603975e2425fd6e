"""Compile the fused decode kernels for a GPU that is not here: sm_90 cubins on any machine.

A session without a GPU cannot run the kernels, but it can prove they build for Hopper with the
installed triton, and read what ptxas made of them. The launches are recorded, not run: the fused
decode step of a model config (preset or folder) runs on the meta device with every Triton
launch intercepted and the GPU's launch plan simulated (SM count, PDL: gemv.PLANNED_GPU), so the
tile sizes, grids and constexprs are exactly those an H100 would get. Each distinct (kernel,
argument types, constexprs, warps, stages) is then compiled by `triton.compile` for the target,
and `cuobjdump -res-usage` reads registers, spill memory and shared memory from the cubin.

    python -m expresslane.kernels.aot --model laneformer-2b [--arch 90] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import ConfigError
from ..presets import load_model_config

# Launch options that are not kernel parameters (triton's launch keywords).
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "launch_cooperative_grid")
_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as compiled: the kernel, its typed signature, constexprs and options."""

    kernel: object  # triton JITFunction
    signature: tuple[tuple[str, str], ...]  # (name, type) in parameter order
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]
    grid: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def label(self) -> str:
        keys = ("MODE", "SPLIT_K", "HAS_NORM", "HAS_WINDOW", "BLOCK_O", "BLOCK_N", "BLOCK_V")
        shown = [f"{k}={v}" for k, v in self.constexprs if k in keys]
        return f"{self.name}[{','.join(shown)}]"


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no triton type for a {type(value).__name__} argument")


def _as_launch(kernel, grid, args, kwargs) -> Launch:
    names = kernel.arg_names
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    sig, const = [], []
    for p in kernel.params:
        value = bound.get(p.name, p.default)
        if p.is_constexpr or value is None:
            sig.append((p.name, "constexpr"))
            const.append((p.name, value))
        else:
            sig.append((p.name, _arg_type(value)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _OPTIONS))
    grid = grid(bound) if callable(grid) else grid
    return Launch(kernel, tuple(sig), tuple(const), options, tuple(int(g) for g in grid))


@contextlib.contextmanager
def recording(sms: int = 132, pdl: bool = True):
    """Within: Triton launches are appended to the yielded list instead of running."""
    from triton.runtime.jit import JITFunction

    from . import gemv

    launches: list[Launch] = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(_as_launch(self, grid, args, kwargs))

    JITFunction.run = record
    gemv.PLANNED_GPU.update(sms=sms, pdl=pdl)
    try:
        yield launches
    finally:
        JITFunction.run = original
        gemv.PLANNED_GPU.clear()


def record_decode_step(model_ref: str, max_len: int, sms: int, pdl: bool, logits: bool = True):
    """The launches of one greedy decode step of the model, then (`logits`) of its logits path."""
    from ..cache import KVCache
    from ..config import SamplingParams
    from ..fused import FusedDecoder
    from ..model import Laneformer

    cfg = load_model_config(model_ref)  # every layer: meta tensors cost nothing
    with torch.device("meta"):
        model = Laneformer(cfg).to(device="meta", dtype=torch.bfloat16)
    cache = KVCache(cfg, max_len, "meta", torch.bfloat16)
    token = torch.zeros((1, 1), dtype=torch.long, device="meta")
    position = torch.zeros((1,), dtype=torch.long, device="meta")
    with recording(sms, pdl) as launches:
        decoder = FusedDecoder(model, cache, kernels=True)
        decoder.next_token(token, position, SamplingParams(temperature=0.0), None)
        if logits:
            decoder.logits(token, position)
    return launches


def distinct(launches: list[Launch]) -> list[Launch]:
    seen, out = set(), []
    for launch in launches:
        key = (launch.name, launch.signature, launch.constexprs, launch.options)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def compile_launch(launch: Launch, arch: int, workdir: Path) -> dict:
    """Compile for sm_`arch`; registers, spill bytes and shared memory from the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(launch.kernel, dict(launch.signature), dict(launch.constexprs))
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
    cubin = workdir / f"{launch.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = resource_usage(cubin)
    ptx = compiled.asm["ptx"]
    return {
        "kernel": launch.label(),
        "grid": list(launch.grid),
        "warps": dict(launch.options).get("num_warps", 4),
        "registers": usage.get("REG"),
        "spill_bytes": usage.get("LOCAL", 0) + usage.get("STACK", 0),
        "shared_bytes": max(usage.get("SHARED", 0), compiled.metadata.shared),
        "pdl": "griddepcontrol" in ptx,
    }


def resource_usage(cubin: Path) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, read by triton's bundled cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {cubin.name}: {out.stderr.strip()}")
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout)}


def compile_decode_step(
    model_ref: str, arch: int = 90, max_len: int = 4096, sms: int = 132
) -> list[dict]:
    """Every distinct kernel of the model's fused decode step, compiled for sm_`arch`."""
    pdl = arch >= 90
    launches = distinct(record_decode_step(model_ref, max_len, sms, pdl))
    with tempfile.TemporaryDirectory() as tmp:
        return [compile_launch(launch, arch, Path(tmp)) for launch in launches]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.kernels.aot", description=__doc__)
    ap.add_argument("--model", default="laneformer-2b", help="preset or checkpoint folder")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100)")
    ap.add_argument("--sms", type=int, default=132, help="SM count the launch plan assumes")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--json", action="store_true", help="only the JSON line")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: the interpreter has no compiler to record for",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        load_model_config(args.model)
        if args.arch < 80:  # bf16 arithmetic and the kernels' shuffles need Ampere or newer
            raise ConfigError(f"--arch {args.arch}: expected a compute capability x10 >= 80")
        if args.sms < 1:
            raise ConfigError(f"--sms {args.sms}: expected the GPU's SM count (>= 1)")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    greedy = len(record_decode_step(args.model, args.max_len, args.sms, True, logits=False))
    rows = compile_decode_step(args.model, args.arch, args.max_len, args.sms)
    if not args.json:
        print(f"{'kernel':58} {'grid':>14} {'warps':>5} {'regs':>5} {'spill':>6} {'smem':>7} pdl")
        for r in rows:
            grid = "x".join(map(str, r["grid"]))
            pdl = "yes" if r["pdl"] else "no"
            print(f"{r['kernel']:58} {grid:>14} {r['warps']:>5} {r['registers']:>5} "
                  f"{r['spill_bytes']:>6} {r['shared_bytes']:>7} {pdl}")  # fmt: skip
        print(f"launches per greedy decode step: {greedy}")
    print(json.dumps({"model": args.model, "arch": args.arch, "launches_per_step": greedy,
                      "kernels": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
