#!/usr/bin/env bash
# The GPU test suite: every package's tests marked `gpu`, on a CUDA machine (the H200), in one
# command. CI has no GPU and deselects them (`-m "not gpu"`); here a missing prerequisite fails.
#
# Needs vLLM 0.24 importable: on the H200 machine, stage it first (docs/vllm.md, "Serving on a
# GPU": ../shared/gpu/vllm-0.24/, into ~/site, which this script puts on PYTHONPATH). The
# project's packages are installed for this call only (moet-store and the sm_90a cubins are built
# here, for this machine's Python). Writes under $OUT (default bench/results/gpu/out):
# install.log, provenance.json, gpu-tests.log, logs.tar.gz (below) and summary.json (counts, GPU,
# driver, torch, vLLM, commit, command);
# commit summary.json as bench/results/gpu/<gpu>-<date>.json. The tree travels without .git:
#     MOET_COMMIT=<sha of the code under test> bash ci/gpu.sh [pytest args]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${OUT:-bench/results/gpu/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=$(mktemp -d -t moet-site-XXXXXX) work=$(mktemp -d -t moet-gpu-XXXXXX)
trap 'rm -rf "$site" "$work"' EXIT
t0=$(date +%s)
install() { python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target "$site" "$@"; }
{ install ./packages/moet-quant ./packages/moet-store ./packages/moet-vllm ./packages/moet &&
  install --config-settings=cmake.define.MOET_KERNELS_ARCHS=90a \
    --config-settings=build-dir="$site/build" ./packages/moet-kernels; } \
  >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; echo "ci/gpu: install failed" >&2; exit 1; }
echo "ci/gpu: packages installed in $(($(date +%s) - t0)) s"
export PYTHONPATH="$site${HOME:+:$HOME/site}${PYTHONPATH:+:$PYTHONPATH}"
python3 bench/provenance.py bash ci/gpu.sh "$@" >"$out/provenance.json"
t1=$(date +%s)
# Each test file runs as its own pytest process, with its own log, JUnit file and exit status
# (files/) and its engines' logs and results (engines/<file>/), all packed into $out/logs.tar.gz (the device
# machine returns at most 8 files); $out/gpu-tests.log has every file's output. They run side by side
# (their engines take a fixed KV cache, no profiling), then test_gpu_memory.py alone (vLLM's
# memory profiling measures the whole device). A file past its time budget is interrupted (SIGINT:
# pytest still reports what ran), so the command stays inside the device's 10-minute limit.
# Arguments naming test files replace both lists; the others go to every pytest.
alone=(packages/moet-vllm/tests/test_gpu_memory.py)
parallel=() args=() named=()
for f in packages/*/tests/test_gpu_*.py; do [[ " ${alone[*]} " == *" $f "* ]] || parallel+=("$f"); done
for a in "$@"; do if [[ $a == *.py || $a == *.py::* ]]; then named+=("$a"); else args+=("$a"); fi; done
[ ${#named[@]} -eq 0 ] || { parallel=("${named[@]}"); alone=(); }
res=$work/results
mkdir -p "$res/files" "$res/engines"
run_file() {  # budget in seconds, test file (or node id)
  local name; name=$(basename "${2%%::*}" .py)
  timeout -s INT -k 30 "$1" python3 -m pytest -m gpu -p no:cacheprovider -p no:xdist -rA \
    --durations=0 -o junit_family=xunit1 --junitxml="$res/files/$name.xml" \
    --basetemp="$work/$name" "$2" "${args[@]}" >"$res/files/$name.log" 2>&1
  echo $? >"$res/files/$name.rc"
  echo "ci/gpu: $name: $(tail -n 1 "$res/files/$name.log") (exit $(cat "$res/files/$name.rc"))"
  mkdir -p "$res/engines/$name"
  (cd "$work/$name" 2>/dev/null && find . \( -name '*.log' -o -name '*.json' \) -size -4M -exec cp --parents {} "$res/engines/$name" \;)
}
# budgets: ~35 s of installs + 330 + 220 s stay inside one 600 s device call (stage and install
# vLLM in an earlier call). Side by side, the slowest files took 242-284 s on H200s and H100s
# (2026-12-01 to 12-06) and 293-327 s on two H100 leases (runs 30 and 32: three files each past
# 330 s, rerun alone by naming them), where alone they took 52-121 s; the memory file's 3 boots
# took 130-173 s alone. The call leaves no slack to raise either budget
for f in "${parallel[@]}"; do run_file 330 "$f" & done
wait
for f in "${alone[@]}"; do run_file 220 "$f"; done
for f in "$res"/files/*.log; do echo "=== $(basename "$f" .log)"; cat "$f"; done >"$out/gpu-tests.log"
tar czf "$out/logs.tar.gz" -C "$res" files engines
python3 ci/gpu_summary.py "$out/provenance.json" $(($(date +%s) - t1)) "$res/files" "$out/summary.json"
