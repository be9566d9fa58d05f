"""The kernels on a CUDA GPU against the float64 references (marker `gpu`; design.md, Kernels).

    pytest -m gpu packages/moet-kernels/tests/test_gpu_kernels.py

One test per case of `moet_kernels.testing.VALIDATION_CASES` (what each checks:
`moet_kernels.testing.validate_case`, docs/kernels.md "Validation"), plus the refinement tier's
expansion on the GPU. CI has no GPU and deselects the marker (`-m "not gpu"`); on a machine
that runs them, nothing here skips: no CUDA device or kernels that cannot load is a failure.

Inputs are fresh each run: the run's seed comes from os.urandom, or from GPU_TEST_SEED to
reproduce a failure (every failure message names it); each case draws from (seed, case id).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from moet_kernels import testing
from moet_kernels.loader import kernels_available

pytestmark = pytest.mark.gpu

# not a MOET_* name: moet-vllm refuses MOET_* variables that are not its settings, and vLLM
# engines of the same suite inherit this environment
SEED = int(os.environ.get("GPU_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
HERE = "packages/moet-kernels/tests/test_gpu_kernels.py"
NO_CUDA = "the gpu tests need a CUDA device; CI deselects them with -m 'not gpu'"


# Fail, never skip: on a machine that runs the gpu marker a missing prerequisite is a bug.
def require_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail(NO_CUDA, pytrace=False)


@functools.cache
def _kernels_missing() -> str | None:
    """Why the kernels cannot run on this device, or None (asked once per session)."""
    ok, why = kernels_available()
    return None if ok else why


def require_kernels() -> None:
    require_cuda()
    why = _kernels_missing()
    if why:
        pytest.fail(
            f"moet-kernels cannot run on this CUDA device: {why} (install moet-kernels where "
            "nvcc is on PATH, or point MOET_KERNELS_CUBIN_DIR at built cubins)",
            pytrace=False,
        )


def reproduce(test: str) -> str:
    return f"seed {SEED}: reproduce with GPU_TEST_SEED={SEED} python -m pytest '{HERE}::{test}'"


@pytest.mark.parametrize("case", testing.VALIDATION_CASES, ids=lambda c: c.id)
def test_kernels_match_references(case):
    require_kernels()
    try:
        r = testing.validate_case(case, SEED)
    finally:
        torch.cuda.empty_cache()  # the cases' pools add up over a session
    assert r["ok"], f"{case.id}: failed {r['failed']}\n{testing.result_line(r)}\n" + reproduce(
        f"test_kernels_match_references[{case.id}]"
    )


def test_refinement_expansion_matches_moet_quant():
    require_cuda()  # a torch expansion: no cubins needed
    r = testing.refinement_check()
    assert r["equal_to_moet_quant"], f"expand_refinement on the GPU differs from moet-quant: {r}"
