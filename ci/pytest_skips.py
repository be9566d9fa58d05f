"""pytest plugin of the test sessions (noxfile `tests`): with STRICT_SKIPS=1 (ci/test.sh sets
it: CI installs vLLM, modelopt, liburing and the SASS tools), a skipped test fails the run unless
its reason is one of EXPECTED_SKIPS. GPU tests are deselected by their marker, never skipped, so
they do not count here.
"""

from __future__ import annotations

import os
import re

import pytest

# (reason pattern, why a CI run may skip it): the one list of skips CI accepts
EXPECTED_SKIPS = [
    (r"needs root|cannot mount", "mounting a small tmpfs (a full disk on demand) needs root"),
    (r"checks the CPU-only answer", "the kernel loader's CPU-only answer, on a CUDA machine"),
]

_skipped: list[tuple[str, str]] = []


def _strict() -> bool:
    # not a MOET_ variable: moet refuses an unknown one at boot, and test engines inherit the env
    return os.environ.get("STRICT_SKIPS") == "1"


def _expected(reason: str) -> bool:
    return any(re.search(pattern, reason) for pattern, _ in EXPECTED_SKIPS)


def _record(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
        _skipped.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_runtest_logreport(report) -> None:
    _record(report)


def pytest_collectreport(report) -> None:  # a module-level importorskip skips its whole file
    _record(report)


def _unexpected() -> list[tuple[str, str]]:
    return [(node, reason) for node, reason in _skipped if not _expected(reason)]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if _strict() and _unexpected() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    bad = _unexpected()
    if bad and _strict():
        terminalreporter.section("unexpected skips (STRICT_SKIPS=1: they fail the run)")
        for node, reason in bad:
            terminalreporter.line(f"{node}: {reason}")
        terminalreporter.line(
            "install what they need (ci/setup.sh), or, if CI cannot run them, add the reason to "
            "ci/pytest_skips.py EXPECTED_SKIPS with why"
        )
