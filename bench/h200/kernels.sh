#!/usr/bin/env bash
# moet-kernels on the H200 machine (one `device` run): build the cubin there with nvcc, validate
# every op against the references, time the GLM-5.2 layer, then a reduced validation under
# compute-sanitizer (memcheck; racecheck with RACECHECK=1).
# Usage there: MOET_COMMIT=<sha> bash bench/h200/kernels.sh  (results under $OUT)
set -uo pipefail
out=${OUT:-bench/results/kernels}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 bench/kernels.py --out "$out" "$@" 2>&1 | tee "$out/kernels.log"
status=${PIPESTATUS[0]}
timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/kernels.py \
  --sanitize 2>&1 | tail -15 | tee "$out/memcheck.log"
if [ "${RACECHECK:-0}" = 1 ]; then
  timeout 240 compute-sanitizer --tool racecheck --error-exitcode 9 python3 bench/kernels.py \
    --sanitize 2>&1 | tail -15 | tee "$out/racecheck.log"
fi
exit "$status"
