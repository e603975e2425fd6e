"""The flags every command that loads a model shares (run, serve, bench): the model and its
device, dtype, context and threads; the prefill and KV cache dtypes; prefix reuse; speculation;
LoRA adapters. Each `add_*` adds flags to a parser; each `*_from_args` checks them (exit 2)."""

from __future__ import annotations

import argparse
import math

from ..cache import KV_CACHE_DTYPES
from ..errors import ConfigError
from ..parallel import launch, rendezvous
from ..speculative.drafting import SpeculativeConfig
from ..step.choose import PREFILL_DTYPES


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Flags every command that loads a model shares (run, serve, bench)."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="checkpoint folder, .gguf file, or org/name (HF cache, else downloaded); "
        "default: the embedded model",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (a GPU if there is one, but the CPU for a model of at most 16 M weights), "
        "cpu, cuda, cuda:N",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    add_prefill_dtype_argument(p)
    add_kv_cache_dtype_argument(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context size of the KV cache (default: the config's; a one-shot `run`: its "
        "prompt, --max-tokens and a forward ahead, in 256-slot blocks)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the static decode step (seconds to compile; pays on small models)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads (default: the cores other processes leave free, at most one per 32 "
        "MB a step streams, revised per request by serve: expresslane/step/threads.py)",
    )
    p.add_argument(
        "--quantization",
        choices=["int8", "int8-row", "int4", "int8-g128", "int4-g32", "gguf"],
        default=None,
        help="CPU: weight-only int8, one f16 scale per 32 weights (GGUF Q8_0's layout), or one "
        "fp32 scale per row (int8-row); computed in fp32. 16-bit weights: --dtype. GPU: int8 "
        "(groups of 32) or int4 (groups of 128, with mins), int8-g128 / int4-g32 for the other "
        "group size: the layer projections quantized at load, products in Triton. gguf: a GGUF "
        "file's own blocks (the CPU's default; on a GPU, every type but Q5_1, Q5_K and Q2_K on "
        "the quantized products, those bf16; default there: dequantized, the fused bf16 step)",
    )
    p.add_argument(
        "--devices",
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split lanes (Llama: heads) over N processes: gloo on CPU, NCCL on GPU "
        "(--tensor-parallel-size, -tp: vLLM's names)",
    )
    rendezvous.add_arguments(p)  # --nnodes, --node-rank, --rdzv-endpoint: N over several hosts
    add_speculative_argument(p)


def add_prefill_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill-dtype",
        default="float32",
        choices=PREFILL_DTYPES,
        help="a CPU's prompts: float32 (default) is exact; bfloat16 multiplies long prompts' "
        "quantized, bf16 or fp16 weights in bf16 (~1.5x faster, logits within bf16's rounding) and "
        "short ones' bf16 weights with x in bf16; int8 also takes the GGUF block formats' "
        "activations in 8 bits per block, as llama.cpp does (up to ~1.3x faster on short "
        "prompts). Decoding stays exact",
    )


def add_kv_cache_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="the KV cache's dtype: auto is the model's (fp32 on a CPU); a CPU also takes float16 "
        "(llama.cpp's default) or bfloat16: half the memory and half the bytes attention reads a "
        "token, each key and value rounded once",
    )


def add_prefix_argument(p: argparse.ArgumentParser) -> None:
    """run and serve: prefix reuse is on unless turned off."""
    p.add_argument(
        "--no-prefix-reuse",
        "--no-enable-prefix-caching",
        action="store_true",
        help="prefill every prompt whole instead of reusing the prefix the KV cache holds "
        "(--no-enable-prefix-caching: vLLM's name)",
    )
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="vLLM's flag, accepted for its command lines: prefix reuse is on "
                   "unless --no-prefix-reuse")  # fmt: skip


def add_speculative_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding, as vLLM spells it: by prompt lookup "
        '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
        "\"prompt_lookup_min\": 2}', or a draft model's greedy tokens "
        '\'{"model": "DRAFT", "num_speculative_tokens": 4}\' (same vocabulary)',
    )


def speculative_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """--speculative-config parsed (exit 2 naming the field); None when not given."""
    if getattr(args, "speculative_config", None) is None:
        return None
    cfg = SpeculativeConfig.from_json(args.speculative_config)
    if launch.parallel_requested(args):
        raise ConfigError("--speculative-config: the parallel engine (--devices N) does not "
                          "speculate; use one device")  # fmt: skip
    return cfg


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """run and serve: LoRA adapters merged into the weights at load (weights/lora.py)."""
    p.add_argument("--lora", action="append", default=[], metavar="PATH",
                   help="a LoRA adapter (a PEFT folder or a GGUF adapter file), merged into the "
                   "weights at load; repeatable: they add up (llama.cpp's flag)")  # fmt: skip
    p.add_argument("--lora-scaled", nargs=2, action="append", default=[],
                   metavar=("PATH", "SCALE"),
                   help="a LoRA adapter with its delta multiplied by SCALE")  # fmt: skip


def lora_from_args(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """(adapter, scale) pairs from --lora, --lora-scaled and serve's --lora-modules."""
    pairs = [(p, 1.0) for p in getattr(args, "lora", None) or []]
    for path, scale in getattr(args, "lora_scaled", None) or []:
        try:
            value = float(scale)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ConfigError(f"--lora-scaled {path} {scale}: the scale must be a finite number")
        pairs.append((path, value))
    pairs += [(path, 1.0) for _, path in getattr(args, "lora_modules", None) or []]
    args.lora_pairs = tuple(pairs)  # what the ranks of --devices N read (parallel/launch.py)
    return args.lora_pairs
