"""Skips that must not pass under CI (a pytest plugin: conftest.py takes its hooks).

Here a test skips, with its reason, when a part of the machine it needs is missing: PostgreSQL,
Slurm and root, transformers, chromium, Graphviz (scripts/setup.sh installs Debian's parts only as
root). CI's set-up installs every part, so under CI (its runner sets CI=true) such a skip fails the
test, and a test module skipped whole (pytest.importorskip) fails the collection. Only a test marked
`torch_build` may skip there: it needs the other build of torch (CUDA or CPU-only) than the one
installed. The terminal summary says how many skipped and why they could.
"""

from __future__ import annotations

import os

import pytest

MARK = "torch_build"


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARK}: may skip under CI: it needs the other build of torch (CUDA or CPU-only)"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if (
        report.skipped
        and not hasattr(report, "wasxfail")
        and under_ci()
        and not item.get_closest_marker(MARK)
    ):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, which installs every part: {_reason(report)}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    report = yield
    if report.skipped and under_ci():
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped under CI, which installs every part: {_reason(report)}"
    return report


def pytest_terminal_summary(terminalreporter) -> None:
    skipped = len(terminalreporter.stats.get("skipped", []))
    if under_ci():
        terminalreporter.write_line(
            f"CI: {skipped} skipped, each marked {MARK} (it needs the other build of torch); "
            "any other skip failed"
        )
    elif skipped:
        terminalreporter.write_line(
            f"{skipped} skipped: a part of this machine missing (see each reason), or the other build of "
            "torch; under CI (CI=true) a missing part fails"
        )
