from __future__ import annotations

import pytest
import torch

import moet_kernels
from moet_kernels.layout import LAYOUT_ID
from moet_kernels.loader import kernels_available, shipped_cubins


def test_version_and_layout() -> None:
    assert moet_kernels.__version__ == "0.1.0"
    assert LAYOUT_ID == moet_kernels.LAYOUT_ID == "logical-v0"


def test_no_cubins_shipped_yet() -> None:
    assert shipped_cubins() == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_unavailable_on_cpu_with_reason() -> None:
    ok, reason = kernels_available()
    assert ok is False
    assert "no CUDA device" in reason and "torch reference" in reason


def test_never_claims_kernels_without_cubins() -> None:
    ok, reason = kernels_available()
    assert ok is False and reason
