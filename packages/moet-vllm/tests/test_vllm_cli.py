from __future__ import annotations

import subprocess
import sys

import pytest

from moet_vllm import cli, compat


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for sub in ("convert", "inspect", "study", "doctor"):
        assert sub in out


def test_doctor_exits_0_and_reports_kernels(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: None)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "kernels: " in out
    assert "vllm: not installed" in out
    assert "plugin: entry point vllm.general_plugins: moet = moet_vllm.plugin:register" in out
    assert "store: " in out or "store:\n" in out


def test_doctor_flags_unsupported_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", "0.33.0"))
    assert cli.main(["doctor"]) == 1
    assert "NOT supported" in capsys.readouterr().out


def test_user_errors_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom(args) -> int:
        raise compat.MoetVllmError("something the user can fix")

    monkeypatch.setattr(cli, "run_doctor", boom)
    assert cli.main(["doctor"]) == 2
    err = capsys.readouterr().err
    assert err == "moet: error: something the user can fix\n"


def test_console_script_runs() -> None:
    # `python -m moet_vllm.cli` is what the `moet` console script calls (moet_vllm.cli:main).
    proc = subprocess.run(
        [sys.executable, "-m", "moet_vllm.cli", "doctor"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "kernels: unavailable" in proc.stdout or "kernels: available" in proc.stdout
