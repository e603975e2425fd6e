"""What a kernel boundary costs against a grid barrier: the persistent kernel's first question.

docs/persistent-kernel.md plans one decode kernel whose phases wait on counters in global
memory (kernels/grid_sync.py) instead of ending and launching kernels. Before building it, one
GPU call measures the mechanism on a toy with the decode step's bytes: a chain of GEMVs with
the shapes of `layers` layers of a model (per layer: QKV, the output projection, gate + up,
down), each phase reading the previous phase's output (y_p = W_p x_p, x_(p+1) = y_p[:K_(p+1)]),
in bf16 with fp32 activations. Timed as CUDA graphs (several chains a replay, so weights stream
from HBM as in decoding):

- `launches`: one kernel a phase, the fused step's structure today; `launches+pdl`: the same
  with programmatic dependent launch;
- `persistent`: one launch; the programs `arrive` after their stores of a phase and
  `wait_count` for the whole previous phase; `+prefetch` loads the first weight tile of the
  next phase before waiting (weights never depend on the step);
- `stream`: the persistent kernel with no waits (its answer is wrong): the same bytes with no
  dependency at all, the bound that removing boundaries can reach.

Every variant runs the same kernel (kernels/grid_sync.py `chain_persistent`) on the same grid
(`--blocks` programs a SM, at most what stays resident), its programs looping over a phase's
row tiles, so they differ only in what separates the phases.

Per variant: µs a chain, GB/s, % of a copy measured in the same run, and µs per boundary over
`stream`. Every variant's output is checked against the `launches` one (the barrier's proof on
the GPU) and the spin guard's error flag must stay 0. One table, then one JSON line.

    python -m expresslane.bench.barrier [--model laneformer-2b] [--layers 4] [--dry-run]
    python -m expresslane.bench.barrier --aot     # compile every variant for sm_90, no GPU

`--dry-run`: tiny shapes in the Triton interpreter with one program (the interpreter runs
programs one after another, so a barrier over several would never open).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# BLOCK_N, BLOCK_K, warps: 32 weights a thread (64 spilled the persistent forms at sm_90)
TILES = [(16, 256, 4), (8, 512, 4), (32, 256, 8), (16, 512, 8)]
MAX_SPIN = 1 << 20  # ~0.5-1 s of polling before a program gives up (a hang guard)


class Chain:
    """The phases' weights (one flat bf16 buffer), activations (fp32) and metadata."""

    def __init__(self, shapes: list[tuple[int, int]], dtype: torch.dtype, dev: torch.device):
        self.shapes = shapes
        sizes = [n * k for n, k in shapes]
        self.w_offs = [sum(sizes[:i]) for i in range(len(sizes))]
        g = torch.Generator(device="cpu").manual_seed(0)
        self.w = torch.empty(sum(sizes), dtype=dtype, device=dev)
        for off, (n, k) in zip(self.w_offs, shapes, strict=True):  # scaled: activations ~ 1
            part = torch.randn(n * k, generator=g) / k**0.5
            self.w[off : off + n * k].copy_(part.to(dtype))
        k0 = shapes[0][1]
        for p in range(1, len(shapes)):
            if shapes[p - 1][0] < shapes[p][1]:
                raise ValueError(f"phase {p} reads {shapes[p][1]} of {shapes[p - 1][0]} outputs")
        self._layout(k0)
        self.x0 = torch.randn(k0, generator=g).to(dev)
        self.meta = torch.tensor([[wo, n, k, xo, yo] for wo, (n, k), xo, yo in
                                  zip(self.w_offs, shapes, self.x_offs, self.y_offs,
                                      strict=True)], dtype=torch.int64, device=dev)  # fmt: skip
        self.counters = torch.zeros(len(shapes), dtype=torch.int32, device=dev)
        self.error = torch.zeros(1, dtype=torch.int32, device=dev)

    def _layout(self, k0: int) -> None:
        """act = [x0 (K0), y_0 (N0), y_1 (N1), ...]: phase p reads the front of the one before."""
        self.x_offs, self.y_offs, at = [], [], k0
        for p, (n, _) in enumerate(self.shapes):
            self.x_offs.append(0 if p == 0 else self.y_offs[p - 1])
            self.y_offs.append(at)
            at += n
        self.act = torch.zeros(at, dtype=torch.float32, device=self.w.device)

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    def reset(self) -> None:
        self.act[: self.x0.numel()].copy_(self.x0)

    def output(self) -> torch.Tensor:
        return self.act[self.y_offs[-1] : self.y_offs[-1] + self.shapes[-1][0]].clone()

    def reference(self) -> torch.Tensor:
        """fp32 torch: the chain's answer to a rounding order."""
        x = self.x0.float().cpu()
        for off, (n, k) in zip(self.w_offs, self.shapes, strict=True):
            x = self.w[off : off + n * k].float().cpu().view(n, k) @ x[:k]
        return x


def model_shapes(name: str, layers: int) -> list[tuple[int, int]]:
    """(N, K) of each product of `layers` layers: QKV, output, gate + up, down."""
    from ..presets import load_model_config

    cfg = load_model_config(name)
    D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
    return [(qkv, D), (D, cfg.num_heads * hd), (2 * F, D), (D, F)] * layers


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launcher(kind: str, chain: Chain, tile: tuple[int, int, int], grid: int):
    """A call that runs the chain once with variant `kind` (module docstring) on `grid`
    programs."""
    from ..kernels.grid_sync import chain_persistent

    bn, bk, warps = tile
    args = (chain.w, chain.act)
    consts = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    if kind.startswith("launches"):
        pdl = kind == "launches+pdl"
        extra = {"launch_pdl": True} if pdl else {}

        def run():  # a kernel a phase: the phase's row of metadata, P = 1
            for p in range(len(chain.shapes)):
                chain_persistent[(grid,)](*args, chain.meta[p:], chain.counters, chain.error, 1,
                                          MAX_SPIN, BARRIER=False, PREFETCH=False, USE_PDL=pdl,
                                          **consts, **extra)  # fmt: skip

        return run
    barrier, prefetch = kind != "stream", kind.endswith("+prefetch")

    def run():
        return chain_persistent[(grid,)](*args, chain.meta, chain.counters, chain.error,
                                         len(chain.shapes), MAX_SPIN, BARRIER=barrier,
                                         PREFETCH=prefetch, USE_PDL=False,
                                         **consts)  # fmt: skip

    return run


def variants(sms: int, blocks: tuple[int, ...], pdl: bool) -> list[tuple[str, int]]:
    """(kind, grid) pairs: `stream` first (the bound), then each form at `blocks` programs a SM."""
    kinds = ["stream", "launches", *(["launches+pdl"] if pdl else []), "persistent",
             "persistent+prefetch"]  # fmt: skip
    return [(kind, sms * b) for b in blocks for kind in kinds]


def check(chain: Chain, run, want: torch.Tensor | None) -> dict:
    """Run once from x0: the output's distance to `want` (or None) and the spin guard's flag."""
    chain.reset()
    chain.error.zero_()
    chain.counters.zero_()  # a variant whose guard fired may have left counts behind
    run()
    out = chain.output()
    diff = None if want is None else float((out - want).abs().max())
    return {"output": out, "max_diff": diff, "spin_error": int(chain.error.item())}


def resident_blocks(run, warps: int) -> int:
    """Programs per SM the compiled persistent kernel can keep resident (aot_read.blocks_per_sm),
    from a one-program launch; 1 where triton does not say."""
    from ..kernels.aot_read import blocks_per_sm

    compiled = run()
    try:
        return blocks_per_sm(compiled.n_regs, warps, compiled.metadata.shared, 90)
    except AttributeError:
        return 1


HEADER = (f"{'variant':<22}{'tile':>12}{'grid':>7}{'us/chain':>11}{'GB/s':>8}{'%copy':>7}"
          f"{'us/bound':>10}{'max diff':>10}  ok")  # fmt: skip


def row_line(r: dict) -> str:
    if "error" in r:
        return f"{r['variant']:<22}{r['tile']:>12}{r['grid']:>7}  ERROR {r['error'][:120]}"
    bound = f"{r['us_per_boundary']:10.2f}" if r.get("us_per_boundary") is not None else " " * 10
    diff = f"{r['max_diff']:10.2e}" if r["max_diff"] is not None else " " * 10
    return (f"{r['variant']:<22}{r['tile']:>12}{r['grid']:>7}{r['us']:11.1f}{r['gb_s']:8.0f}"
            f"{r['pct_copy']:7.1f}{bound}{diff}  {'yes' if r['ok'] else 'NO'}")  # fmt: skip


DRY_SHAPES = [(72, 40), (40, 72), (136, 40), (40, 100)]  # irregular: every mask is exercised


def measure(chain: Chain, args, sms: int, pdl: bool, copy_gb_s: float) -> list[dict]:
    """Every variant of every tile, `stream` first (the bound the others are set against),
    each checked against the `launches` output, then timed; rows printed as measured."""
    from .kernels import _time_calls, _time_graph  # as quant_gpu and sweep time theirs

    def timer(run, reps: int, trials: int) -> float:  # seconds of one run: a graph of `reps`
        return (_time_calls if args.dry_run else _time_graph)([run] * reps, trials)

    rows = []
    for tile in [(16, 32, 1)] if args.dry_run else TILES:
        label = f"{tile[0]}x{tile[1]}/{tile[2]}w"
        blocks = args.blocks
        if not args.dry_run:  # never more programs than stay resident: a wait would hang
            most = resident_blocks(launcher("persistent", chain, tile, 1), tile[2])
            blocks = tuple(b for b in args.blocks if b <= most) or (1,)
        want = check(chain, launcher("launches", chain, tile, sms), None)["output"]
        stream_us = {}
        for kind, grid in variants(sms, blocks, pdl):
            r = {"variant": kind, "tile": label, "grid": grid}
            try:
                run = launcher(kind, chain, tile, grid)
                got = check(chain, run, want)
                if got["spin_error"]:  # a wait gave up: never time (and repeat) a stuck grid
                    raise RuntimeError("the spin guard fired: not every program was resident")
                t = timer(run, args.reps, args.trials)
            except Exception as e:  # one variant's failure is its row
                r["error"] = f"{type(e).__name__}: {e}"
                rows.append(r)
                print(row_line(r), flush=True)
                continue
            exact = kind == "stream" or got["max_diff"] <= 1e-3
            r.update(
                us=t * 1e6,
                gb_s=chain.nbytes / t / 1e9,
                max_diff=got["max_diff"],
                spin_error=got["spin_error"],
                ok=exact and got["spin_error"] == 0,
            )
            r["pct_copy"] = 100 * r["gb_s"] / copy_gb_s
            if kind == "stream":
                stream_us[grid] = r["us"]
            if grid in stream_us:  # over the same grid's stream: what each boundary costs
                r["us_per_boundary"] = (r["us"] - stream_us[grid]) / (len(chain.shapes) - 1)
            rows.append(r)
            print(row_line(r), flush=True)
    return rows


def record_aot(model: str, layers: int, sms: int, tiles: int = len(TILES)) -> list[dict]:
    """Compile every variant for sm_90 on the meta device (kernels/aot.py): registers, spills,
    blocks per SM, and the atomics' memory semantics in the PTX. `tiles`: the first so many
    of TILES (each compiles every form again)."""
    import tempfile
    from pathlib import Path

    from ..kernels.aot import compile_launch, distinct
    from ..kernels.aot_launch import recording

    chain = Chain(model_shapes(model, layers), torch.bfloat16, torch.device("meta"))
    with recording(sms=sms, pdl=True) as launches:
        for tile in TILES[:tiles]:
            for kind, grid in variants(sms, (1,), pdl=True):
                launcher(kind, chain, tile, grid)()
    with tempfile.TemporaryDirectory() as tmp:
        return [compile_launch(x, 90, Path(tmp), sms) for x in distinct(launches)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="laneformer-2b", help="preset whose products are chained")
    ap.add_argument("--layers", type=int, default=4, help="layers of products in the chain")
    ap.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4],
                    help="programs per SM of the persistent forms")  # fmt: skip
    ap.add_argument("--reps", type=int, default=4, help="chains per graph replay")
    ap.add_argument("--trials", type=int, default=10, help="replays; the median is kept")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, Triton interpreter")
    ap.add_argument("--aot", action="store_true", help="compile every variant for sm_90 only")
    ap.add_argument("--tiles", type=int, default=len(TILES),
                    help=f"--aot: the first N of the {len(TILES)} tile shapes")  # fmt: skip
    args = ap.parse_args(argv)
    if min(args.layers, args.reps, args.trials, args.tiles, *args.blocks) < 1:
        print("barrier: --layers, --reps, --trials, --tiles and --blocks must be >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        shapes = model_shapes(args.model, args.layers)  # the model is checked in a dry run too
        shapes = DRY_SHAPES if args.dry_run else shapes
    except Exception as e:
        print(f"barrier: --model {args.model}: {e}", file=sys.stderr)
        return 2
    if args.aot:
        results = record_aot(args.model, args.layers, 132, args.tiles)
        for r in results:
            print(f"{r['kernel']:<48} regs {r['registers']:>4} spill {r['spill_bytes']:>4} "
                  f"blocks/SM {r['blocks_per_sm']} atomics {' '.join(r['atomics'])}")  # fmt: skip
        print(json.dumps({"bench": "barrier-aot", "model": args.model, "kernels": results}))
        return 0
    if args.dry_run:  # before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("expresslane.bench.barrier needs a CUDA GPU (or --dry-run, --aot)", file=sys.stderr)
        return 2
    from .bandwidth import copy_bandwidth_gb_s

    dev = torch.device("cpu" if args.dry_run else "cuda")
    chain = Chain(shapes, torch.float32 if args.dry_run else torch.bfloat16, dev)
    sms, pdl = 1, False
    if dev.type == "cuda":
        from ..kernels.gemv import pdl_enabled

        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        pdl = pdl_enabled(chain.w)
    else:
        args.blocks, args.trials, args.reps = [1], 1, 1
    copy_gb_s = copy_bandwidth_gb_s(dev, nbytes=16 << 20 if args.dry_run else 1 << 30)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device {name}, {sms} SMs, PDL {'on' if pdl else 'off'}, copy {copy_gb_s:.0f} GB/s; "
          f"chain: {'tiny shapes' if args.dry_run else f'{args.model} x {args.layers} layers'}, "
          f"{len(shapes)} phases, "
          f"{chain.nbytes / 1e6:.1f} MB")  # fmt: skip
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    rows = measure(chain, args, sms, pdl, copy_gb_s)
    ref = chain.reference()
    tile = (16, 32, 1) if args.dry_run else TILES[0]
    first = check(chain, launcher("launches", chain, tile, sms), None)["output"].cpu()
    ref_diff = float((first - ref).abs().max() / ref.abs().max())
    print(f"launches against fp32 torch: max |diff| / max |y| = {ref_diff:.2e}")
    print(json.dumps({"bench": "barrier", "device": name, "sms": sms, "pdl": pdl,
                      "copy_gb_s": copy_gb_s, "model": args.model, "layers": args.layers,
                      "phases": len(shapes), "bytes": chain.nbytes, "reference_rel_diff": ref_diff,
                      "rows": rows}), flush=True)  # fmt: skip
    ok = all(r.get("ok") for r in rows) and ref_diff < 1e-2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
