#!/usr/bin/env bash
# Branch split-items: the team-split / spread-epilogue A/B on the GLM-4.5-Air shape (one device
# call, no vLLM), then the reduced validation of teams of 1 and 2 (docs/kernels-design.md item 6).
# Usage there: bash bench/probes/split_ab.sh   (results under $OUT)
set -u
out=${OUT:-/tmp/split-ab}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
git show fd1d747:packages/moet-kernels/csrc/w2_moe.cu > /tmp/old_w2_moe.cu 2>/dev/null &&
  old="--variant old=@/tmp/old_w2_moe.cu" || old=""  # the loop before the stepped pointers
python3 bench/probes/chain_probe.py --shape glm-4.5-air --batches 1 8 32 --pdl on $old \
  --variant base= --variant w2s1=-DW2_SPLIT=1 --variant w2s2=-DW2_SPLIT=2 \
  --variant epi=-DEPI_SPREAD=1 --rounds 3 --out "$out/ab.json" > "$out/ab.log" 2>&1
echo "chain probe: exit $?"
MOET_NVCC_FLAGS="-DEPI_SPREAD=1 -DW13_SPLIT=2 -DW2_SPLIT=1" python3 bench/kernels.py --sanitize \
  --out /tmp/val > "$out/validate.log" 2>&1
echo "validation (teams of 1 and 2, spread epilogue): exit $?"
