"""Which step decodes: one function from the model, its cache and the options.

The policy that used to live in the engine's constructor and in the C binding: `decode` "graph"
runs a step on static buffers (graph.py: captured on CUDA, eager elsewhere), "eager" the plain
loop over the model's forward, "auto" graph on CUDA and eager on a CPU, unless compilation, the
fused kernels or quantized packed weights need the static step. `kernels` "auto" puts the fused
Triton step where triton runs (CUDA), "on" forces it (their references elsewhere), "off" keeps
the model's forward, "persistent" runs the fused kernels' bodies as one launch a step
(persistent.py; Triton only: on CUDA, or the interpreter). On a CPU the static step is the
packed one (packed.py). The CLI's default (`default_decode`) asks for the packed step on a CPU
where the C layers are built, as it needs no compilation. `choose_prefill` picks the prefill's
forward by the same `kernels` flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..errors import RequestError
from ..kernels import use_triton
from ..model import Laneformer
from .fused import FusedDecoder, supports
from .heap import keep_freed_memory
from .native import native_step_built
from .packed import PackedDecoder
from .persistent import PersistentDecoder, unsupported
from .prefill import LOWP_BY_DTYPE, FusedPrefill, StepPrefill
from .prefill import supports as prefill_supports
from .protocol import EagerStep, Step


@dataclass(frozen=True)
class Choice:
    """The step, the decode mode ("graph" or "eager") and whether the graph compiles it."""

    step: Step
    decode: str
    compile_graph: bool
    name: str  # for reports: "forward", "fused kernels", "packed", "packed, C layers"


def default_decode(device: torch.device) -> str:
    """The decode mode of `run`, `serve` and `bench`: the packed step ("graph") on a CPU where
    the C step is built, as it needs no compilation; else the engine's own choice ("auto")."""
    return "graph" if device.type == "cpu" and native_step_built() else "auto"


def _decode_mode(model: Laneformer, device: torch.device, decode: str, kernels: str,
                 compile: bool) -> str:  # fmt: skip
    if decode not in ("auto", "graph", "eager"):
        raise RequestError(f"decode={decode!r}: expected auto, graph or eager", "decode")
    if kernels not in ("auto", "on", "off", "persistent"):
        raise RequestError(f"kernels={kernels!r}: expected auto, on, off or persistent",
                           "kernels")  # fmt: skip
    packed = getattr(model, "packed", None)  # quantized weights: the packed step reads them
    quantized = packed is not None and packed.formats != {"float32"}
    if decode == "auto" and (compile or kernels in ("on", "persistent") or quantized):
        return "graph"  # compilation, the fused and the packed steps need the static step
    if decode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    return decode


def choose_step(model: Laneformer, cache: KVCache, decode: str = "auto", kernels: str = "auto",
                compile: bool = False) -> Choice:  # fmt: skip
    """The step for this model and cache under the options (module docstring)."""
    p = next(model.parameters())
    mode = _decode_mode(model, p.device, decode, kernels, compile)
    if kernels == "on" and (mode != "graph" or not supports(model)):
        why = "decode='eager'" if mode != "graph" else "quantized projections"
        raise RequestError(f"kernels='on': the fused decode step cannot run with {why}",
                           "kernels")  # fmt: skip
    if kernels == "persistent":
        return _persistent(model, cache, mode, compile)
    fused = kernels == "on" or (kernels == "auto" and use_triton(p) and supports(model))
    if mode == "graph" and fused:
        return Choice(FusedDecoder(model, cache), mode, compile, "fused kernels")
    gpu_quantized = getattr(model, "gpu_quantization", None) is not None  # kernels/qlinear.py
    if mode == "graph" and kernels == "auto" and not gpu_quantized:
        # off CUDA: the step on packed weights (one Q/K/V and one gate/up product per layer),
        # which compiles its own layer and head (one graph each, not the whole step)
        step = PackedDecoder(model, cache, compile=compile)
        return Choice(step, mode, False, "packed, C layers" if step.step else "packed")
    return Choice(EagerStep(model, cache), mode, compile, "forward")


def _persistent(model: Laneformer, cache: KVCache, mode: str, compile: bool) -> Choice:
    """The one-launch step (persistent.py), asked for by name: never a silent fallback."""
    p = next(model.parameters())
    why = ("decode='eager'" if mode != "graph" else "no triton on this device (a CUDA GPU)"
           if not use_triton(p) else unsupported(model, cache))  # fmt: skip
    if why:
        raise RequestError(f"kernels='persistent': the persistent decode step cannot run with "
                           f"{why}", "kernels")  # fmt: skip
    try:
        step = PersistentDecoder(model, cache)  # its first plan: a split-K projection fails here
    except ValueError as e:
        raise RequestError(f"kernels='persistent': {e}", "kernels") from e
    return Choice(step, mode, compile, "persistent kernel")


# float32: exact (the step's 16-bit x, fp32 layers); bfloat16: long prompts' layers in bf16,
# and bf16 weights' step products with x in bf16; int8: that, and the step's block-format
# products with x in 8 bits per block (llama.cpp's own activation precision) for the shorter
# prompts (step/prefill.py LOWP_BY_DTYPE). Decode steps are exact whatever this is.
PREFILL_DTYPES = ("float32", "bfloat16", "int8")


def check_prefill_dtype(name: str) -> str:
    if name not in PREFILL_DTYPES:
        raise RequestError(f"prefill_dtype={name!r}: expected one of {', '.join(PREFILL_DTYPES)}",
                           "prefill_dtype")  # fmt: skip
    return name


def choose_prefill(
    model: Laneformer, kernels: str = "auto", step: Step | None = None, dtype: str = "float32"
):
    """The forward that prefills, called like the model: FusedPrefill (prefill.py) where the
    fused Triton kernels run (`kernels` "auto" or "on", triton on the model's device) on a model
    it supports; StepPrefill where the step is the packed CPU step with its C layers (short
    chunks through it, long ones through the layers with `dtype` products where it applies:
    one of PREFILL_DTYPES, which the engine checked);
    else the model itself (the eager forward, bit for bit). On a CPU the C library's heap keeps
    freed buffers for the forward's next op (heap.py)."""
    p = next(model.parameters())
    if kernels != "off" and use_triton(p) and prefill_supports(model):
        return FusedPrefill(model)
    if p.device.type == "cpu":
        keep_freed_memory()
    if isinstance(step, PackedDecoder) and step.step is not None:  # the one-call C layers
        products = torch.float32 if dtype == "float32" else torch.bfloat16
        return StepPrefill(model, step, products=products, lowp=LOWP_BY_DTYPE[dtype])
    return model
