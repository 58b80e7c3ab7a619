"""Jobs for tests/jobs/worker/test_shutdown.py; its worker imports this module (-I)."""

from __future__ import annotations

import time

from jobs.core.policies import Permanent
from jobs.worker.decorators import job
from tests.support.tasks import mark


@job(name="tests.shutdown.fails_late", queue="reports")
def fails_late(key: str, seconds: float) -> None:
    """Runs `seconds`, then fails for good (a dead letter, no retry)."""
    mark(key)
    time.sleep(seconds)
    raise Permanent("failed at its end")
