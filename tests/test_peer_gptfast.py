"""The gpt-fast peer of `bench` (bench/peer_gptfast.py): a checkout's own model and compiled
decode step timed beside ours, and a folder that is not a checkout refused."""

from __future__ import annotations

import textwrap

from expresslane.bench.decode import BenchConfig, run_bench
from expresslane.presets import get_preset


def test_bench_refuses_a_gptfast_folder_that_is_not_a_checkout(tmp_path, capsys):
    from expresslane.__main__ import main

    code = main(["bench", "--preset", "llama-tiny", "--peer-gptfast", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and "--peer-gptfast" in out.err


def test_gptfast_peer_runs_a_checkout(tmp_path):
    """--peer-gptfast imports the checkout's model.py and generate.py (here a minimal stand-in
    with gpt-fast's interface) and times its compiled decode step."""
    (tmp_path / "model.py").write_text(
        textwrap.dedent("""
        from dataclasses import dataclass
        import torch
        from torch import nn

        @dataclass
        class ModelArgs:
            block_size: int = 64
            vocab_size: int = 32
            n_layer: int = 1
            n_head: int = 2
            dim: int = 16
            intermediate_size: int = 32
            n_local_heads: int = -1
            head_dim: int = 8
            rope_base: float = 10000
            norm_eps: float = 1e-5
            rope_scaling: dict | None = None

            def __post_init__(self):
                self.head_dim = self.dim // self.n_head

        class Transformer(nn.Module):
            def __init__(self, args):
                super().__init__()
                self.emb = nn.Embedding(args.vocab_size, args.dim)
                self.out = nn.Linear(args.dim, args.vocab_size)

            def setup_caches(self, max_batch_size, max_seq_length):
                self.seen = torch.zeros(max_seq_length)

            def forward(self, idx, input_pos):
                self.seen[input_pos] = 1.0
                return self.out(self.emb(idx))
    """)
    )
    (tmp_path / "generate.py").write_text(
        textwrap.dedent("""
        from model import Transformer

        def prefill(model, x, input_pos, **kw):
            return model(x, input_pos)[:, -1:].argmax(-1)

        def decode_one_token(model, x, input_pos, **kw):
            logits = model(x, input_pos)
            return logits[:, -1:].argmax(-1), logits
    """)
    )
    cfg = BenchConfig(contexts=(8,), decode_tokens=2, warmup_tokens=1, device="cpu",
                      dtype="float32", kernels="off", compile_backend="eager",
                      peers=(f"gpt-fast={tmp_path}",))  # fmt: skip
    _, row = run_bench(get_preset("llama-tiny"), cfg)
    assert row["engine"] == "gpt-fast" and "error" not in row, row
    assert row["decode_tok_s"] > 0 and row["bytes_per_token"] > 0
