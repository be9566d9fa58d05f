#!/usr/bin/env bash
# The README's test command: set up the machine (ci/setup.sh), then run every CI session.
# The list of sessions lives in one place, the noxfile's `ci` session. Exits non-zero on any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
# nox sessions here run with python=False: their `python`, `ruff`, ... come from PATH.
export PATH="$root/.venv/bin:$PATH"
# CI installs vLLM, modelopt, liburing and the SASS tools: a test that skips fails the run
# unless ci/pytest_skips.py lists its reason
export STRICT_SKIPS=1
exec .venv/bin/nox --no-error-on-missing-interpreters -s ci
