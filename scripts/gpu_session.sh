#!/usr/bin/env bash
# One GPU session's worth of checks, for the device machine (no network, torch/triton/transformers
# preinstalled): GPU tests, the kernel micro-benchmark, the decode benchmark with and without the
# fused kernels, and the launch-count prediction beside them; logs under $OUT.
#   usage there: PYTHONPATH=. bash scripts/gpu_session.sh
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q tests/test_graph.py tests/test_kernels.py tests/test_parallel.py -k \
  "cuda or nccl or graph or kernel or fused or sampling or synchronisation" 2>&1 | tail -40 \
  | tee "$OUT/tests.txt"
python -m expresslane.bench.kernels 2>&1 | tee "$OUT/kernels.txt"
for m in laneformer-2b llama-3.2-1b; do
  python -m expresslane.bench.launches --model "$m" --gpu h100 2>&1 | tee -a "$OUT/predicted.txt"
done
python -m expresslane bench --preset laneformer-2b --contexts 128 1024 4000 --decode-tokens 128 \
  --dtype bfloat16 --kernels both 2>&1 | tee "$OUT/bench-laneformer-2b.txt"
python -m expresslane bench --preset llama-3.2-1b --contexts 128 1024 4000 --decode-tokens 128 \
  --dtype bfloat16 --kernels both --peer-compile 2>&1 | tee "$OUT/bench-llama-1b.txt"
