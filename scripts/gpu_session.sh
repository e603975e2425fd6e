#!/usr/bin/env bash
# One GPU session's worth of checks, for the device machine (no network, torch/triton/transformers
# preinstalled): GPU tests, the kernel micro-benchmark and the decode benchmark, logs under $OUT.
#   usage there: PYTHONPATH=. bash scripts/gpu_session.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q -x tests/test_graph.py tests/test_kernels.py 2>&1 | tail -30 | tee "$OUT/tests.txt"
python -m expresslane.bench.kernels 2>&1 | tee "$OUT/kernels.txt"
python -m expresslane bench --preset laneformer-2b --contexts 128 1024 4000 --decode-tokens 128 \
  --dtype bfloat16 2>&1 | tee "$OUT/bench-laneformer-2b.txt"
python -m expresslane bench --preset llama-3.2-1b --contexts 128 1024 4000 --decode-tokens 128 \
  --dtype bfloat16 --peer-compile 2>&1 | tee "$OUT/bench-llama-1b.txt"
