"""CI's rule on skips (ci/pytest_skips.py, loaded by every test session): with STRICT_SKIPS=1 a
skip fails the run unless its reason is an expected one; without it, skips pass as pytest's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[3] / "ci"

TESTS = """
import pytest

def test_runs():
    pass

def test_needs_root():
    pytest.skip("mounting a tmpfs needs root")

def test_needs_vllm():
    pytest.importorskip("a_module_that_is_not_installed")
"""


def run(tmp_path: Path, strict: bool, select: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(CI), "STRICT_SKIPS": "1" if strict else "0"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "pytest_skips", "-p", "no:cacheprovider",
           "-k", select, str(tmp_path)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)


@pytest.mark.parametrize("strict", [True, False])
def test_an_expected_skip_passes(tmp_path, strict):
    r = run(tmp_path, strict, "runs or root")
    assert r.returncode == 0, r.stdout
    assert "1 passed, 1 skipped" in r.stdout and "unexpected skips" not in r.stdout


def test_an_unexpected_skip_fails_a_strict_run_and_names_the_test(tmp_path):
    r = run(tmp_path, True, "runs or vllm")
    assert r.returncode == 1, r.stdout
    assert "unexpected skips" in r.stdout
    assert "test_sample.py::test_needs_vllm: could not import 'a_module_that_is_not_installed'" in (
        r.stdout
    )
    assert run(tmp_path, False, "runs or vllm").returncode == 0  # outside CI: a skip is a skip


def test_a_file_skipped_at_import_fails_a_strict_run(tmp_path):
    """A module-level importorskip skips the whole file at collection: it counts too."""
    (tmp_path / "test_whole_file.py").write_text(
        "import pytest\npytest.importorskip('a_module_that_is_not_installed')\n"
        "def test_x():\n    pass\n"
    )
    r = run(tmp_path, True, "runs or x")
    assert r.returncode == 1 and "test_whole_file.py: could not import" in r.stdout, r.stdout
