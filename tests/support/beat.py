"""The scheduler of tests' `celery beat` processes (--scheduler tests.support.beat:Scheduler).

It is Backlot's, with the test jobs registered (tests.record fires through the ledger, as a
project's own @job does) and, when BACKLOT_TEST_BEAT_LOCK_KEY is set, a leader lock of its
own: two such beats both lead at once, the split brain the fire records must survive (two
deployments pointed at different lock stores, a Redis failover that lost the lock key).
"""

from __future__ import annotations

import os

import tests.support.tasks  # noqa: F401  (registers the test jobs in the beat process)
from jobs.flow.beat import LOCK_KEY, LeaderDatabaseScheduler


class Scheduler(LeaderDatabaseScheduler):
    lock_key = os.environ.get("BACKLOT_TEST_BEAT_LOCK_KEY") or LOCK_KEY
