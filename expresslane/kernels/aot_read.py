"""Reading an sm_90 build without a GPU: resources, load widths, layout conversions in loops,
occupancy, and the layouts that fix a row's summation order (kernels/aot.py compiles).

`resource_usage` and `load_widths` read the cubin through triton's bundled cuobjdump;
`loop_converts` and `reduce_layouts` read the TTGIR (`ttgir_of` builds it alone);
`blocks_per_sm` applies CUDA's occupancy rules to what they found.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .aot_launch import Launch


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


def cuobjdump(cubin: Path, flag: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), flag, str(cubin)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cuobjdump {flag} failed on {cubin.name}: {out.stderr.strip()}")
    return out.stdout


def resource_usage(cubin: Path) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of the cubin's kernel, read by triton's bundled cuobjdump."""
    text = cuobjdump(cubin, "-res-usage")
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def ttgir_of(launch: Launch, arch: int = 90) -> str:
    """The launch's TTGIR for sm_`arch`: triton.compile's first two stages and no more.

    The layouts are fixed there; LLVM and ptxas after them take as long again (the persistent
    step's 8-token build: 14 s to the TTGIR, 28 s to the cubin), and a reader of layouts needs
    neither. Nothing is cached. Where this triton's stages are not driven the way 3.9 drives
    them, the whole compile runs (`Launch.compile`), which gives the same text
    (tests/test_kernels_aot.py compares them)."""
    from triton.backends.compiler import GPUTarget

    src, target = launch.source(), GPUTarget("cuda", arch, 32)
    try:
        from triton._C.libtriton import ir
        from triton.compiler.compiler import make_backend

        backend = make_backend(target)
        options = backend.parse_options(dict(launch.options) | src.parse_options())
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                             backend.get_module_map(), context)  # fmt: skip
        stages: dict = {}
        backend.add_stages(stages, options, src.language)
        metadata = {"target": target, **options.__dict__}
        for ext in ("ttir", "ttgir"):
            module = stages[ext](module, metadata)
    except (ImportError, AttributeError, TypeError, KeyError):  # another triton's internals
        return launch.compile(arch).asm["ttgir"]
    return str(module)


def reduce_layouts(launch: Launch, arch: int = 90, sums_only: bool = False) -> list[tuple]:
    """Every reduction of the launch's sm_`arch` build, in program order, as (axis, the reduced
    axis's sizePerThread, threadsPerWarp, warpsPerCTA, its rank in `order`): what fixes the
    order in which a row's values are summed. `sums_only`: the floating-point sums alone (a
    max, a min or an argmax gives the same answer in any order)."""
    ttgir = ttgir_of(launch, arch)
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
        # a 32-wide sum is one warp's whatever num_warps is (tiles.rms_rstd relies on it).
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
