#!/usr/bin/env bash
# The README's main-job command: builds the default MoE model, converts it to 2-bit experts, serves
# it with vLLM and the moet plugin, asks it through the OpenAI API, prints the expert-tier summary
# and shuts the server down (ci/main_job.py). All output stays in moet's cache dir.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
export PATH="$root/.venv/bin:$PATH"
exec python ci/main_job.py "$@"
