"""The fused kernels build for Hopper (sm_90) with the installed triton, on a machine with no GPU.

`python -m expresslane.kernels.aot` records the decode step's launches on the meta device with an
H100's launch plan (132 SMs, PDL) and compiles each distinct kernel with triton + ptxas. It runs
in a subprocess because this test session runs triton in the interpreter, which compiles nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="this triton build has no bundled ptxas / cuobjdump",
)

# Kernels that stream weights: each must put at least one program on every SM.
STREAMING = ("norm_qkv", "gemv_reduce", "norm_swiglu", "lane_gemv", "head_argmax", "head_logits")


def aot(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "expresslane.kernels.aot", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    "model,per_layer",
    [("laneformer-2b", {"norm_qkv", "attention", "gemv_reduce", "norm_swiglu"}),
     ("llama-3.2-1b", {"norm_qkv", "attention", "lane_gemv", "norm_swiglu"})],
)  # fmt: skip
def test_decode_step_kernels_compile_for_sm90(model, per_layer):
    out = aot("--model", model, "--arch", "90", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = report["kernels"]
    families = {r["kernel"].split("_kernel")[0] for r in rows}
    assert per_layer | {"head_argmax", "argmax_combine", "head_logits"} <= families
    for r in rows:
        assert r["registers"] > 0, r
        assert r["pdl"], f"{r['kernel']}: planned with PDL but no griddepcontrol in its PTX"
        # a tile converted to its accumulator's layout goes through shared memory every trip
        assert r["loop_converts"] == 0, f"{r['kernel']}: {r['loop_converts']} converts in loops"
        if r["kernel"].startswith(STREAMING):
            programs = 1
            for g in r["grid"]:
                programs *= g
            assert programs >= 132, f"{r['kernel']}: {programs} programs for 132 SMs"
            # the JIT's alignment specialisation: weights stream in 16-byte loads
            assert r["loads"].get("128", 0) >= 1, f"{r['kernel']}: loads {r['loads']}"
            assert r["spill_bytes"] == 0 and r["blocks_per_sm"] >= 4, r
    assert report["launches_per_step"] > 0


def test_aot_rejects_unknown_model_and_interpreter(monkeypatch, capsys):
    """In this process: each refusal comes before anything is compiled."""
    from expresslane.kernels import aot as aot_cli

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for args, word in [(("--model", "no-such-model"), "no-such-model"),
                       (("--arch", "7"), "--arch 7"), (("--sms", "0"), "--sms 0"),
                       (("--quant", "int3"), "'int3'"), (("--force", "gemm"), "--force gemm"),
                       (("--force", "attention"), "NAME=VALUE pairs"),
                       (("--force", "attention", "NUM_SPLITS"), "'NUM_SPLITS'"),
                       (("--force", "attention", "BLOCK_N=0"), "'BLOCK_N=0'")]:  # fmt: skip
        assert aot_cli.main(list(args)) == 2
        assert word in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert aot_cli.main([]) == 2 and "TRITON_INTERPRET" in capsys.readouterr().err


def test_forced_variant_is_what_builds():
    """--force pins a variant as the sweep does: the attention launch takes the forced splits
    (its grid's last axis) and tile (its label), the other kernels stay as they were (the
    plans, --plan), and the forced launch is the one that compiles."""
    args = ("--model", "llama-tiny", "--json")
    force = ("--force", "attention", "NUM_SPLITS=3", "BLOCK_N=32")
    runs = {}
    for extra in (("--plan",), ("--plan", *force), ("--kernel", "attention", *force)):
        out = aot(*args, *extra)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = json.loads(out.stdout.strip().splitlines()[-1])["kernels"]
        runs[extra] = {r["kernel"].split("[")[0]: r for r in rows}
    plain, forced, built = runs.values()
    assert forced["attention_kernel"]["grid"][-1] == 3 != plain["attention_kernel"]["grid"][-1]
    assert "BLOCK_N=32" in forced["attention_kernel"]["kernel"]
    assert {k: r["grid"] for k, r in plain.items() if k != "attention_kernel"} == {
        k: r["grid"] for k, r in forced.items() if k != "attention_kernel"}  # fmt: skip
    assert len(plain) >= 5 and list(built) == ["attention_kernel"]
    build = built["attention_kernel"]
    assert build["kernel"] == forced["attention_kernel"]["kernel"] and build["registers"] > 0
    assert build["grid"] == forced["attention_kernel"]["grid"]


def test_launch_count_and_prediction():
    """The fused step is five launches a layer (attention combines in its last block) plus the
    head's two; the model's own static step launches many more, and the prediction orders them
    so."""
    from expresslane.presets import get_preset

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "expresslane.bench.launches", "--model", "laneformer-tiny",
           "--context", "64"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    layers = get_preset("laneformer-tiny").num_layers
    fused = [r for r in report["rows"] if r["step"] == "fused step"]
    eager = [r for r in report["rows"] if r["step"] != "fused step"]
    assert all(r["kernels"] == 5 * layers + 2 for r in fused)
    assert all(r["kernels"] > 4 * fused[0]["kernels"] for r in eager)
    for r in report["rows"]:
        assert r["token_us"] > report["stream_us"]
        assert abs(r["token_us"] - report["stream_us"] - r["kernels"] * r["gap_us"]) < 1e-6
    bad = subprocess.run(cmd + ["--efficiency", "1.5"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "--efficiency" in bad.stderr


HEAD_BOTH_WAYS = """
import json
from expresslane.kernels.aot import compile_decode_step
rows = {s: compile_decode_step("laneformer-tiny", only="head_argmax", specialise=s)[0]
        for s in (True, False)}
print(json.dumps({"specialised": rows[True], "plain": rows[False]}))
"""


def test_unspecialised_build_is_not_what_runs():
    """Without the JIT's divisibility attributes ptxas cannot prove alignment: every global load
    of the head is a scalar 2-byte load (and the registers differ). The AOT table must come
    from the specialised build."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", HEAD_BOTH_WAYS], capture_output=True, text=True,
                         env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    spec, plain = rows["specialised"], rows["plain"]
    assert spec["loads"].get("128", 0) >= 1 and spec["aligned_params"] >= 5, spec
    assert set(plain["loads"]) == {"16"} and plain["aligned_params"] == 0, plain


def test_blocks_per_sm_follows_cuda_occupancy_rules():
    from expresslane.kernels.aot_read import blocks_per_sm

    # (registers, warps, shared bytes) -> CTAs per SM on sm_90 (registers in 8-register steps)
    cases = {
        (80, 4, 1024): 6,
        (70, 4, 1024): 7,
        (39, 4, 1024): 12,
        (91, 4, 1024): 5,
        (128, 4, 4096): 4,
        (32, 4, 0): 16,
        (32, 4, 100 << 10): 2,
        (255, 8, 0): 1,
    }
    for (regs, warps, smem), want in cases.items():
        assert blocks_per_sm(regs, warps, smem, 90) == want, (regs, warps, smem)


def test_quantized_products_compile_for_sm90():
    """kernels/qgemv.py at the Llama-1B shapes (layers and head), int8 and int4 and the GGUF
    repacks' int8 in groups of 16, 1 and 8 tokens, with and without the fused norm: the integers
    stream in 16-byte loads, nothing spills, PDL."""
    out = aot("--model", "llama-3.2-1b", "--kernel", "qgemv", "--quant", "int8", "int4",
              "gguf-int8-g16", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])["kernels"]
    assert {r["kernel"].split("INT4=")[1][:4] for r in rows} == {"True", "Fals"}
    assert {int(r["kernel"].split("GROUP=")[1].split(",")[0]) for r in rows} == {16, 32, 128}
    for r in rows:
        assert r["loads"].get("128", 0) >= 1, f"{r['kernel']}: loads {r['loads']}"
        assert r["spill_bytes"] == 0 and r["blocks_per_sm"] >= 4 and r["pdl"], r
        programs = r["grid"][0] * r["grid"][1]
        assert programs >= 132, f"{r['kernel']}: {programs} programs for 132 SMs"


INVARIANCE = """
import difflib
import json
from expresslane.kernels.aot import distinct, invariance_report, record_decode_step
from expresslane.kernels.aot_read import ttgir_of
out = {}
for n in (2, 8):
    report = invariance_report("laneformer-2b", (1, n))
    out[n] = {k: [sorted(set(map(tuple, b))) for b in builds] for k, builds in report.items()}
launches = distinct(record_decode_step("llama-3.2-1b", 4096, 132, True, tokens=3))
small = [la for la in launches if la.name.startswith(("gemv_reduce", "lane_gemv"))][0]
two, full = (
    [line for line in text.splitlines() if not line.startswith("#loc")]  # paths and lines
    for text in (ttgir_of(small, 90), small.compile(90).asm["ttgir"])  # two stages, as compiled
)
diff = list(difflib.unified_diff(full, two, lineterm="", n=1))[:40]
print(json.dumps({"layouts": out, "ttgir_diff": diff}))
"""


def test_compiled_reductions_do_not_depend_on_the_token_count():
    """Batch invariance of the sm_90 builds: every reduction of a 2- and an 8-token build of
    each kernel (rows per program fitted to S) is laid out along its reduced axis as in the
    1-token build (same values per thread, lanes, warps, order), so a row is summed in the same
    order. An sm_90 build once put 4 warps along K for one token's RMS statistics and 1 warp for
    8; a 2-token build put 2 warps and 4 values a thread along K (gemv.block_s pads it to 4)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # triton's cache key has no file path or line of a location, yet its TTGIR carries both: a
    # build cached by another checkout would differ by its locations alone. So the whole compile
    # runs afresh, and the locations' definitions (#loc = loc("path":line:column)) are left out
    env["TRITON_ALWAYS_COMPILE"] = "1"
    out = subprocess.run([sys.executable, "-c", INVARIANCE], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # aot_read.ttgir_of stops where triton.compile's TTGIR is
    assert not result["ttgir_diff"], "\n".join(result["ttgir_diff"])
    for n, report in result["layouts"].items():
        assert {"norm_qkv", "norm_swiglu", "gemv_reduce", "head_logits"} <= {
            k.split("_kernel")[0] for k in report
        }
        for kernel, (one, many) in report.items():
            assert one and one == many, f"{kernel}: 1 token {one}, {n} tokens {many}"


PERSISTENT = """
import json, tempfile
from pathlib import Path
from expresslane.kernels.aot import compile_launch, distinct, persistent_invariance
from expresslane.kernels.aot import record_decode_step
one, eight = persistent_invariance("laneformer-2b")
(greedy,) = distinct(record_decode_step("laneformer-2b", 4096, 132, True, logits=False,
                                        persistent=True))
qwen = {}
with tempfile.TemporaryDirectory() as tmp:
    row = compile_launch(greedy, 90, Path(tmp))  # the S = 1 build above, to its cubin
    for preset in ("qwen3-0.6b", "qwen2.5-0.5b"):  # q/k norms; attention biases
        (launch,) = distinct(record_decode_step(preset, 4096, 132, True, logits=False,
                                                persistent=True))
        qwen[preset] = compile_launch(launch, 90, Path(tmp))
q1, q8 = persistent_invariance("qwen3-0.6b")
print(json.dumps({"one": one, "eight": eight, "row": row, "qwen": qwen, "q1": q1, "q8": q8}))
"""


def test_persistent_kernel_builds_and_sums_alike_for_1_and_8_tokens():
    """The one-launch step (kernels/persistent.py) compiles for sm_90, streams its weights 16
    bytes at a time (its per-layer offsets carry their alignment), keeps more than one program
    an SM, and at its one warp count sums every row alike in the 1- and the 8-token builds: a
    verify's rows are lone steps, which the interpreter cannot show. The same for qwen3's q/k
    norms and qwen2's biases, which reach its QKV task through the per-layer offsets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", PERSISTENT], capture_output=True, text=True,
                         env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["one"] and report["one"] == report["eight"], report
    for name, row in (("laneformer-2b", report["row"]), *report["qwen"].items()):
        assert row["loads"].get("128", 0) >= 16 and row["blocks_per_sm"] >= 2, (name, row)
        assert row["grid"][0] >= 132, (name, row)
        # Qwen2.5's GQA group of 7 spills in the fused attention kernel too (BENCHMARKS.md)
        assert row["spill_bytes"] == 0 or name == "qwen2.5-0.5b", (name, row)
    assert report["q1"] and report["q1"] == report["q8"], (report["q1"], report["q8"])
