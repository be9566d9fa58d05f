#!/usr/bin/env bash
# End-to-end decode on the H200 (issue 18, item 6): moet (every expert resident as W2, dense bf16)
# against stock vLLM bf16 and FP8 on one shape, same routing, same capture sizes, each engine in
# its own process, one after another (bench/serving_gpu.py, whose doc says what is measured).
#
# Needs vLLM 0.24 staged in ~/site first (../shared/gpu/vllm-0.24/README.md). The project's
# packages are installed as ci/gpu.sh installs them (pip --target, moet-store built for this
# Python, sm_90a cubins), into ~/moet-site, reused while the packages' sources are unchanged (a
# stamp), so that the engines can run one per device command (each command may take 10 minutes;
# a GLM-4.5-Air engine boots in ~1-3 min). Each command measures the copy bandwidth, runs the
# engines it is given (default: stock-bf16, stock-fp8, moet; stock-int4 on request), and writes
# under $OUT (default bench/results/serving_gpu/h200-<date>/): one JSON per engine, copy-bandwidth.json, summary.json
# and summary.md. Bring the files of every command into one folder and re-run
# `python3 bench/serving_gpu.py summarize DIR` there for the whole table.
#     MOET_COMMIT=<sha> bash bench/serving_gpu.sh [ENGINE ...] [-- serving_gpu.py options]
#     e.g. bash bench/serving_gpu.sh stock-bf16; bash bench/serving_gpu.sh moet -- --batches 1 8
#     tiered (one engine per pool, against moet's all-resident run of the same routing; about
#     two minutes a pool, and the device returns at most 8 files: 5 + one per pool):
#     bash bench/serving_gpu.sh moet -- --routing concentrated --gpu-pool all,100%,90%
#     the FP4 tier's cost (issue 19): off, heat alone, the gate checked, the gate replaying every
#     decode step (the last at --batches 1: three engines of ~100 s boot fill a command):
#     bash bench/serving_gpu.sh moet -- --fp4 off,25%/gate=off,25%; ... moet -- --fp4 25%/gate=1e9 --batches 1
#     the model that does not fit any other way, and its int4 baseline (at full depth it needs
#     0.97 of the GPU; `--layers N` cuts a model that does not boot):
#     bash bench/serving_gpu.sh moet -- --shape qwen3-235b-a22b --prefill-tokens 2048
#     bash bench/serving_gpu.sh stock-int4 -- --shape qwen3-235b-a22b --gpu-memory-utilization 0.97
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-bench/results/serving_gpu/h200-$(date -u +%F)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
site=${MOET_SITE:-$HOME/moet-site}
# the packages' sources (not their tests or build outputs) and the shared CMake modules
stamp=$(find packages cmake \( -name tests -o -name build -o -name '*.egg-info' -o -name __pycache__ \) \
  -prune -o -type f \( -name '*.py' -o -name '*.toml' -o -name '*.txt' -o -name '*.cmake' -o \
  -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' -o -name '*.cpp' \) -print |
  LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
if [[ "$(cat "$site/.stamp" 2>/dev/null)" != "$stamp" ]]; then
  t0=$(date +%s)
  rm -rf "$site" && mkdir -p "$site"
  install() { python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target "$site" "$@"; }
  { install ./packages/moet-quant ./packages/moet-store ./packages/moet-vllm &&
    install --config-settings=cmake.define.MOET_KERNELS_ARCHS=90a \
      --config-settings=build-dir="$site/build" ./packages/moet-kernels; } \
    >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; echo "serving_gpu: install failed" >&2; exit 1; }
  echo "$stamp" >"$site/.stamp"
  echo "serving_gpu: packages installed in $(($(date +%s) - t0)) s"
fi
export PYTHONPATH="$site${HOME:+:$HOME/site}${PYTHONPATH:+:$PYTHONPATH}"
# the cubins this script built, named explicitly: on the H200 (2026-12-02) the first moet engine
# after an install reported no cubin in the installed package, and with this set the next ran
export MOET_KERNELS_CUBIN_DIR="$site/moet_kernels/cubins"
# the moet engine runs the kernels (--moet-compute kernel): a build without them stops here, with
# the reason, not after the stock engines ran
python3 -c 'from moet_kernels.loader import kernels_available as k; ok, why = k()
print("serving_gpu: moet-kernels:", why or "ready"); raise SystemExit(not ok)'
engines=()
while [[ $# -gt 0 && $1 != -- ]]; do engines+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
python3 bench/serving_gpu.py compare "${engines[@]}" --out "$out" --moet-compute kernel "$@" \
  2>&1 | tee -a "$out/serving_gpu.log"
