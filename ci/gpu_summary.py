"""The GPU suite's summary (ci/gpu.sh): pytest's JUnit XML + provenance -> one JSON.

    python3 ci/gpu_summary.py PROVENANCE.json WALL_SECONDS JUNIT.xml...

Counts (passed, failed, errors, skipped), each test's outcome and time, and where it ran (GPU,
driver, torch, vLLM, commit, command, date): what bench/results/gpu/ keeps for each run.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from importlib import metadata


def outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    return "passed"


def main(provenance: str, wall_s: str, *junits: str) -> None:
    cases = [c for j in junits for c in ET.parse(j).getroot().iter("testcase")]
    tests = [
        {
            "test": f"{c.get('file') or c.get('classname')}::{c.get('name')}",
            "outcome": outcome(c),
            "seconds": round(float(c.get("time", 0)), 1),
        }
        for c in cases
    ]
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error")}
    counts["skipped"] = sum(t["outcome"] == "skipped" for t in tests)
    try:
        vllm = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        vllm = "not installed"
    summary = {
        "suite": "gpu (pytest -m gpu, ci/gpu.sh)",
        **counts,
        "green": counts["passed"] > 0
        and not (counts["failed"] or counts["error"] or counts["skipped"]),
        "wall_seconds": int(wall_s),
        "vllm": vllm,
        "provenance": json.loads(open(provenance).read()),
        "tests": tests,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
