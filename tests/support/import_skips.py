"""A pytest plugin (tests/conftest.py loads it): a test skipped because a package did not
import hides a missing dependency, so the skip becomes a failure naming the package. Every
package the suite imports is in pyproject's dev extra; BACKLOT_ALLOW_IMPORT_SKIPS=1 lets a partial
environment run what it can. Proved by tests/test_import_skips.py."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

_IMPORT_SKIP = "could not import"  # the start of pytest.importorskip's reason


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _fail_an_import_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or os.environ.get("BACKLOT_ALLOW_IMPORT_SKIPS") == "1":
        return
    reason = _reason(report)
    if _IMPORT_SKIP in reason:
        report.outcome = "failed"
        report.longrepr = (
            f"skipped for a missing package ({reason}): add it to pyproject's dev extra "
            "(BACKLOT_ALLOW_IMPORT_SKIPS=1 allows the skip)"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    _fail_an_import_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    _fail_an_import_skip(outcome.get_result())
