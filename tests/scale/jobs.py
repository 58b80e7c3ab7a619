"""Jobs of the scale test; the workers of both host namespaces import this module (-I).

Each run of a job body inserts one row into `scale_marks` (no unique key) naming the worker
host it ran on and when it started: a lost job has no row, a job run twice has two.
"""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import connection

from jobs.worker.decorators import job

MARKS_TABLE = "scale_marks"
# The cluster-wide limit under test, shared by the workers of both hosts.
RATE = "40/s"


def mark(kind: str, run: str, item: int, host: str) -> None:
    started = time.time()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {MARKS_TABLE} (kind, run, item, host, pid, at)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            [kind, run, item, host, os.getpid(), started],
        )


@job(name="scale.work", bind=True)
def work(self: Any, run: str, item: int) -> int:
    """A short job: the platform's own overhead (claim, finish) is what is exercised."""
    mark("work", run, item, self.request.hostname)
    return item


# On its own queue, as rate-limited work (emails, a third-party API) is laid out in production.
# Its waiting jobs park at their gate in Redis, not in the queue (jobs.broker.concurrency), and the
# gate publishes each with its own token (see docs/scaling.md).
@job(name="scale.limited", bind=True, rate_limit=RATE, queue="emails")
def limited(self: Any, run: str, item: int) -> int:
    """The same, behind the cluster-wide rate limit RATE."""
    mark("limited", run, item, self.request.hostname)
    return item
