#!/usr/bin/env bash
# The GPU session in stages, for the device machine (no network; torch, triton and transformers
# preinstalled; nothing is installed here). Plan and timings: docs/gpu-session.md.
#
#   usage: [OUT=dir] [PY=python3] [GPTFAST_DIR=dir] [LIMITS="stage=seconds ..."]
#          [SWEEP_MODELS="laneformer-2b ..."] scripts/gpu_session.sh [--dry-run] STAGE...
#   stages: smoke bench-2b bench-1b bench-qwen tests kernels profile sweep quant-2b quant-1b
#           ttft structured free-grammar spec-replay barrier persistent persistent-1b (at most 4
#           per call: 8 files)
#
# Every stage runs under `timeout` and tees its whole output to $OUT/STAGE.log; its result
# (rows kept as measured, test verdicts, rc, seconds) goes to $OUT/STAGE.json. A stage that fails
# or times out never stops the next one. The last lines printed are one summary line per stage;
# the exit code is 1 when any stage failed.
# LIMITS lowers (or raises) stages' limits so that a call's stages fit its device time. A sweep
# that completes installs its table on the device (never in a dry run), so the later stages of the
# same call run with its winners; this machine installs the same file after the call.
# --dry-run: every stage on the CPU with tiny presets (kernels in the Triton interpreter), the
# same files: what CI runs to prove the plumbing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-out}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
STAGES=(smoke bench-2b bench-1b bench-qwen tests kernels profile sweep quant-2b quant-1b ttft
        structured free-grammar spec-replay barrier persistent persistent-1b)
if [ $# -eq 0 ] || [ $# -gt 4 ]; then
  echo "usage: $0 [--dry-run] STAGE... (1 to 4 of: ${STAGES[*]}; 2 files each, 8 come back)" >&2
  exit 2
fi
for s in "$@"; do
  case " ${STAGES[*]} " in *" $s "*) ;; *) echo "unknown stage '$s' (${STAGES[*]})" >&2; exit 2;; esac
done
mkdir -p "$OUT"
# Packages the image lacks travel as wheels in .whl (ignored by git; the call's `carry` names it):
# llguidance, for the structured and free-grammar stages. docs/gpu-session.md has the download command.
if ((!DRY)) && compgen -G ".whl/*.whl" > /dev/null; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl && export PYTHONPATH=$SITE:$PYTHONPATH
fi
# Every test module with a `gpu` test (tests/test_gpu_session.py checks that none is missing);
# the last five (persistent step, quantized products, kernels, token axis, qwen layers) stay
# last: the dry run leaves them out.
GPU_TESTS=(tests/test_graph.py tests/test_parallel.py tests/test_prefix.py tests/test_speculative.py
           tests/test_capture_safe.py tests/test_prefill.py tests/test_prefill_norm.py tests/test_split.py
           tests/test_penalties.py tests/test_prediction.py tests/test_lora.py
           tests/test_draft_model.py
           tests/test_persistent.py tests/test_qgemv.py tests/test_kernels.py tests/test_kernels_tokens.py
           tests/test_kernels_qwen.py)

# stage_command NAME: sets LIMIT (seconds) and CMD (the command line) for a stage.
stage_command() {
  local peers=(--peer-compile)
  [ -n "${GPTFAST_DIR:-}" ] && peers+=(--peer-gptfast "$GPTFAST_DIR")
  case $1 in
    smoke)
      LIMIT=150; CMD=("$PY" -m expresslane.bench.smoke --model laneformer-2b)
      ((DRY)) && CMD+=(--dry-run) ;;
    bench-2b)
      LIMIT=330
      CMD=("$PY" -m expresslane bench --preset laneformer-2b --contexts 1024 128 4000
           --decode-tokens 128 --dtype bfloat16 --kernels both "${peers[@]}")
      ((DRY)) && CMD=("$PY" -m expresslane bench --preset laneformer-tiny --contexts 16 40
           --decode-tokens 4 --device cpu --dtype float32 --kernels both --threads 1
           "${peers[@]}" --peer-compile-backend eager) ;;
    bench-1b)
      LIMIT=240
      CMD=("$PY" -m expresslane bench --preset llama-3.2-1b --contexts 1024 128 4000
           --decode-tokens 128 --dtype bfloat16 --kernels both "${peers[@]}")
      ((DRY)) && CMD=("$PY" -m expresslane bench --preset llama-tiny --contexts 16
           --decode-tokens 4 --device cpu --dtype float32 --kernels both --threads 1
           "${peers[@]}" --peer-compile-backend eager) ;;
    bench-qwen)  # qwen3's q/k norms on the fused step (norm_qkv + kernels/qk_norm.py)
      LIMIT=200
      CMD=("$PY" -m expresslane bench --preset qwen3-0.6b --contexts 1024 --decode-tokens 128
           --dtype bfloat16 --kernels both --peer-compile)
      ((DRY)) && CMD=("$PY" -m expresslane bench --preset qwen3-tiny --contexts 16
           --decode-tokens 4 --device cpu --dtype float32 --kernels both --threads 1
           --peer-compile --peer-compile-backend eager) ;;
    tests)  # the GPU tests only (a marker: -k would match module names, every CPU test too)
      LIMIT=540
      CMD=("$PY" -m pytest -m gpu -vv -rs -p no:cacheprovider --continue-on-collection-errors
           "${GPU_TESTS[@]}")
      # the persistent-step, quantized-product and kernel tests (the last five) take minutes in
      # the interpreter
      ((DRY)) && CMD=("${CMD[@]:0:${#CMD[@]}-5}") ;;
    kernels)
      LIMIT=120; CMD=("$PY" -m expresslane.bench.kernels --context 1024)
      ((DRY)) && CMD+=(--dry-run --reps 1 --trials 1) ;;
    quant-2b|quant-1b)  # int8 / int4 products and decode against bf16 (bench/quant_gpu.py)
      LIMIT=420
      local preset=laneformer-2b; [ "$1" = quant-1b ] && preset=llama-3.2-1b
      CMD=("$PY" -m expresslane.bench.quant_gpu --preset "$preset" --context 1024)
      [ -n "${GPTFAST_DIR:-}" ] && CMD+=(--gptfast "$GPTFAST_DIR")
      ((DRY)) && CMD=("$PY" -m expresslane.bench.quant_gpu --preset "$preset" --dry-run) ;;
    ttft)  # a context's first request against the steady state, then the prefill's top ops
      LIMIT=150; CMD=("$PY" -m expresslane.bench.ttft --preset laneformer-2b --contexts 1024 4000
                      --repeats 3 --profile --reuse 100 400)
      ((DRY)) && CMD+=(--dry-run) ;;
    profile)
      LIMIT=120; CMD=("$PY" -m expresslane.bench.profile --model laneformer-2b --context 1024
                      --steps 20)
      ((DRY)) && CMD+=(--dry-run) ;;
    structured)  # the grammar mask's cost at the 2B's shapes: random weights, a borrowed tokenizer
      LIMIT=180; CMD=("$PY" -m expresslane.bench.structured --preset laneformer-2b --device cuda
                      --schemas 12 --max-tokens 128 --split plain chain)
      ((DRY)) && CMD=("$PY" -m expresslane.bench.structured --dry-run --split plain chain) ;;
    free-grammar)  # tool_choice auto's checked pick at the 2B's shapes, per convention
      LIMIT=120; CMD=("$PY" -m expresslane.bench.free_grammar --preset laneformer-2b --device cuda
                      --max-tokens 128 --repeats 3)
      ((DRY)) && CMD=("$PY" -m expresslane.bench.free_grammar --dry-run) ;;
    spec-replay)  # speculation at the 2B's shapes: SmolLM2's recorded acceptance x step times
      LIMIT=120; CMD=("$PY" -m expresslane.bench.spec_replay --preset laneformer-2b --context 1024)
      ((DRY)) && CMD+=(--dry-run) ;;
    barrier)  # a kernel boundary against a grid barrier: the persistent kernel's first question
      LIMIT=120; CMD=("$PY" -m expresslane.bench.barrier --model laneformer-2b --layers 4)
      ((DRY)) && CMD+=(--dry-run) ;;
    persistent)  # the whole step in one launch against the fused step: bits, then tok/s
      LIMIT=240; CMD=("$PY" -m expresslane.bench.persistent --preset laneformer-2b
                      --contexts 1024 4000 128 --programs-per-sm 2 4 --chunks 1 4 --warps 2 4
                      --deps phase lane)
      ((DRY)) && CMD+=(--dry-run) ;;
    persistent-1b)  # the one-lane Llama shape in one launch: its split-K wo and w2 as tasks
      LIMIT=150; CMD=("$PY" -m expresslane.bench.persistent --preset llama-3.2-1b
                      --contexts 1024 4000 128 --programs-per-sm 2 4 --chunks 1 --warps 2
                      --deps phase)
      ((DRY)) && CMD+=(--dry-run) ;;
    sweep)  # every kernel variant checked, then timed; the winners: sweep.json's result.table
      LIMIT=480; CMD=("$PY" -m expresslane.bench.sweep --model ${SWEEP_MODELS:-laneformer-2b
                      llama-3.2-1b} --context 1024 --tokens 1 4)
      ((DRY)) && CMD+=(--dry-run --tokens 2) ;;
  esac
  local kv
  for kv in ${LIMITS:-}; do [ "${kv%%=*}" = "$1" ] && LIMIT=${kv#*=}; done
  # the sweep stops starting cases 30 s before its limit and still writes its table
  [ "$1" = sweep ] && CMD+=(--budget $((LIMIT > 60 ? LIMIT - 30 : LIMIT / 2)))
}

run_stage() {
  local name=$1 log="$OUT/$1.log" start rc secs
  stage_command "$name"
  echo "=== $name (limit ${LIMIT}s): ${CMD[*]}"
  start=$(date +%s)
  timeout -k 15 "$LIMIT" "${CMD[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - start ))
  echo "=== $name: rc=$rc after ${secs}s"
  [ "$rc" -eq 0 ] || FAILED=1
  "$PY" -m expresslane.bench.session result "$name" "$log" "$rc" "$secs" "$LIMIT" \
    > "$OUT/$name.json" 2>> "$log" \
    || printf '{"stage": "%s", "rc": %d, "ok": false, "seconds": %d, "timed_out": false, "rows": [], "result": null}\n' \
      "$name" "$rc" "$secs" > "$OUT/$name.json"
  if [ "$name" = sweep ] && ((!DRY)) && "$PY" -m expresslane.bench.sweep --install "$OUT/sweep.json"; then
    echo "=== sweep: its winners are installed for the later stages of this call"
  fi
  if [ "$name" = smoke ] && grep -q '"pdl_broken": true' "$log"; then
    export EXPRESSLANE_PDL=0  # the graph check failed with PDL and passed without
    echo "=== smoke: PDL unsafe here; the later stages of this call run with EXPRESSLANE_PDL=0"
  fi
}

FAILED=0
for s in "$@"; do
  run_stage "$s"
done
echo "=== summary ($OUT)"
"$PY" -m expresslane.bench.session summary "$OUT" "$@"
exit $FAILED  # 1 when any stage failed or timed out (each one's files are there all the same)
