"""The GPU session's plumbing, proven on the CPU: every stage of scripts/gpu_session.sh in its
--dry-run (tiny presets, same files), a bench that keeps its rows when a variant or peer fails or
the run is killed, PDL's retry, and the profile's byte counts against the ceiling calculator."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from expresslane.bench import decode, session
from expresslane.bench.decode import BenchConfig, run_bench
from expresslane.presets import get_preset

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def session_run(out: Path, *stages: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "EXPRESSLANE_PDL")}
    env.update(OUT=str(out), PY=sys.executable, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(SCRIPT), *stages], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip


def test_dry_run_of_every_stage(tmp_path):
    """Four calls (at most 4 stages a call: 8 files come back), two at a time: each stage
    leaves its whole log and a JSON result, the bench's rows stream before its table, and the
    summary line of each stage comes last."""
    calls = [
        ("smoke", "bench-2b", "bench-1b", "ttft"),
        ("tests", "kernels", "profile", "sweep"),
        ("structured", "spec-replay", "barrier", "persistent"),
        ("bench-qwen", "free-grammar", "persistent-1b", "quant-1b"),
    ]
    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(lambda s: session_run(tmp_path / s[0], "--dry-run", *s), calls))
    for stages, proc in zip(calls, procs, strict=True):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        out = tmp_path / stages[0]
        assert sorted(p.name for p in out.iterdir()) == sorted(
            f"{s}.{ext}" for s in stages for ext in ("log", "json")
        )
        summary = proc.stdout.splitlines()[-len(stages) :]
        assert [line.split()[:2] for line in summary] == [[s, "ok"] for s in stages]
        for s in stages:
            res = json.loads((out / f"{s}.json").read_text())
            assert res["ok"] and res["rc"] == 0 and not res["timed_out"], res
    results = {s: json.loads((tmp_path / c[0] / f"{s}.json").read_text())
               for c in calls for s in c}  # fmt: skip
    smoke = results["smoke"]["result"]
    assert smoke["ok"] and smoke["fused_past_window"]["prefill"] > 32  # past the tiny window
    assert smoke["graph"]["equal"] and not smoke["pdl_broken"]
    rows = results["bench-2b"]["rows"]
    first = [r["engine"] for r in rows if r["context"] == 16]
    assert first == ["expresslane+kernels", "expresslane (no kernels)", "transformers",
                     "transformers+static+compile"]  # fmt: skip
    assert all("error" not in r for r in rows) and len(rows) == 8
    assert rows[0]["step"] == "fused (reference twins)" and not rows[0]["cuda_graph"]
    assert rows[0]["token_ids"] == rows[1]["token_ids"]  # fused twins and forward agree
    assert results["bench-2b"]["result"]["rows"][0]["speedup_vs_peer"] > 0
    log = (tmp_path / "smoke" / "bench-2b.log").read_text()
    assert log.index('{"row"') < log.index("-" * 40)  # a row printed before the final table
    assert results["bench-1b"]["result"]["rows"][2]["model"] == "same weights"
    ttft = results["ttft"]["result"]
    assert {r["engine"] for r in ttft["summary"]} >= {"expresslane+kernels", "transformers"}
    assert all(r["requests"] == 3 and r["first_ms"] > 0 for r in ttft["summary"])
    assert ttft["profile"]["first"] and ttft["profile"]["second"]
    assert [r["new"] for r in ttft["reuse"]] == [20, 20]  # 100 and 400, cut to the tiny model
    assert all(r["ttft_ms"] > 0 for r in ttft["reuse"])
    grammar = {r["mode"]: r for r in results["structured"]["result"]["rows"]}
    assert grammar["greedy"]["valid"] == grammar["greedy"]["runs"] == 3  # every answer parsed
    assert grammar["greedy chain"]["valid"] == grammar["greedy chain"]["runs"] == 3
    assert grammar["sampled chain"]["host_ms_per_token"]["launch"] > 0  # the pick graph ran
    free = results["free-grammar"]["result"]  # each convention's free grammar, timed
    assert [r["grammar"] for r in free["rows"]] == ["none", "hermes", "mistral", "llama3"]
    assert all(r["tokens_per_s"] > 0 for r in free["rows"])
    barrier = results["barrier"]["result"]  # one program in the interpreter: every form exact
    assert {r["variant"] for r in barrier["rows"]} == {"stream", "launches", "persistent",
                                                       "persistent+prefetch"}  # fmt: skip
    assert all(r["ok"] and r["spin_error"] == 0 for r in barrier["rows"])
    for stage, tiny in (("persistent", "laneformer-tiny"), ("persistent-1b", "llama-tiny")):
        persistent = results[stage]["result"]  # the one-launch step gives the fused bits
        assert persistent["preset"].startswith(tiny)  # a one-lane preset dry-runs a one-lane model
        steps = [r for r in persistent["rows"] if r["step"] != "fused"]
        assert steps and all(r["bitwise"] and r["same_pick"] and not r["failed_waits"]
                             for r in steps)  # fmt: skip
        assert steps[0]["rows_are_lone_steps"]
    decode = [r for r in results["quant-1b"]["result"]["rows"] if r["part"] == "decode"]
    assert [r["format"] for r in decode] == ["bf16", "int8"] and all(r["tok_s"] > 0 for r in decode)
    spec = results["spec-replay"]["result"]
    assert spec["bench"] == "spec_replay" and set(spec["by_kind"]) == {"edit", "quote", "free"}
    tests = results["tests"]["tests"]
    # every GPU test was collected and skipped here: none ran, none failed
    assert set(tests["counts"]) == {"skipped"} and tests["counts"]["skipped"] >= 4
    assert not tests["failed"]
    kernels = results["kernels"]["result"]["kernels"]
    assert "decode layer" in kernels and all("error" not in k for k in kernels.values())
    assert results["profile"]["result"]["total"]["us_per_step"] > 0
    sweep = results["sweep"]["result"]  # every variant of every kernel, checked in the interpreter
    assert sweep["defaults_failed"] == 0 and sweep["inexact"] == 0
    from expresslane.bench.sweep import VARIANTS

    ran = {(r["kernel"], json.dumps(r["variant"], sort_keys=True)) for r in sweep["rows"]}
    assert ran == {(k, json.dumps(v, sort_keys=True)) for k, vs in VARIANTS.items() for v in vs}
    for r in sweep["rows"]:  # a variant either passed both checks or the shape refused it
        assert r.get("exact") is True or "must divide" in r.get("error", ""), r
    table = sweep["table"]
    for kernel, entries in table["kernels"].items():  # winners: checked variants, by real keys
        for key, v in entries.items():
            assert any(r["kernel"] == kernel and r.get("key") == key and r["variant"] == v
                       and r["exact"] for r in sweep["rows"]), (kernel, key, v)  # fmt: skip
    from expresslane.bench import sweep as sweep_mod
    from expresslane.kernels import tuning

    tables = tmp_path / "tables"
    tables.mkdir()
    old, tuning.TABLES = tuning.TABLES, tables
    try:
        assert sweep_mod.install(str(tmp_path / "tests" / "sweep.json")) == 0
    finally:
        tuning.TABLES = old
    written = json.loads((tables / "cpu-triton-interpreter.json").read_text())
    assert written["kernels"] == table["kernels"] and written["gpu"] == table["gpu"]


def test_the_tests_stage_runs_every_module_with_a_gpu_test():
    """A GPU test outside the stage's list would never run on a GPU; the interpreter-bound ones
    (the persistent step, quantized products, kernels, the kernels' token axis, the qwen
    layers) are last: the dry run leaves them out."""
    script = SCRIPT.read_text()
    listed = re.search(r"^GPU_TESTS=\(([^)]*)\)", script, re.M).group(1).split()
    marked = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                    if re.search(r"pytest\.mark\.gpu\b", p.read_text()))  # fmt: skip
    assert sorted(listed) == marked
    assert listed[-5:] == ["tests/test_persistent.py", "tests/test_qgemv.py",
                           "tests/test_kernels.py", "tests/test_kernels_tokens.py",
                           "tests/test_kernels_qwen.py"]  # fmt: skip


def test_stage_arguments_are_checked(tmp_path):
    for args, word in [((), "usage"), (("smoke",) * 5, "usage"), (("warp-speed",), "unknown")]:
        proc = session_run(tmp_path, *args)
        assert proc.returncode == 2 and word in proc.stderr


def test_killed_stage_keeps_its_rows_and_tail(tmp_path):
    log = tmp_path / "bench.log"
    rows = [{"engine": "expresslane+kernels", "context": 1024, "decode_tok_s": 600.0},
            {"engine": "transformers", "context": 1024, "decode_tok_s": 150.0}]  # fmt: skip
    log.write_text("header\n" + "".join(f"line\n{json.dumps({'row': r})}\n" for r in rows)
                   + "Terminated\n")  # fmt: skip
    res = session.result("bench-2b", log, 124, 330.0, 330.0)
    assert res["timed_out"] and not res["complete"] and res["rows"] == rows
    assert res["tail"][-1] == "Terminated"
    line = session.headline(res)
    assert "expresslane+kernels 600.0 tok/s" in line and "4.00x transformers" in line
    pytest_log = tmp_path / "tests.log"
    pytest_log.write_text("tests/test_a.py::test_x PASSED [ 50%]\n"
                          "tests/test_a.py::test_y FAILED [100%]\n")  # fmt: skip
    t = session.result("tests", pytest_log, 137, 420.0, 420.0)["tests"]
    assert t["counts"] == {"passed": 1, "failed": 1} and t["failed"] == ["tests/test_a.py::test_y"]


@pytest.fixture
def bench_cfg():
    return BenchConfig(
        contexts=(8, 12),
        decode_tokens=2,
        warmup_tokens=1,
        device="cpu",
        dtype="float32",
        kernels="both",
        peers=("transformers", "no-such-peer"),
    )


def test_failing_variant_and_peer_leave_error_rows(bench_cfg, monkeypatch):
    """A variant that raises and a peer that cannot be built each leave a row with the error,
    at every context; every other row is still measured, in context-major order."""
    real = decode.EngineRunner._measure

    def measure(self, context):
        if self.kernels == "on":
            raise RuntimeError("capture failed")
        return real(self, context)

    monkeypatch.setattr(decode.EngineRunner, "_measure", measure)
    emitted = []
    rows = run_bench(get_preset("laneformer-tiny"), bench_cfg, emit=emitted.append)
    assert rows == emitted and [r["context"] for r in rows] == [8] * 4 + [12] * 4
    errors = {(r["engine"], r["context"]): r.get("error", "") for r in rows}
    assert "capture failed" in errors[("expresslane+kernels", 12)]
    assert "no-such-peer" in errors[("no-such-peer", 8)]
    assert errors[("no-such-peer", 12)].startswith("RuntimeError: not built")
    assert errors[("expresslane (no kernels)", 8)] == errors[("transformers", 12)] == ""


def test_fused_failure_is_retried_once_without_pdl(bench_cfg, monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_PDL", "1")
    monkeypatch.setattr(
        decode.EngineRunner,
        "_pdl_now",
        lambda self: self.kernels == "on" and os.environ["EXPRESSLANE_PDL"] == "1",
    )
    real, calls = decode.EngineRunner._measure, []

    def measure(self, context):
        calls.append((self.kernels, os.environ["EXPRESSLANE_PDL"]))
        if os.environ["EXPRESSLANE_PDL"] == "1" and self.kernels == "on":
            raise RuntimeError("griddepcontrol: unsupported")
        return real(self, context)

    monkeypatch.setattr(decode.EngineRunner, "_measure", measure)
    cfg = dataclasses.replace(bench_cfg, contexts=(8,), peers=())
    fused, plain = run_bench(get_preset("laneformer-tiny"), cfg)
    assert "error" not in fused and fused["pdl"] is False
    assert fused["pdl_retry_after"] == "RuntimeError: griddepcontrol: unsupported"
    assert calls == [("on", "1"), ("on", "0"), ("off", "0")] and "pdl_retry_after" not in plain


PROFILE_BYTES = """
import json, torch
from expresslane.bench.ceiling import bytes_per_token
from expresslane.bench.profile import bytes_by_kernel
from expresslane.presets import get_preset
out = {}
for ctx in (100, 1000):
    b = bytes_by_kernel("laneformer-2b", ctx, 132, True)
    want = bytes_per_token(get_preset("laneformer-2b"), ctx + 1, dtype_bytes=2)["total"]
    out[ctx] = [sum(b.values()), want, b["attention_kernel"]]
print(json.dumps(out))
"""


def test_profile_bytes_match_the_ceiling():
    """The profile's per-kernel bytes (each recorded launch's tensors, KV as far as the context
    reaches) add up to the ceiling calculator's bytes per token, plus activations (< 1%). In a
    subprocess: this session runs triton in the interpreter, whose launches are not recorded."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PROFILE_BYTES], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    for ctx, (got, want, _) in out.items():
        assert want <= got <= 1.01 * want, (ctx, got, want)
    assert out["100"][2] < out["1000"][2]  # attention reads the keys within reach


def test_quant_stage_headline_and_gptfast_quantizer(tmp_path):
    """bench/quant_gpu.py's summary line, and gpt-fast's quantize.py applied through the peer
    (a stand-in with its handler interface: int8 swaps the Linear for a quantized one)."""
    rows = [{"part": "products", "tokens": 1, "format": "int4"},
            {"part": "decode", "format": "bf16", "tok_s": 500.0, "x_bf16": 1.0, "pct_copy": 61.0},
            {"part": "decode", "format": "int4", "tok_s": 1400.0, "x_bf16": 2.8, "pct_copy": 70.0},
            {"part": "gpt-fast", "format": "int4", "error": "RuntimeError"}]  # fmt: skip
    res = {"stage": "quant-2b", "rows": [], "result": {"bench": "quant_gpu", "rows": rows,
           "layer": {"bf16@1": {"x_bf16": 1.0}, "int4@1": {"x_bf16": 3.1}}}}  # fmt: skip
    line = session.headline(res)
    assert line.startswith("bf16 500 tok/s (1.00x, 61% of copy); int4 1400 tok/s (2.80x, 70%")
    assert "gpt-fast int4 ERROR" in line and line.endswith("products per layer: int4@1 3.10x")

    from expresslane.bench.peer_gptfast import _quantize

    (tmp_path / "quantize.py").write_text(
        textwrap.dedent("""
        import torch
        from torch import nn

        class Int8Linear(nn.Module):
            def __init__(self, lin):
                super().__init__()
                self.register_buffer("weight", lin.weight.detach().to(torch.int8))

        class WeightOnlyInt8QuantHandler:
            def __init__(self, mod):
                self.mod = mod

            def create_quantized_state_dict(self):
                return {"out.weight": self.mod.out.weight.detach().round().to(torch.int8)}

            def convert_for_runtime(self):
                self.mod.out = Int8Linear(self.mod.out)
                return self.mod
    """)
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import quantize as gf_quantize
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("quantize", None)
    model = torch.nn.Module()
    model.out = torch.nn.Linear(4, 3)
    model = _quantize(gf_quantize, model, "int8")
    assert model.out.weight.dtype == torch.int8


def test_sweep_winners_need_a_real_gain_within_the_slack():
    """A variant wins only if it is exact, within SLACK of the default at the widest S, and at
    least MIN_GAIN faster at S = 1; gains under that (noise on the H200) keep the default."""
    from expresslane.bench.sweep import winners

    def row(variant, s1, s4, key="A", exact=True):
        return {"kernel": "k", "key": key, "variant": variant, "exact": exact,
                "us_s1": s1, "us_s4": s4}  # fmt: skip

    rows = [row({}, 100.0, 200.0), row({"x": 1}, 99.0, 200.0), row({"y": 1}, 90.0, 205.0),
            row({"z": 1}, 80.0, 300.0), row({"w": 1}, 70.0, 200.0, exact=False),
            row({}, 100.0, 200.0, key="B"), row({"x": 1}, 99.0, 190.0, key="B")]  # fmt: skip
    assert winners(rows, [1, 4]) == {"k": {"A": {"y": 1}}}


def test_ttft_summary_splits_the_first_request_from_the_steady_state():
    from expresslane.bench.ttft import summarise

    rows = [
        {"engine": e, "context": 64, "ttft_ms": ms}
        for e, ms in [
            ("ours", 50.0),
            ("transformers", 12.0),
            ("ours", 10.0),
            ("transformers", 11.0),
            ("ours", 12.0),
            ("transformers", 13.0),
        ]
    ]
    rows.append({"engine": "broken", "context": 64, "error": "RuntimeError: x"})  # fmt: skip
    got = {r["engine"]: r for r in summarise(rows)}
    assert got["ours"]["first_ms"] == 50.0 and got["ours"]["steady_ms"] == 11.0
    assert got["ours"]["first_over_steady"] == 50.0 / 11.0
    assert got["ours"]["steady_over_transformers"] == 11.0 / 12.0
    assert got["broken"]["error"] == "RuntimeError: x"
