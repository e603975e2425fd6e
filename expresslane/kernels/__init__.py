"""Fused decode kernels (and the prefill's residual + norm kernel): when to use them.

The package owns the choice between the Triton kernels (one module per kernel family) and their
plain-PyTorch references in `ref.py`. Importing this package never imports triton: the kernel
modules are imported by the caller only once `use_triton(t)` said yes, so a CPU-only install
without triton works unchanged.

    norm_qkv.py          RMSNorm + Q/K/V projection + RoPE + KV-cache write    -> q (Hq, hd)
    decode_attention.py  flash-decoding GQA attention, combined by its last block -> (Hq, hd)
    gemv_reduce.py       wo / w2 projection + DTP reduce + residual add         -> h, partial
    swiglu.py            RMSNorm + w1/w3 projection + SiLU(gate) * up           -> (L, F/L)
    lm_head.py           final norm + LM head (3 head types) + greedy argmax / fp32 logits
    gemv.py              shared tile heuristics, PDL switch, lane-major GEMV
    tiles.py             the jit pieces: rounding, fused norm, streamed tiles, the input wait
    qk_norm.py           qwen3's q/k norm inside norm_qkv, by each head's last program
    decode_step.py       one decoder layer for S tokens, fused and reference twins
    prefill_norm.py      prefill: DTP reduce + residual add + the next RMSNorm, per token
    tuning.py            launch configurations: defaults, per-GPU tables (tuning/), forcing
    interpreter.py       the Triton interpreter without its repeated patches (CPU runs only)

Every decode kernel takes a token axis: S <= MAX_TOKENS consecutive tokens of one sequence, each
weight read once for all of them, each token's row computed in an order that does not depend on S
(batch-invariant), so the plain step is the S = 1 case of the verify step, bit for bit. The
prefill's kernel takes any number of tokens, one program each (step/prefill.py runs it).
"""

from __future__ import annotations

import importlib.util
import os

import torch

# find_spec instead of `import triton`: importing triton costs ~0.5 s, and the CLI should not pay
# that on a CPU-only machine. A broken triton install shows up at the first kernel import.
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None

# The most tokens of one sequence a kernel takes at once: a decode step and up to 7 drafts.
MAX_TOKENS = 8


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the fused Triton kernels should run on `tensor`'s device.

    That is a CUDA tensor with triton installed, or any tensor when EXPRESSLANE_FORCE_TRITON=1
    (tests on the CPU set it together with TRITON_INTERPRET=1, which must be set before triton
    is first imported).
    """
    if not HAS_TRITON:
        return False
    if os.environ.get("EXPRESSLANE_FORCE_TRITON") == "1":
        return True
    return tensor.is_cuda


__all__ = ["HAS_TRITON", "MAX_TOKENS", "use_triton"]
