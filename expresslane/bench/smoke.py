"""The first minute on a GPU: what is here, what works, and whether the fused step is right.

    python -m expresslane.bench.smoke [--model laneformer-2b] [--dtype bfloat16] [--dry-run]

Before anything is timed, in this order, each section printed (and flushed) as it completes and
each under its own guard, so one failure never hides the others:

1. versions: python, torch (and its CUDA), triton, transformers, numpy, the commit;
2. device: name, capability, SMs, memory, L2;
3. capabilities the GPU path relies on: triton's `launch_pdl` option and `gdc_*` ops,
   `tl.argmax(tie_break_left=)`, `CUDAGraph.register_generator_state`, transformers'
   StaticCache, whether PDL will be used;
4. the device-to-device copy bandwidth (the utilisation denominator) and the datasheet's;
5. correctness at the model's shapes, on the bench's weights (the same seed, made on the
   device): the fused step's logits, teacher-forced, against the model's forward in fp32, from
   position 0 (every key written by the fused step) and after a prefill past the sliding window
   (a wrapped ring, keys written by the forward). The model's own forward in the bench dtype is
   measured against the same reference: the fused step passes within 1e-4 (fp32) or 1e-2 (bf16)
   relative L2 error, or twice the forward's own error (bf16 forwards of the tiny preset are
   1.1% off), and picks the reference's token wherever its top-2 gap exceeds that noise;
6. the fused step captured in a CUDA graph (with PDL where it is on) gives the very tokens of the
   same kernels launched one by one (they are deterministic: any difference is a race); on a
   failure it is tried once more with PDL off, and says so.

One JSON line last; exit 1 when a check failed. `--dry-run`: the same on the CPU with
`laneformer-tiny` in fp32 (the fused step's reference twins, or the Triton interpreter with
EXPRESSLANE_FORCE_TRITON=1).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import platform
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from ..checkpoint import resolve_device, resolve_dtype
from ..presets import load_model_config


def versions() -> dict:
    out = {"python": platform.python_version(), "executable": sys.executable,
           "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    for name in ("triton", "transformers", "numpy"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as e:  # a broken install is a finding, not a crash
            out[name] = f"unavailable ({type(e).__name__}: {e})"
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       capture_output=True, cwd=Path(__file__).parent,
                                       timeout=10).stdout.strip() or "unknown"  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out["commit"] = "unknown"
    return out


def device_info(dev: torch.device) -> dict:
    if dev.type != "cuda":
        return {"device": str(dev), "name": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads()}  # fmt: skip
    p = torch.cuda.get_device_properties(dev)
    cap = list(torch.cuda.get_device_capability(dev))
    return {"device": str(dev), "name": p.name, "capability": cap,
            "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
            "l2_mb": round(getattr(p, "L2_cache_size", 0) / 2**20, 1)}  # fmt: skip


def capabilities(dev: torch.device) -> dict:
    import inspect

    out = {
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "register_generator_state": hasattr(torch.cuda.CUDAGraph, "register_generator_state"),
    }
    try:
        from transformers import StaticCache  # noqa: F401

        out["transformers_static_cache"] = True
    except ImportError:
        out["transformers_static_cache"] = False
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions

        out["launch_pdl_option"] = "launch_pdl" in CUDAOptions.__dataclass_fields__
        out["gdc_ops"] = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(
            tl.extra.cuda, "gdc_launch_dependents"
        )
        names = getattr(tl.argmax, "arg_names", None)  # a JITFunction's parameters
        if names is None:
            names = list(inspect.signature(tl.argmax).parameters)
        out["argmax_tie_break_left"] = "tie_break_left" in names
    except Exception as e:
        out["triton_error"] = f"{type(e).__name__}: {e}"
    from ..kernels import use_triton

    probe = torch.empty(1, device=dev)
    out["fused_kernels"] = use_triton(probe)
    if out["fused_kernels"]:
        from ..kernels.gemv import pdl_enabled

        out["pdl"] = pdl_enabled(probe)
    return out  # fmt: skip


def copy_bandwidth(dev: torch.device, dry: bool) -> dict:
    from .bandwidth import copy_bandwidth_gb_s, datasheet_tb_s

    sheet = datasheet_tb_s(dev)
    gb_s = copy_bandwidth_gb_s(dev, nbytes=(16 << 20) if dry else 1 << 30)
    return {"copy_gb_s": gb_s, "datasheet": sheet,
            "of_datasheet": gb_s / (sheet[1] * 1e3) if sheet else None}  # fmt: skip


def teacher_forced(model, ref, prefill: int, steps: int, tol: float) -> dict:
    """Fused-step logits at positions prefill..prefill+steps-1 (the prompt's own tokens fed one
    by one) against `ref`'s forward over the whole sequence; the model's own forward beside."""
    from ..cache import KVCache
    from ..step.fused import FusedDecoder

    cfg, p = model.cfg, next(model.parameters())
    g = torch.Generator().manual_seed(prefill + steps)
    ids = torch.randint(3, cfg.vocab_size, (1, prefill + steps), generator=g).to(p.device)
    with torch.inference_mode():
        want = ref(ids)[0, prefill:].float()  # (T, V)
        own = model(ids)[0, prefill:].float()
        cache = KVCache(cfg, prefill + steps + 1, p.device, p.dtype)
        for s in range(0, prefill, 512):  # the engine's prefill: the model fills the cache
            model(ids[:, s : min(s + 512, prefill)], cache=cache, last_only=True)
        cache.static = True
        dec = FusedDecoder(model, cache)
        got = torch.stack([dec.forward(ids[:, t : t + 1], torch.tensor([t], device=p.device))[0]
                           for t in range(prefill, prefill + steps)]).float()  # fmt: skip
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    own_rel = ((own - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    # as close as `tol`, or at worst twice as far as the model's own forward in this dtype
    bound = max(tol, 2 * max(own_rel))
    top2 = want.topk(2, dim=-1).values
    noise = torch.maximum(2 * (own - want).abs().amax(-1), tol * want.abs().amax(-1))
    clear = (top2[:, 0] - top2[:, 1]) > noise  # a top-2 gap that rounding cannot flip
    agree = got.argmax(-1) == want.argmax(-1)
    bad = int((clear & ~agree).sum())
    ok = bool(torch.isfinite(got).all()) and max(rel) <= bound and bad == 0
    return {"prefill": prefill, "steps": steps, "kernels": "triton" if dec.kernels else "reference",
            "max_rel_err": max(rel), "forward_max_rel_err": max(own_rel), "bound": bound,
            "argmax_clear": int(clear.sum()), "argmax_wrong": bad, "ok": ok}  # fmt: skip


def graph_check(model, steps: int) -> dict:
    """Greedy tokens of the engine's decode graph (fused step, captured on CUDA) against the same
    fused kernels launched one at a time from the same prefilled cache."""
    from ..cache import KVCache
    from ..engine import Engine
    from ..sampling.params import SamplingParams
    from ..step.fused import FusedDecoder

    cfg, p = model.cfg, next(model.parameters())
    prompt = list(range(3, 3 + 12))
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    eng = Engine(model, max_model_len=64, kernels="on")
    graph_tokens = list(eng.generate(prompt, params))
    cache = KVCache(cfg, 64, p.device, p.dtype)
    with torch.inference_mode():
        tok = model(torch.tensor([prompt], device=p.device), cache=cache)[0, -1].argmax()
        cache.static = True
        dec = FusedDecoder(model, cache)
        pos = torch.tensor([len(prompt)], device=p.device)
        eager = [int(tok)]
        for _ in range(steps - 1):
            tok = dec.next_token(tok.view(1, 1), pos, params, None)
            pos += 1
            eager.append(int(tok))
    captured = any(g.graph is not None for g in eng.captures.graphs.values())
    return {
        "captured": captured,
        "steps": steps,
        "equal": graph_tokens == eager,
        "ok": graph_tokens == eager,
        "graph_tokens": graph_tokens,
        "eager_tokens": eager,
    }


def _section(name: str, fn, results: dict) -> None:
    try:
        results[name] = fn()
    except Exception as e:
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
    print(f"== {name}: {json.dumps(results[name], default=str)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m expresslane.bench.smoke", description=__doc__)
    ap.add_argument("--model", default="laneformer-2b", help="preset or checkpoint folder")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--dry-run", action="store_true", help="laneformer-tiny, fp32, on the CPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.model, args.device, args.dtype = "laneformer-tiny", "cpu", "float32"
    cfg = load_model_config(args.model)
    dev = resolve_device(args.device)
    dt = resolve_dtype(args.dtype, cfg, dev)
    windows = [w for w in (cfg.window(i) for i in range(cfg.num_layers)) if w]
    results: dict = {"smoke": args.model, "dtype": str(dt).removeprefix("torch.")}
    _section("versions", versions, results)
    _section("device", lambda: device_info(dev), results)
    _section("capabilities", lambda: capabilities(dev), results)
    _section("copy", lambda: copy_bandwidth(dev, args.dry_run), results)
    state: dict = {}

    def weights() -> dict:
        from .weights import random_model

        state["model"] = random_model(cfg, dev, dt)  # the bench's weights: same seed, same init
        # the reference in fp32 (a copy on the device when the bench dtype is narrower)
        state["ref"] = (
            state["model"] if dt == torch.float32 else copy.deepcopy(state["model"]).float()
        )
        return {"ok": True, "parameters": sum(p.numel() for p in state["model"].parameters())}

    _section("weights", weights, results)
    tol = 1e-4 if dt == torch.float32 else 1e-2
    short, wrap = (4, 4) if args.dry_run else (24, 16)
    # past the smallest sliding window (its ring wrapped), else a long context
    far = min(windows) * 5 // 4 if windows else (40 if args.dry_run else 1024)
    past_window = min(far, cfg.max_position_embeddings - wrap - 1)
    if "model" in state:
        _section(
            "fused_from_start",
            lambda: teacher_forced(state["model"], state["ref"], 0, short, tol),
            results,
        )
        _section("fused_past_window",
                 lambda: teacher_forced(state["model"], state["ref"], past_window, wrap, tol),
                 results)  # fmt: skip
        state.pop("ref")
        _section("graph", lambda: _graph_with_retry(state["model"], 4 if args.dry_run else 32),
                 results)  # fmt: skip
    checks = [v for v in results.values() if isinstance(v, dict) and "ok" in v]
    results["ok"] = all(c["ok"] for c in checks)
    # read by scripts/gpu_session.sh: later stages of the call then run with EXPRESSLANE_PDL=0
    results["pdl_broken"] = "pdl_retry_after" in results.get("graph", {})
    print(json.dumps(results, default=str), flush=True)
    return 0 if results["ok"] else 1


def _graph_with_retry(model, steps: int) -> dict:
    """graph_check; after a failure with PDL on, once more with EXPRESSLANE_PDL=0."""
    from ..kernels import use_triton

    p = next(model.parameters())
    pdl = False
    if use_triton(p):
        from ..kernels.gemv import pdl_enabled

        pdl = pdl_enabled(p)
    try:
        out = graph_check(model, steps)
        if out["ok"] or not pdl:
            return {**out, "pdl": pdl}
        first = f"tokens differ with PDL on: {out['graph_tokens']} vs {out['eager_tokens']}"
    except Exception as e:
        if not pdl:
            raise
        first = f"{type(e).__name__}: {e}"
    os.environ["EXPRESSLANE_PDL"] = "0"
    out = graph_check(model, steps)
    return {**out, "pdl": False, "ok": False, "pdl_retry_after": first}


if __name__ == "__main__":
    sys.exit(main())
