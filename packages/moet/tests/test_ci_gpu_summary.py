"""The GPU suite's summary (ci/gpu_summary.py): what counts as green. A file interrupted past its
time budget leaves pytest's nameless testcase in its JUnit file; that is not a pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CI = Path(__file__).resolve().parents[3] / "ci"

PASSED = '<testcase classname="tests.test_a" name="test_{n}" file="tests/test_a.py" time="1.5" />'
INTERRUPTED = '<testcase time="0.001" />'  # what pytest's junitxml writes on SIGINT


def summarize(tmp_path: Path, files: dict[str, tuple[int, list[str]]]) -> tuple[int, dict]:
    """files: name -> (exit status, testcases); runs the script as ci/gpu.sh does."""
    d = tmp_path / "files"
    d.mkdir()
    for name, (rc, cases) in files.items():
        (d / f"{name}.xml").write_text(
            f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>"
        )
        (d / f"{name}.rc").write_text(f"{rc}\n")
    prov = tmp_path / "provenance.json"
    prov.write_text(json.dumps({"vllm": "0.24.0", "gpu": "a GPU", "commit": "abc1234"}))
    out = tmp_path / "summary.json"
    cmd = [sys.executable, str(CI / "gpu_summary.py"), str(prov), "12", str(d), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, json.loads(out.read_text())


def test_every_file_finished_and_passed_is_green(tmp_path):
    rc, s = summarize(tmp_path, {"test_a": (0, [PASSED.format(n=1), PASSED.format(n=2)])})
    assert rc == 0 and s["green"]
    assert (s["passed"], s["interrupted"], s["unfinished"]) == (2, 0, [])
    assert s["vllm"] == "0.24.0"  # the provenance's, not this machine's


def test_an_interrupted_file_is_neither_green_nor_counted_as_passing(tmp_path):
    rc, s = summarize(
        tmp_path,
        {
            "test_a": (0, [PASSED.format(n=1)]),
            "test_b": (124, [PASSED.format(n=2), INTERRUPTED]),
        },
    )
    assert rc == 1 and not s["green"]
    assert (s["passed"], s["interrupted"]) == (2, 1)
    assert s["unfinished"] == [{"file": "test_b", "why": "past its time budget"}]
    assert [t["test"] for t in s["tests"] if t["outcome"] == "interrupted"] == [
        "test_b: interrupted"
    ]
