"""The GPU suite's summary (ci/gpu.sh): each test file's JUnit XML and exit status + provenance
-> one JSON, and one line saying whether the run is green (the exit status says it too).

    python3 ci/gpu_summary.py PROVENANCE.json WALL_SECONDS FILES_DIR SUMMARY.json

FILES_DIR holds `<file>.xml` and `<file>.rc` for each test file ci/gpu.sh ran. The summary has
the counts (passed, failed, errors, skipped, interrupted), each test's outcome and time, the files
that did not finish (interrupted past their time budget, or exited non-zero with no failure
reported), and where it ran (GPU, driver, torch, vLLM, commit, command, date): what
bench/results/gpu/ keeps. Green: tests passed, none failed, errored, skipped or was interrupted,
and every file finished.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TIMED_OUT = 124  # timeout(1)'s exit status
OUTCOMES = ("passed", "failed", "error", "skipped", "interrupted")


def outcome(case: ET.Element) -> str:
    # pytest interrupted (SIGINT past the budget) writes one testcase with no name: not a pass
    if case.get("name") is None:
        return "interrupted"
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
    return "passed"


def main(provenance: str, wall_s: str, files_dir: str, out: str) -> int:
    tests, unfinished = [], []
    for rc_file in sorted(Path(files_dir).glob("*.rc")):
        rc = int(rc_file.read_text())
        junit = rc_file.with_suffix(".xml")
        cases = list(ET.parse(junit).getroot().iter("testcase")) if junit.exists() else []
        outcomes = [outcome(c) for c in cases]
        tests += [
            {
                "test": f"{c.get('file') or c.get('classname')}::{c.get('name')}"
                if o != "interrupted"
                else f"{rc_file.stem}: interrupted",
                "outcome": o,
                "seconds": round(float(c.get("time", 0)), 1),
            }
            for c, o in zip(cases, outcomes)
        ]
        if rc == TIMED_OUT or (rc != 0 and not {"failed", "error"} & set(outcomes)):
            why = "past its time budget" if rc == TIMED_OUT else f"exit status {rc}"
            unfinished.append({"file": rc_file.stem, "why": why})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in OUTCOMES}
    where = json.loads(Path(provenance).read_text())
    green = counts["passed"] > 0 and not (any(counts[k] for k in OUTCOMES[1:]) or unfinished)
    summary = {
        "suite": "gpu (pytest -m gpu, ci/gpu.sh)",
        **counts,
        "unfinished": unfinished,
        "green": green,
        "wall_seconds": int(wall_s),
        "vllm": where["vllm"],  # the provenance's: re-summarizing elsewhere keeps the GPU machine's
        "provenance": where,
        "tests": tests,
    }
    Path(out).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"ci/gpu: {'green' if green else 'NOT green'}: {counts['passed']} passed, "
        f"{counts['failed']} failed, {counts['error']} errors, {counts['skipped']} skipped, "
        f"{counts['interrupted']} interrupted, "
        f"{len(unfinished)} files unfinished, in {wall_s} s ({out})"
    )
    return 0 if green else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
