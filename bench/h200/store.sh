#!/usr/bin/env bash
# moet-store on the H200 machine (one `device` run): build the extension for its Python, run the
# store's tests there, then bench/store.py (arena hit -> pinned H2D vs a plain pinned copy, page-cache
# misses, O_DIRECT vs dd). Debian's liburing .debs may be carried in .device/ for io_uring.
# Usage there: MOET_COMMIT=<sha> bash bench/h200/store.sh  (results under $OUT)
set -euo pipefail
out=${OUT:-bench/results/store}
if ls .device/liburing*.deb >/dev/null 2>&1; then
  for f in .device/liburing*.deb; do dpkg -x "$f" /; done
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pip install -q --no-build-isolation --no-deps ./packages/moet-store 2>&1 | tail -3
python3 -m moet_store.cli doctor "$PWD" || true
python3 -m pytest -q -p no:cacheprovider packages/moet-store/tests 2>&1 | tail -5
python3 bench/store.py --pagecache-mib 2048 --direct-mib 1024 --out "$out/store-h200.json"
