#!/usr/bin/env bash
# The README's main-job command. Until the vLLM plugin lands it builds a real (seeded, untrained)
# Hugging Face MoE checkpoint with transformers and runs the quantizer on it: inspect, convert
# (twice: the second run finds the finished conversion), study. All output stays in moet's cache dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
export PATH="$root/.venv/bin:$PATH"
exec python ci/main_job.py "$@"
