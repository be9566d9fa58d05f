#!/usr/bin/env bash
# The GPU test suite: every package's tests marked `gpu`, on a CUDA machine (the H200), in one
# command. CI has no GPU and deselects them (`-m "not gpu"`); here a missing prerequisite fails.
#
# Needs vLLM 0.24 importable: on the H200 machine, stage it first (docs/vllm.md, "Serving on a
# GPU": ../shared/gpu/vllm-0.24/, into ~/site, which this script puts on PYTHONPATH). The
# project's packages are installed for this call only (moet-store and the sm_90a cubins are built
# here, for this machine's Python). Writes under $OUT (default bench/results/gpu/out):
# gpu-tests.log, junit.xml and summary.json (counts, GPU, driver, torch, vLLM, commit, command);
# commit summary.json as bench/results/gpu/<gpu>-<date>.json. The tree travels without .git:
#     MOET_COMMIT=<sha of the code under test> bash ci/gpu.sh [pytest args]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-bench/results/gpu/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=$(mktemp -d -t moet-site-XXXXXX)
trap 'rm -rf "$site"' EXIT
t0=$(date +%s)
install() { python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target "$site" "$@"; }
{ install ./packages/moet-quant ./packages/moet-store ./packages/moet-vllm &&
  install --config-settings=cmake.define.MOET_KERNELS_ARCHS=90a \
    --config-settings=build-dir="$site/build" ./packages/moet-kernels; } \
  >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; echo "ci/gpu: install failed" >&2; exit 1; }
echo "ci/gpu: packages installed in $(($(date +%s) - t0)) s"
export PYTHONPATH="$site${HOME:+:$HOME/site}${PYTHONPATH:+:$PYTHONPATH}"
python3 bench/provenance.py bash ci/gpu.sh "$@" >"$out/provenance.json"
unset MOET_COMMIT  # provenance's, not a MoetConfig field: moet refuses unknown MOET_* variables
t1=$(date +%s)
# The GPU tests live in test_gpu_*.py. Side by side first (one pytest-xdist worker per file where
# xdist is there, as on the H200 image: their engines take a fixed KV cache, no profiling), then
# test_gpu_memory.py alone (vLLM's memory profiling measures the whole device). Arguments naming
# test files replace both lists.
alone=(packages/moet-vllm/tests/test_gpu_memory.py)
parallel=()
for f in packages/*/tests/test_gpu_*.py; do [[ " ${alone[*]} " == *" $f "* ]] || parallel+=("$f"); done
for a in "$@"; do [[ $a == *.py* ]] && parallel=() alone=(); done
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n "${#parallel[@]}" --dist loadfile)
suite() {  # junit file, then pytest arguments
  local junit=$1; shift
  python3 -m pytest -m gpu -p no:cacheprovider -rA --durations=0 -o junit_family=xunit1 \
    --junitxml="$out/$junit" "$@"
}
{ suite junit.xml "${workers[@]}" "${parallel[@]}" "$@"; first=$?
  [ ${#alone[@]} -eq 0 ] || suite junit-alone.xml "${alone[@]}"; second=$?
  exit $((first || second)); } 2>&1 | tee "$out/gpu-tests.log"
rc=${PIPESTATUS[0]}
python3 ci/gpu_summary.py "$out/provenance.json" $(($(date +%s) - t1)) "$out"/junit*.xml \
  >"$out/summary.json"
tail -n 12 "$out/summary.json"
exit "$rc"
