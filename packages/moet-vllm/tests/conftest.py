"""Fixtures the GPU test files (marker `gpu`) share: their prerequisites, checked before each of
their tests (on a CUDA machine a missing one fails, never skips), and the trained fixture as a
moet checkpoint; and the order CI's two workers take the files in."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving import check_gpu_prerequisites, convert_fixture

# CI runs these tests on 2 workers a file at a time (xdist `--dist loadfile
# --no-loadscope-reorder`, noxfile.py): the slowest files first, so that none of them starts last
# on one worker while the other idles (seconds each on 2 cores, 2026-12-07: 493, 481, 399, 264,
# 206, 105, 73, 58, 47). Replayed on that run's test times, this order loads the workers 1086 and
# 1113 s; xdist's own, by test count, 1272 and 927 (measured: 1353 and 927)
SLOWEST_FIRST = (
    "test_vllm_tiered.py",
    "test_vllm_parallel.py",
    "test_vllm_fp4_tier.py",
    "test_vllm_quantized.py",
    "test_vllm_serving.py",
    "test_fp4_gate.py",
    "test_vllm_openai.py",
    "test_fp4_pool.py",
    "test_vllm_cli.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a file


@pytest.fixture(autouse=True)
def gpu_prerequisites(request):
    if request.node.get_closest_marker("gpu"):
        check_gpu_prerequisites()


@pytest.fixture(scope="session")
def fixture_moet(tmp_path_factory) -> Path:
    """serving.FIXTURE converted by `moet convert` (once per session)."""
    return convert_fixture(tmp_path_factory.mktemp("gpu-models") / "fixture-moet")
