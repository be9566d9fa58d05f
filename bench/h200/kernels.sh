#!/usr/bin/env bash
# moet-kernels on the H200 machine (one `device` run): build the cubin there with nvcc, validate
# every op against the references, time the GLM-5.2 layer (and vLLM 0.24's own kernels on it where
# vLLM is staged in ~/site), then a reduced validation under
# compute-sanitizer (memcheck; racecheck with RACECHECK=1).
# Usage there: MOET_COMMIT=<sha> bash bench/h200/kernels.sh  (results under $OUT)
set -uo pipefail
out=${OUT:-bench/results/kernels}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 bench/kernels.py --out "$out" "$@" 2>&1 | tee "$out/kernels.log"
status=${PIPESTATUS[0]}
if [ -d "$HOME/site/vllm" ]; then  # vLLM 0.24 staged (../shared/gpu/vllm-0.24/): its kernels, same run
  PYTHONPATH="$HOME/site" timeout 420 python3 bench/h200/vllm_moe.py --out "$out" 2>&1 | tee "$out/vllm_moe.log"
fi
tools=(memcheck)
[ "${RACECHECK:-0}" = 1 ] && tools+=(racecheck)
for tool in "${tools[@]}"; do
  timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 --report-api-errors no python3 bench/kernels.py \
    --sanitize >"$out/$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $?"
  grep -E "^========= (Invalid|Program hit|Race|Error|ERROR SUMMARY|RACECHECK SUMMARY)|^=========     at " \
    "$out/$tool.log" | sort | uniq -c | sort -rn | head -12
done
if [ "${NCU:-0}" = 1 ]; then  # where the w13/w2 time goes: Nsight Compute on one decode layer
  ncu --clock-control none -k regex:moet_w -c 2 --section SpeedOfLight --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
    python3 bench/probes/kernels_ncu.py 8 >"$out/ncu.log" 2>&1
  echo "ncu: exit $?"
  grep -vE "^==PROF==|^ *$|----" "$out/ncu.log" | grep -E "moet_|Throughput|Duration|Issue|Stall|Pipe|Occupancy|Registers|Warp Cycles|Eligible|Active|No Eligible|IPC|Executed" | head -60
fi
exit "$status"
