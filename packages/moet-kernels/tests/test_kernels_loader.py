from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import moet_kernels
from moet_kernels.layout import LAYOUT_ID
from moet_kernels.loader import kernels_available, shipped_cubins


def test_layout() -> None:
    assert LAYOUT_ID == moet_kernels.LAYOUT_ID == "logical-v0"


def test_shipped_cubins_are_the_audited_ones() -> None:
    """A build with nvcc ships one cubin per committed SASS listing (sass/, `nox -s sass`); one
    without nvcc ships none. CI builds with nvcc."""
    sass = Path(__file__).resolve().parents[3] / "sass"
    expected = sorted(p.name.removesuffix(".sass") + ".cubin" for p in sass.glob("*.sass"))
    shipped = shipped_cubins()
    if os.environ.get("CI") and not os.environ.get("MOET_KERNELS_CUBIN_DIR"):
        assert expected and shipped == expected
    assert shipped in ([], expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_unavailable_on_cpu_with_reason() -> None:
    ok, reason = kernels_available()
    assert ok is False
    assert "no CUDA device" in reason and "torch reference" in reason


def test_never_claims_kernels_without_cubins() -> None:
    ok, reason = kernels_available()
    assert ok is False and reason
