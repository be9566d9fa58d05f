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


def test_register_supported_vllm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", "0.32.1"))
    caplog.set_level(logging.INFO, logger=plugin.logger.name)
    plugin.register()
    plugin.register()
    logged = records(caplog)
    assert len(logged) == 1 and "vllm 0.32.1" in logged[0].getMessage()


def test_register_refuses_unsupported_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", "0.23.9"))
    for _ in range(2):  # refused every time, never half-registered
        with pytest.raises(compat.MoetVllmError, match="0.23.9"):
            plugin.register()
    assert not plugin.is_registered()


def test_register_real_environment() -> None:
    # With no vLLM or a supported one installed, registering must not raise.
    found = compat.installed_vllm()
    if found is not None and not compat.is_supported(found[1]):
        pytest.skip(f"unsupported vLLM {found} installed")
    plugin.register()
