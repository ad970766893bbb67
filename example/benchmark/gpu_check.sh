#!/usr/bin/env bash
# Every GPU figure and every CUDA test of tiny_zero, in one command on a machine with a GPU:
#
#   bash example/benchmark/gpu_check.sh [OUT]     # OUT: a folder for the log and the traces (default ./gpu_out)
#
# In order, each under its own time limit (timeout), all of it logged to OUT/gpu_check.log:
#   nvidia-smi | the GPU, torch, CUDA and triton versions and the commit |
#   the CUDA tests of tests/test_cuda.py, test_fused.py and test_optim.py |
#   example/benchmark/gpu.py (gpt2 and gpt2-medium) | example/benchmark/profile_gpu.py (its traces into OUT) |
#   offload's CUDA tests (tests/test_offload.py, one process each; its gpt2-medium memory case left out for time).
# A step that fails or runs out of time does not stop the next; the log ends with each
# step's exit status (124: out of time), and the script exits 1 if any step failed.
# About 4 minutes on one H200, the first Triton compiles included; at most 6.5 minutes (the limits' sum).
# PYTHON names the interpreter (default python3). GPU_CHECK_DRY_RUN=1 replaces each step's
# command by an echo (tests/test_gpu_script.py).
set -u
OUT=$(mkdir -p "${1:-./gpu_out}" && cd "${1:-./gpu_out}" && pwd)
cd "$(dirname "$0")/../.."  # the repository's root
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-python3}
LOG="$OUT/gpu_check.log"
: >"$LOG"
STATUSES=()

step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2 started=$SECONDS status shown
    shift 2
    shown="$*"
    echo "== $name (at most $seconds s): ${shown%%$'\n'*}" | tee -a "$LOG"  # a command's first line
    if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then set -- echo "$name"; fi
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    echo "-- $name: exit $status after $((SECONDS - started)) s" | tee -a "$LOG"
    STATUSES+=("$name: exit $status")
}

VERSIONS='import subprocess, sys, torch
try:
    import triton; triton_version = triton.__version__
except ImportError:
    triton_version = "not installed"
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:  # no git here
    commit = ""
commit = commit or "unknown (no git checkout here)"
print(f"{gpu}; torch {torch.__version__}; CUDA {torch.version.cuda}; triton {triton_version}; "
      f"Python {sys.version.split()[0]}; commit {commit}")'

step nvidia-smi 5 nvidia-smi
step versions 15 "$PYTHON" -c "$VERSIONS"
step cuda-tests 100 "$PYTHON" -m pytest -q -rs --durations=15 -k cuda tests/test_cuda.py tests/test_fused.py \
    tests/test_optim.py
step gpu.py 110 "$PYTHON" example/benchmark/gpu.py --models gpt2 gpt2-medium --warmup 5 --steps 20
step profile_gpu.py 55 "$PYTHON" example/benchmark/profile_gpu.py --out "$OUT"
step offload-cuda-tests 90 "$PYTHON" -m pytest -q -rs -k "cuda and not medium" tests/test_offload.py

echo "== exit statuses" | tee -a "$LOG"
failed=0
for line in "${STATUSES[@]}"; do
    echo "$line" | tee -a "$LOG"
    [ "${line##*exit }" = 0 ] || failed=1
done
exit $failed
