#!/usr/bin/env bash
# Create the virtual environment and install ExpressLane into it, for `make run` or `make test`.
# One progress line per step on the terminal; pip's own output goes to VENV/setup.log, and only
# if a step fails are its last lines shown.
# usage: scripts/setup_venv.sh VENV run|test
set -uo pipefail
venv=${1:-.venv}
what=${2:-run}
torch_pin=2.13.0
log=$venv/setup.log
py=$venv/bin/python
n=4
i=0

# step TITLE COMMAND...: print "setup i/n: TITLE ... ok (Ns)", the command's output in the log
step() {
  local title=$1 t0=$SECONDS
  shift
  i=$((i + 1))
  printf 'setup %d/%d: %s ... ' "$i" "$n" "$title"
  echo "=== $title: $*" >>"$log"
  if "$@" >>"$log" 2>&1; then
    echo "ok ($((SECONDS - t0)) s)"
  else
    echo "FAILED"
    echo "--- the last lines of $log:"
    tail -n 25 "$log"
    exit 1
  fi
}

skip() {
  i=$((i + 1))
  printf 'setup %d/%d: %s\n' "$i" "$n" "$1"
}

# The CPU build of torch that lies on this machine's disk (pip's find-links), else the CPU
# wheel index: a bare `torch` requirement would pull the CUDA build (gigabytes).
install_torch() {
  "$py" -m pip install "torch==$torch_pin" ||
    "$py" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
}

mkdir -p "$venv"
echo "### $(date -u +%FT%TZ) scripts/setup_venv.sh $venv $what" >>"$log"
echo "setup: ExpressLane for \`make $what\` in $venv (pip's output: $log)"
if [ -x "$py" ]; then
  skip "virtual environment: already there"
else
  step "virtual environment ($(python3 --version 2>&1))" python3 -m venv "$venv"
fi
step "pip, up to date" "$py" -m pip install --upgrade pip
if "$py" -c "import torch" >/dev/null 2>&1; then
  skip "torch: $("$py" -c 'import torch; print(torch.__version__)') already installed"
else
  step "torch $torch_pin, CPU build (the largest download)" install_torch
fi
if [ "$what" = test ]; then
  step "expresslane and the test tools (pytest, transformers, lm-eval, ...)" \
    "$py" -m pip install -e '.[test]'
else
  step "expresslane and its dependencies" "$py" -m pip install -e .
fi
