"""Fixtures the GPU test files (marker `gpu`) share: their prerequisites, checked before each of
their tests (on a CUDA machine a missing one fails, never skips), and the trained fixture as a
moet checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving import check_gpu_prerequisites, convert_fixture


@pytest.fixture(autouse=True)
def gpu_prerequisites(request):
    if request.node.get_closest_marker("gpu"):
        check_gpu_prerequisites()


@pytest.fixture(scope="session")
def fixture_moet(tmp_path_factory) -> Path:
    """serving.FIXTURE converted by `moet convert` (once per session)."""
    return convert_fixture(tmp_path_factory.mktemp("gpu-models") / "fixture-moet")
