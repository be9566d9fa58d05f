#!/usr/bin/env bash
# Tiered residency on the H200 machine (one `device` run): build moet-store for its Python, then
# bench/residency_gpu.py: a GLM-5.2-shaped stack of 8 MoE layers (21.7 GB of W2 experts in packs,
# a pinned `ram` host tier), the serving ResidencyManager and moet-kernels in a captured CUDA graph;
# bit-identity with all-resident, replay %, step time and fetch bandwidth vs pool coverage.
# Usage there: MOET_COMMIT=<sha> bash bench/h200/residency.sh [harness args]  (results under $OUT)
set -euo pipefail
out=${OUT:-bench/results/residency_gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
site=$(mktemp -d -t moet-site-XXXXXX)    # moet-store built for this machine's Python
packs=$(mktemp -d -t moet-packs-XXXXXX)  # 21.7 GB of pack files
trap 'rm -rf "$site" "$packs"' EXIT
python3 -m pip install -q --no-build-isolation --no-deps --target "$site" ./packages/moet-store \
  2>&1 | tail -3
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
python3 bench/residency_gpu.py --packs "$packs" --out "$out" "$@" 2>&1 | tee "$out/residency_gpu.log"
