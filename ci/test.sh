#!/usr/bin/env bash
# The README's test command: set up the machine (ci/setup.sh), then run every CI session.
# The list of sessions lives in one place, the noxfile's `ci` session. Exits non-zero on any failure.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash ci/setup.sh
# nox sessions here run with python=False: their `python`, `ruff`, ... come from PATH.
export PATH="$root/.venv/bin:$PATH"
exec .venv/bin/nox --no-error-on-missing-interpreters -s ci
