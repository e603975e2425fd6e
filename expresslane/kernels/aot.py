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
repacks' int8 in groups of 16).
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
from ..weights.gpu_pack import GPU_QUANTIZATIONS

# --quant's formats: the --quantization names, and the GGUF repacks' int8 in groups of 16
# (weights/gpu_pack.py's from_qtensor, for the types with a scale per 16 values), which no
# --quantization name asks for but `--quantization gguf` runs.
AOT_QUANT = {**GPU_QUANTIZATIONS, "gguf-int8-g16": ("int8", 16)}

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
    """One kernel launch as the JIT would compile it: the kernel, its typed signature, its
    constexprs (by name), the JIT's specialisation attributes, the options and the grid."""

    kernel: object  # triton JITFunction
    signature: tuple[tuple[str, str], ...]  # (name, type) in parameter order
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]  # launch keywords as given (num_warps, launch_pdl)
    grid: tuple[int, ...]
    attrs: tuple[tuple[tuple[int, ...], tuple], ...] = ()  # path -> (("tt.divisibility", 16),)
    # tensor arguments: (parameter name, shape, element bytes), for byte counts (bench/profile)
    tensors: tuple[tuple[str, tuple[int, ...], int], ...] = ()

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def label(self) -> str:
        keys = ("MODE", "SPLIT_K", "HAS_NORM", "HAS_WINDOW", "BLOCK_O", "BLOCK_N", "BLOCK_V",
                "INT4", "GROUP", "BLOCK_S")  # fmt: skip
        shown = [f"{k}={v}" for k, v in self.constexprs if k in keys]
        return f"{self.name}[{','.join(shown)}]"

    def aligned(self) -> list[str]:
        """The parameters specialised as divisible by 16."""
        names = [n for n, _ in self.signature]
        return [names[path[0]] for path, attr in self.attrs
                if any(a[0] == "tt.divisibility" for a in attr)]  # fmt: skip


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


def _unspecialised(kernel, bound: dict) -> tuple[dict, dict]:
    """(signature, constexprs) with no specialisation: the fallback where the binder is missing."""
    sig, const = {}, {}
    for p in kernel.params:
        value = bound.get(p.name, p.default)
        if p.is_constexpr or value is None:
            sig[p.name] = "constexpr"
            const[(kernel.arg_names.index(p.name),)] = value
        else:
            sig[p.name] = _arg_type(value)
    return sig, const


def _specialise(kernel, backend, args, kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs by path, attrs by path), by the runtime JIT's binder for `backend`
    (triton 3.6 and 3.9: create_function_from_signature + JITFunction._pack_args)."""
    from triton.runtime import jit

    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    return signature, constexprs, attrs


def _as_launch(kernel, grid, args, kwargs, backend=None) -> Launch:
    names = kernel.arg_names
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    if backend is not None:
        sig, const, attrs = _specialise(kernel, backend, args, kwargs)
    else:
        (sig, const), attrs = _unspecialised(kernel, bound), {}
    tensors = tuple((n, tuple(v.shape), v.element_size()) for n, v in bound.items()
                    if isinstance(v, torch.Tensor))  # fmt: skip
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _OPTIONS))
    grid = grid(bound) if callable(grid) else grid
    return Launch(
        kernel,
        tuple(sig.items()),
        tuple((names[path[0]], v) for path, v in sorted(const.items())),
        options,
        tuple(int(g) for g in grid),
        tuple(
            sorted((path, tuple(tuple(a) for a in attr)) for path, attr in attrs.items() if attr)
        ),  # fmt: skip
        tensors,
    )


def jit_backend(arch: int):
    """triton's CUDA backend for sm_`arch`: what the JIT would specialise and compile with."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", arch, 32))


@contextlib.contextmanager
def recording(sms: int = 132, pdl: bool = True, arch: int | None = 90):
    """Within: Triton launches are appended to the yielded list instead of running, specialised
    as the JIT would for sm_`arch` (None: unspecialised, only to count launches)."""
    from triton.runtime.jit import JITFunction

    from . import gemv

    launches: list[Launch] = []
    original = JITFunction.run
    backend = jit_backend(arch) if arch else None

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(_as_launch(self, grid, args, kwargs, backend))

    JITFunction.run = record
    gemv.PLANNED_GPU.update(sms=sms, pdl=pdl)
    try:
        yield launches
    finally:
        JITFunction.run = original
        gemv.PLANNED_GPU.clear()


def record_decode_step(model_ref: str, max_len: int, sms: int, pdl: bool, logits: bool = True,
                       arch: int | None = 90, dtype: torch.dtype = torch.bfloat16,
                       tokens: int = 1, persistent: bool = False):  # fmt: skip
    """The launches of one greedy decode step of the model, then (`logits`) of its logits path;
    tokens > 1: of a step of that many tokens (a speculative verify's width); `persistent`: of
    the one-launch step (step/persistent.py) instead of the fused kernels."""
    from ..cache import KVCache
    from ..config import SamplingParams
    from ..model import Laneformer
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


# Per-SM limits by compute capability x10: registers, threads, resident blocks, shared bytes.
SM_LIMITS = {
    80: (65536, 2048, 32, 164 << 10),
    86: (65536, 1536, 16, 100 << 10),
    89: (65536, 1536, 24, 100 << 10),
    90: (65536, 2048, 32, 228 << 10),
}


def blocks_per_sm(registers: int, warps: int, shared: int, arch: int) -> int:
    """Resident CTAs per SM (CUDA's occupancy rules: registers in 256-register units per warp,
    1 KB of shared memory reserved per block)."""
    regs, threads, blocks, smem = SM_LIMITS.get(arch, SM_LIMITS[90])
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = [blocks, threads // (32 * warps), regs // (per_warp * warps)]
    if shared:
        limits.append(smem // (shared + 1024))
    return max(0, min(limits))


def load_widths(sass: str) -> dict[str, int]:
    """Global loads by width in bits (`LDG.E.128` -> 128, `LDG.E.U16` -> 16, plain -> 32);
    `LDGSTS` (cp.async into shared memory) counted apart."""
    out: dict[str, int] = {}
    for op, mods in re.findall(r"\b(LDGSTS|LDG)((?:\.[A-Z0-9_]+)*)", sass):
        parts = mods.split(".")
        bits = next((b for b in ("128", "64") if b in parts), None)
        bits = bits or ("16" if {"U16", "S16"} & set(parts) else "8" if {"U8", "S8"} & set(parts)
                        else "32")  # fmt: skip
        key = bits if op == "LDG" else f"cp.async {bits}"
        out[key] = out.get(key, 0) + 1
    return out


def compile_launch(launch: Launch, arch: int, workdir: Path, sms: int = 132) -> dict:
    """Compile for sm_`arch` as the JIT would; registers, spills, shared memory, load widths."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {path: [list(a) for a in attr] for path, attr in launch.attrs}
    src = ASTSource(launch.kernel, dict(launch.signature), dict(launch.constexprs), attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
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
        "loads": load_widths(_cuobjdump(cubin, "-sass")),
        "loop_converts": loop_converts(compiled.asm["ttgir"]),
        "aligned_params": len(launch.aligned()),
        "pdl": "griddepcontrol" in compiled.asm["ptx"],
        # the memory semantics of each atomic (grid_sync.py's release / acquire counts)
        "atomics": sorted(set(re.findall(r"\batom\.[\w.]+", compiled.asm["ptx"]))),
    }


def loop_converts(ttgir: str, min_elements: int = 1024) -> int:
    """Layout conversions of tensors of >= min_elements inside a loop of the TTGIR: each one goes
    through shared memory on every trip. A weight tile converted for its accumulator (a 2-D load
    expanded to 3-D) cost every token-axis kernel 8-10 registers and a shared-memory round trip
    per tile; a streaming loop should convert none."""
    depth, loops, count = 0, [], 0
    for line in ttgir.splitlines():
        if "scf.for" in line and line.rstrip().endswith("{"):
            loops.append(depth)
        if loops and "ttg.convert_layout" in line:
            shape = re.search(r"-> tensor<([\dx]+)x\w+,", line)
            n = 1
            for d in shape.group(1).split("x") if shape else []:
                n *= int(d)
            count += n >= min_elements
        depth += line.count("{") - line.count("}")
        while loops and depth <= loops[-1]:
            loops.pop()
    return count


def _cuobjdump(cubin: Path, flag: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump {flag} failed on {cubin.name}: {out.stderr.strip()}")
    return out.stdout


def resource_usage(cubin: Path) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, read by triton's bundled cuobjdump."""
    text = _cuobjdump(cubin, "-res-usage")
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


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
) -> list[dict]:
    """Every distinct kernel of the model's fused decode step (or of its persistent step), then
    of its quantized products in the `quant` formats, compiled for sm_`arch` (`only`: the
    kernels whose name starts so)."""
    pdl = arch >= 90
    spec = arch if specialise else None
    launches = record_decode_step(model_ref, max_len, sms, pdl, arch=spec, tokens=tokens,
                                  persistent=persistent)  # fmt: skip
    if quant:
        launches += record_quant_products(model_ref, list(quant), sms, pdl, arch=spec)
    launches = distinct(launches)
    launches = [la for la in launches if only is None or la.name.startswith(only)]
    with tempfile.TemporaryDirectory() as tmp:
        return [compile_launch(launch, arch, Path(tmp), sms) for launch in launches]


# S = 1 is specialised to a constant; the rows per program follow S
_S_DEPENDENT = ("S", "BLOCK_S", "BLOCK_O", "BLOCK_P", "BLOCK_V")


def reduce_layouts(launch: Launch, arch: int = 90, sums_only: bool = False) -> list[tuple]:
    """Every reduction of the launch's sm_`arch` build, in program order, as (axis, the reduced
    axis's sizePerThread, threadsPerWarp, warpsPerCTA, its rank in `order`): what fixes the
    order in which a row's values are summed. `sums_only`: the floating-point sums alone (a
    max, a min or an argmax gives the same answer in any order)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {path: [list(a) for a in attr] for path, attr in launch.attrs}
    src = ASTSource(launch.kernel, dict(launch.signature), dict(launch.constexprs), attrs)
    ttgir = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options=dict(launch.options)).asm["ttgir"]  # fmt: skip
    layouts = {}
    for name, body in re.findall(r"^(#\w+) = #ttg\.blocked<\{(.*)\}>", ttgir, re.M):
        layouts[name] = {k: [int(v) for v in vals.split(",")]
                         for k, vals in re.findall(r"(\w+) = \[([\d, ]+)\]", body)}  # fmt: skip
    out = []
    for axis, body, shape, layout in re.findall(
        r'"tt\.reduce".*?<\{axis = (\d+) : i32\}>(.*?)\}\) : \(tensor<([^,]*), (#\w+)>',
        ttgir,
        re.S,
    ):
        if sums_only and "arith.addf" not in body:
            continue
        a, lay = int(axis), layouts.get(layout)
        if lay is None:
            out.append((a, layout))
            continue
        # Threads and warps beyond the axis's extent hold copies, which the reduction skips:
        # a 32-wide sum is one warp's whatever num_warps is (gemv.rms_rstd relies on it).
        dims = [int(d) for d in shape.split("x") if d.isdigit()]  # "32x256xf32" -> [32, 256]
        if a >= len(dims):  # not a tensor this pattern reads (a reduction of a scalar's type)
            out.append((a, layout))
            continue
        extent = dims[a]
        spt = min(lay["sizePerThread"][a], extent)
        lanes = min(lay["threadsPerWarp"][a], max(1, extent // spt))
        warps = min(lay["warpsPerCTA"][a], max(1, extent // (spt * lanes)))
        out.append((a, spt, lanes, warps, lay["order"].index(a)))
    return out


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
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    greedy = len(record_decode_step(args.model, args.max_len, args.sms, True, logits=False,
                                    arch=None, persistent=args.persistent))  # fmt: skip
    rows = compile_decode_step(args.model, args.arch, args.max_len, args.sms,
                               not args.unspecialised, args.kernel, tuple(args.quant),
                               args.tokens, args.persistent)  # fmt: skip
    if not args.json:
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
