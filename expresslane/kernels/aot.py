"""Compile the fused decode kernels for a GPU that is not here: sm_90 cubins on any machine.

A session without a GPU cannot run the kernels, but it can prove they build for Hopper with the
installed triton, and read what ptxas made of them. The launches are recorded, not run: the fused
decode step of a model config (preset or folder) runs on the meta device with every Triton
launch intercepted and the GPU's launch plan simulated (SM count, PDL: gemv.PLANNED_GPU), so the
tile sizes, grids and constexprs are exactly those an H100 would get.

Each launch is specialised by the runtime JIT's own binder for the target (the code triton runs
at a real launch): pointers whose address is 16-byte aligned and integers divisible by 16 get
`tt.divisibility 16`, an integer equal to 1 becomes a constant, and so on. A meta tensor's
`data_ptr()` is its byte offset, so views are judged as on the GPU, whose allocations are aligned.
Without that specialisation ptxas cannot prove alignment: every load is a scalar 2-byte load and
the registers differ (seen with triton 3.6 and 3.9), so such a build describes other code.

Each distinct (kernel, argument types, specialisation, constexprs, options) is then compiled by
`triton.compile` for the target; `cuobjdump -res-usage` reads registers, spill memory and shared
memory from the cubin, and its SASS the width of every global load. `cvt` counts the layout
conversions of large tensors inside loops of the TTGIR (loop_converts): each one is a trip
through shared memory per loop iteration, and a streaming kernel should have none. Blocks per
SM follow from registers, warps and shared memory; waves are the grid over (SMs x blocks per
SM).

    python -m expresslane.kernels.aot --model laneformer-2b [--arch 90] [--quant int8 int4] [--json]

`--quant int8 int4` adds the quantized products of kernels/qgemv.py at the model's layer and
head shapes, 1 and 8 tokens, with and without the fused RMSNorm (`gguf-int8-g16`: the GGUF
repacks' int8 in groups of 16). `--plan`: the launches alone (kernel, grid, warps), nothing
compiled, in a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import ConfigError
from ..presets import load_model_config
from ..weights.gpu_pack import GPU_QUANTIZATIONS
from . import tuning
from .aot_launch import Launch, recording
from .aot_read import (
    blocks_per_sm,
    cuobjdump,
    load_widths,
    loop_converts,
    reduce_layouts,
    resource_usage,
)

# --quant's formats: the --quantization names, and the GGUF repacks' int8 in groups of 16
# (weights/gpu_pack.py's from_qtensor, for the types with a scale per 16 values), which no
# --quantization name asks for but `--quantization gguf` runs.
AOT_QUANT = {**GPU_QUANTIZATIONS, "gguf-int8-g16": ("int8", 16)}


def record_decode_step(model_ref: str, max_len: int, sms: int, pdl: bool, logits: bool = True,
                       arch: int | None = 90, dtype: torch.dtype = torch.bfloat16,
                       tokens: int = 1, persistent: bool = False):  # fmt: skip
    """The launches of one greedy decode step of the model, then (`logits`) of its logits path;
    tokens > 1: of a step of that many tokens (a speculative verify's width); `persistent`: of
    the one-launch step (step/persistent.py) instead of the fused kernels."""
    from ..cache import KVCache
    from ..model import Laneformer
    from ..sampling.params import SamplingParams
    from ..step.fused import FusedDecoder
    from ..step.persistent import PersistentDecoder

    cfg = load_model_config(model_ref)  # every layer: meta tensors cost nothing
    with torch.device("meta"):
        model = Laneformer(cfg).to(device="meta", dtype=dtype)
    cache = KVCache(cfg, max_len, "meta", dtype, headroom=tokens - 1)
    token = torch.zeros((tokens,), dtype=torch.long, device="meta")
    position = torch.zeros((1,), dtype=torch.long, device="meta")
    with recording(sms, pdl, arch) as launches:
        if persistent:
            decoder = PersistentDecoder(model, cache)
        else:
            decoder = FusedDecoder(model, cache, kernels=True)
        decoder.next_token(token, position, SamplingParams(temperature=0.0), None)
        if logits:
            decoder.forward(token, position)[0]
    return launches


def record_quant_products(model_ref: str, formats: list[str], sms: int, pdl: bool,
                          arch: int | None = 90, tokens: tuple[int, ...] = (1, 8)):  # fmt: skip
    """The launches of the quantized products (kernels/qgemv.py) of one layer of the model in
    each format of AOT_QUANT, for each token count, without and with the fused RMSNorm."""
    from ..weights.gpu_pack import CHUNK, GPUQuant
    from .qgemv import qgemv

    cfg = load_model_config(model_ref)
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    q, kv, f = cfg.num_heads * hd // L, cfg.num_kv_heads * hd // L, cfg.intermediate_size // L
    shapes = [(q + 2 * kv, D), (D, q), (2 * f, D), (D, f)]  # qkv, wo, gate/up, w2
    head = cfg.lm_head_type
    shapes.append((cfg.vocab_size // L, D) if head == "vocab_parallel" else
                  (cfg.vocab_size, L * D if head == "lane" else D))  # fmt: skip
    with recording(sms, pdl, arch) as launches, torch.device("meta"):
        for name in formats:
            fmt, group = AOT_QUANT[name]
            for i, (o, k) in enumerate(shapes):
                lanes = 1 if i == 4 and cfg.lm_head_type != "vocab_parallel" else L
                kp = -(-k // max(CHUNK, group)) * max(CHUNK, group)
                data = torch.empty(lanes, o, kp // 2 if fmt == "int4" else kp,
                                   dtype=torch.uint8 if fmt == "int4" else torch.int8)  # fmt: skip
                scale = torch.empty(lanes, o, kp // group, dtype=torch.float16)
                w = GPUQuant(fmt, group, k, data, scale, scale.clone() if fmt == "int4" else None)
                for s in tokens:
                    x = torch.empty(s, lanes, k, dtype=torch.bfloat16)
                    qgemv(w, x)
                    qgemv(w, x, norm_weight=torch.empty(k, dtype=torch.bfloat16))
    return launches


def distinct(launches: list[Launch]) -> list[Launch]:
    seen, out = set(), []
    for launch in launches:
        key = (launch.name, launch.signature, launch.constexprs, launch.options, launch.attrs)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def compile_launch(launch: Launch, arch: int, workdir: Path, sms: int = 132) -> dict:
    """Compile for sm_`arch` as the JIT would; registers, spills, shared memory, load widths."""
    compiled = launch.compile(arch)
    cubin = workdir / f"{launch.name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = resource_usage(cubin)
    warps = dict(launch.options).get("num_warps", 4)
    shared = max(usage.get("SHARED", 0), compiled.metadata.shared)
    blocks = blocks_per_sm(usage.get("REG", 0), warps, shared, arch)
    ctas = 1
    for g in launch.grid:
        ctas *= g
    return {
        "kernel": launch.label(),
        "grid": list(launch.grid),
        "warps": warps,
        "registers": usage.get("REG"),
        "spill_bytes": usage.get("LOCAL", 0) + usage.get("STACK", 0),
        "shared_bytes": shared,
        "blocks_per_sm": blocks,
        "waves": ctas / (sms * blocks) if blocks else None,
        "loads": load_widths(cuobjdump(cubin, "-sass")),
        "loop_converts": loop_converts(compiled.asm["ttgir"]),
        "aligned_params": len(launch.aligned()),
        "pdl": "griddepcontrol" in compiled.asm["ptx"],
        # the memory semantics of each atomic (grid_sync.py's release / acquire counts)
        "atomics": sorted(set(re.findall(r"\batom\.[\w.]+", compiled.asm["ptx"]))),
    }


def compile_decode_step(
    model_ref: str,
    arch: int = 90,
    max_len: int = 4096,
    sms: int = 132,
    specialise: bool = True,
    only: str | None = None,
    quant: tuple[str, ...] = (),
    tokens: int = 1,
    persistent: bool = False,
    plan_only: bool = False,
) -> list[dict]:
    """Every distinct kernel of the model's fused decode step (or of its persistent step), then
    of its quantized products in the `quant` formats, compiled for sm_`arch` (`only`: the
    kernels whose name starts so; `plan_only`: each launch's kernel, grid and warps, nothing
    compiled)."""
    pdl = arch >= 90
    spec = arch if specialise else None
    launches = record_decode_step(model_ref, max_len, sms, pdl, arch=spec, tokens=tokens,
                                  persistent=persistent)  # fmt: skip
    if quant:
        launches += record_quant_products(model_ref, list(quant), sms, pdl, arch=spec)
    launches = distinct(launches)
    launches = [la for la in launches if only is None or la.name.startswith(only)]
    if plan_only:
        return [{"kernel": la.label(), "grid": list(la.grid),
                 "warps": dict(la.options).get("num_warps", 4)} for la in launches]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        return [compile_launch(launch, arch, Path(tmp), sms) for launch in launches]


# S = 1 is specialised to a constant; the rows per program follow S
_S_DEPENDENT = ("S", "BLOCK_S", "BLOCK_O", "BLOCK_P", "BLOCK_V")


def persistent_invariance(model_ref: str, tokens: tuple[int, int] = (1, 8),
                          arch: int = 90) -> list[list]:  # fmt: skip
    """The distinct sum layouts (reduce_layouts) of the persistent decode kernel's builds for
    `tokens[0]` and `tokens[1]` tokens: the same set in both means that every row is summed in
    the same order whatever S is, as one launch's single warp count must allow."""
    out = []
    for n in tokens:
        (launch,) = distinct(record_decode_step(model_ref, 4096, 132, True, logits=False,
                                                arch=arch, tokens=n, persistent=True))  # fmt: skip
        out.append(sorted(set(reduce_layouts(launch, arch, sums_only=True)), key=str))
    return out


def invariance_report(model_ref: str, tokens: tuple[int, int] = (1, 8), arch: int = 90,
                      only: str | None = None) -> dict[str, list]:  # fmt: skip
    """For each kernel of the step that a `tokens[1]`-token build compiles differently from a
    `tokens[0]`-token one: both builds' reduction layouts (reduce_layouts). The same set in
    both (a per-token loop repeats its reduction S times) means that a row is summed in the same
    order whatever S is: the batch invariance of the compiled code, read without a GPU."""
    builds = {}
    for n in tokens:
        for la in distinct(record_decode_step(model_ref, 4096, 132, True, arch=arch, tokens=n)):
            if only is None or la.name.startswith(only):
                key = (la.name, tuple(c for c in la.constexprs if c[0] not in _S_DEPENDENT))
                builds.setdefault(key, {})[n] = la
    report = {}
    for by_n in builds.values():
        if len(by_n) == 2 and by_n[tokens[0]].constexprs != by_n[tokens[1]].constexprs:
            label = by_n[tokens[0]].label()
            report[label] = [reduce_layouts(by_n[n], arch) for n in tokens]
    return report


def _widths(loads: dict[str, int]) -> str:
    return " ".join(f"{k}x{v}" for k, v in sorted(loads.items(), key=lambda kv: kv[0]))


def parse_force(words: list[str]) -> tuple[str, dict]:
    """`--force KERNEL NAME=VALUE ...` -> (kernel, variant): integer values, as the sweep's."""
    kernel, *pairs = words
    if kernel not in tuning.KERNELS:
        raise ConfigError(f"--force {kernel}: expected one of {', '.join(tuning.KERNELS)}")
    if not pairs:
        raise ConfigError(f"--force {kernel}: expected NAME=VALUE pairs after the kernel")
    cfg = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not (sep and name and value.isdigit() and int(value) > 0):
            raise ConfigError(f"--force {pair!r}: expected NAME=VALUE, VALUE a positive integer")
        cfg[name] = int(value)
    return kernel, cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.kernels.aot", description=__doc__)
    ap.add_argument("--model", default="laneformer-2b", help="preset or checkpoint folder")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100)")
    ap.add_argument("--sms", type=int, default=132, help="SM count the launch plan assumes")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=1,
                    help="tokens per step (a verify of k drafts: k + 1, at most 8)")  # fmt: skip
    ap.add_argument("--kernel", default=None, help="only the kernels whose name starts so")
    ap.add_argument(
        "--unspecialised",
        action="store_true",
        help="compile without the JIT's alignment specialisation (not what runs)",
    )
    ap.add_argument("--quant", nargs="+", default=[], metavar="FORMAT",
                    help="also the quantized products (kernels/qgemv.py) in these --quantization "
                         "formats (int8 int4 ...), 1 and 8 tokens")  # fmt: skip
    ap.add_argument(
        "--persistent",
        action="store_true",
        help="the one-launch step's kernel (step/persistent.py), not the fused ones",
    )
    ap.add_argument(
        "--force",
        nargs="+",
        default=None,
        metavar="KERNEL NAME=VALUE",
        help="build with one kernel's variant pinned, as the sweep pins its "
        "VARIANTS (tuning.forcing): --force attention NUM_SPLITS=64 BLOCK_N=8",
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="the launch plan alone (kernel, grid, warps), nothing compiled",
    )
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
        for name in args.quant:
            if name not in AOT_QUANT:
                raise ConfigError(f"--quant {name!r}: expected one of {', '.join(AOT_QUANT)}")
        if not 1 <= args.tokens <= 8:
            raise ConfigError(f"--tokens {args.tokens}: expected 1 to 8")
        forced = parse_force(args.force) if args.force else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tuning.forcing(*forced) if forced else contextlib.nullcontext():
        greedy = len(record_decode_step(args.model, args.max_len, args.sms, True, logits=False,
                                        arch=None, persistent=args.persistent))  # fmt: skip
        rows = compile_decode_step(args.model, args.arch, args.max_len, args.sms,
                                   not args.unspecialised, args.kernel, tuple(args.quant),
                                   args.tokens, args.persistent, args.plan)  # fmt: skip
    if args.plan and not args.json:
        for r in rows:
            print(f"{r['kernel']:54} {'x'.join(map(str, r['grid'])):>10} {r['warps']:>5}")
    elif not args.json:
        print(f"{'kernel':54} {'grid':>10} {'warps':>5} {'regs':>4} {'spill':>5} {'smem':>6} "
              f"{'blk/SM':>6} {'waves':>5} cvt pdl  global loads (bits x count)")  # fmt: skip
        for r in rows:
            grid = "x".join(map(str, r["grid"]))
            waves = f"{r['waves']:.2f}" if r["waves"] is not None else "-"
            print(f"{r['kernel']:54} {grid:>10} {r['warps']:>5} {r['registers']:>4} "
                  f"{r['spill_bytes']:>5} {r['shared_bytes']:>6} {r['blocks_per_sm']:>6} "
                  f"{waves:>5} {r['loop_converts']:>3} {'yes' if r['pdl'] else 'no':3}  "
                  f"{_widths(r['loads'])}")  # fmt: skip
        print(f"launches per greedy decode step: {greedy}")
    print(json.dumps({"model": args.model, "arch": args.arch, "sms": args.sms,
                      "specialised": not args.unspecialised, "launches_per_step": greedy,
                      "kernels": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
