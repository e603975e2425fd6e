"""`expresslane bench` from the command line: its rows, its refusals (exit 2, one line), and the
decode step it measures (what `run` takes)."""

from __future__ import annotations

import json

import tiny

from expresslane.__main__ import main
from expresslane.engine import Engine
from expresslane.step.native import native_step_built


def test_bench_kernels_both_rows_decode_the_same_tokens(capsys):
    """`bench --kernels both`: the fused step (its references on a CPU) beside the model's own
    forward, one row each, the same greedy tokens."""
    argv = ["bench", "--preset", "laneformer-tiny", "--contexts", "16", "--decode-tokens", "8",
            "--kernels", "both", "--no-peer"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    assert [r["engine"] for r in rows] == ["expresslane+kernels", "expresslane (no kernels)"]
    assert rows[0]["token_ids"] == rows[1]["token_ids"] and len(rows[0]["token_ids"]) == 16


def test_bench_formats_without_the_llama_cpp_peer_is_refused(capsys):
    """`--formats` picks the formats compared with llama.cpp: without `--peer llama.cpp` it was
    silently ignored (the checkpoint ran as loaded: fp32 rows for a GGUF asked as `gguf`)."""
    argv = ["bench", "--preset", "laneformer-tiny", "--formats", "gguf", "--no-peer"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--formats: only with --peer llama.cpp" in err and "Traceback" not in err


def test_bench_sampled_rows_need_the_llama_cpp_peer_and_good_values(random_laneformer_dir,
                                                                  capsys):  # fmt: skip
    """`bench --temperature T`: sampled rows beside llama.cpp's own sampler chain only (the
    other peers decode greedily); a bad value names its field, exit 2."""
    base = ["bench", str(random_laneformer_dir), "--device", "cpu", "--contexts", "16",
            "--decode-tokens", "4"]  # fmt: skip
    assert main([*base, "--temperature", "0.8"]) == 2
    assert "--temperature > 0: with --peer llama.cpp only" in capsys.readouterr().err
    assert main([*base, "--peer", "llama.cpp", "--temperature", "0.8", "--top-p", "2"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "Traceback" not in err


def test_bench_engine_draws_a_sampled_row_by_its_seed():
    from expresslane.bench.decode import BenchConfig, bench_engine

    engine = Engine(tiny.laneformer(seed=2), max_model_len=64)
    hot = (("temperature", 1.0), ("top_k", 20), ("seed", 3))
    cfg = BenchConfig(contexts=(16,), decode_tokens=16, warmup_tokens=0, sampling=hot)
    first = bench_engine(engine, cfg, 16)["token_ids"]
    assert bench_engine(engine, cfg, 16)["token_ids"] == first and len(first) == 16
    greedy = bench_engine(engine, BenchConfig(decode_tokens=16, warmup_tokens=0), 16)
    assert greedy["token_ids"] != first


def test_bench_on_a_cpu_measures_the_step_run_takes(capsys):
    """`bench` on a CPU decodes through the packed step where the C kernels are built (what
    `run` uses), beside the transformers peer on the same weights."""
    argv = ["bench", "--preset", "llama-tiny", "--device", "cpu", "--contexts", "16",
            "--decode-tokens", "8", "--peer", "transformers"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    ours = next(r for r in rows if r["engine"] == "expresslane")
    assert ours["step"] == ("packed, C layers" if native_step_built() else "forward")
    assert "decode_tok_s" in next(r for r in rows if r["engine"] == "transformers")
