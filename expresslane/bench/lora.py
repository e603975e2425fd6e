"""A random LoRA adapter in llama.cpp's GGUF form, for a model's shapes: what the LoRA benches and
tests load (no adapter can be downloaded here).

`python -m expresslane.bench.lora OUT.gguf MODEL [--rank 16] [--alpha 32] [--targets q,k,v,o,
gate,up,down] [--seed 0]` writes `blk.N.<tensor>.weight.lora_a` (r, in) and `.lora_b` (out, r) for
every layer, A and B drawn from N(0, 0.02^2), with `general.type = adapter`, `adapter.type = lora`
and `adapter.lora.alpha`, as llama.cpp's convert_lora_to_gguf.py writes them: for a llama file the
rows of q and k's B permuted as the base file's rows are (the inverse of gguf/tensors.py's
un-permutation). The delta is random, not trained: it measures speed and checks the arithmetic.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..config import ModelConfig

TENSORS = {  # --targets' names -> GGUF tensor names
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
}  # fmt: skip


def permute_rows(b: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K row order (the inverse of gguf/tensors.unpermute_rows)."""
    rows = b.shape[0]
    return b.reshape(heads, 2, rows // heads // 2, *b.shape[1:]).transpose(1, 2).reshape(b.shape)


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """GGUF tensor name -> (out, in) of each projection."""
    q, kv, d, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size  # fmt: skip
    return {"attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, q),
            "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}  # fmt: skip


def write_adapter(path, cfg: ModelConfig, rank: int = 16, alpha: float = 32.0,
                  targets=("q", "k", "v", "o", "gate", "up", "down"), seed: int = 0,
                  arch: str = "llama") -> Path:  # fmt: skip
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    g = torch.Generator().manual_seed(seed)
    dims = shapes(cfg)
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    for i in range(cfg.num_layers):
        for target in targets:
            name = TENSORS[target]
            out, inp = dims[name]
            a = torch.randn(rank, inp, generator=g) * 0.02
            b = torch.randn(out, rank, generator=g) * 0.02
            if arch == "llama" and name in heads:
                b = permute_rows(b, heads[name])
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a.numpy())
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    from ..checkpoint import load_config, resolve_model_dir
    from ..errors import ExpressLaneError
    from ..gguf import find_gguf
    from ..gguf.reader import read_header

    p = argparse.ArgumentParser(prog="python -m expresslane.bench.lora", description=__doc__)
    p.add_argument("out", help="the adapter file to write")
    p.add_argument("model", help="the base model (a GGUF file or a checkpoint folder)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="q,k,v,o,gate,up,down")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        cfg = load_config(resolve_model_dir(args.model))
        targets = [t for t in args.targets.split(",") if t]
        bad = [t for t in targets if t not in TENSORS]
        if bad or args.rank < 1:
            why = f"--targets: {bad[0]!r} is not one of {', '.join(TENSORS)}" if bad else \
                "--rank: must be at least 1"  # fmt: skip
            print(f"python -m expresslane.bench.lora: error: {why}", file=sys.stderr)
            return 2
        gguf_file = find_gguf(args.model)
        arch = read_header(gguf_file).architecture if gguf_file else "llama"
        out = write_adapter(args.out, cfg, args.rank, args.alpha, targets, args.seed, arch)
    except ExpressLaneError as e:
        print(f"python -m expresslane.bench.lora: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
