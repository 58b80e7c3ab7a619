"""The failover test's job (tests/scale/test_failover.py); the workers of both hosts import it.

Each run of the body inserts a row into `failover_runs` (no unique key: a job run twice has two
rows), and its effect, a row in `failover_marks`, through effect_once: the effect a user sees
must happen once per job however often the job runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import connection

from jobs.worker.decorators import job
from jobs.worker.effects import effect_once

RUNS_TABLE = "failover_runs"
MARKS_TABLE = "failover_marks"
# Long enough that a backlog stands in Redis while the primary is killed.
BODY_SECONDS = 0.1


def _insert(table: str, run: str, item: int, host: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (run, item, host, pid, at) VALUES (%s, %s, %s, %s, %s)",
            [run, item, host, os.getpid(), time.time()],
        )


@job(name="failover.work", bind=True)
def work(self: Any, run: str, item: int) -> int:
    _insert(RUNS_TABLE, run, item, self.request.hostname)
    time.sleep(BODY_SECONDS)
    with effect_once(f"failover:{run}:{item}") as effect:
        if not effect.done:
            _insert(MARKS_TABLE, run, item, self.request.hostname)
    return item
