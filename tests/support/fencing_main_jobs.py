"""Jobs of tests/jobs/worker/test_fencing_main.py: a run that never calls progress() or effect_once
(the renewer must stop it), and runs whose pool process is stopped, then taken over, then
ended by the worker's main process (hard time limit, terminating cancel, crash). Its workers
import this module (-I) besides tests.support.tasks."""

from __future__ import annotations

import os
import time

from jobs import LeaseLost
from jobs.core.policies import RetryPolicy
from jobs.worker.decorators import job
from tests.support.tasks import mark, wait_for_flag

# A lost run is not a failure: nothing here should need a retry, but a stray one stays quick.
QUICK = RetryPolicy(max_attempts=4, base_delay=0.2, factor=1.0, jitter=False)


@job(name="tests.fencing_main.sleeper", queue="reports", retry=QUICK)
def sleeper(key: str) -> str:
    """Its first run sleeps in time.sleep (no progress calls, no effects) until LeaseLost
    interrupts it; the mark's time is when the job learnt it. The next run returns at once."""
    run = mark(f"{key}:runs")
    if run > 1:
        return f"run {run}"
    mark(f"{key}:running", os.getpid())
    try:
        time.sleep(120)
    except LeaseLost as exc:
        mark(f"{key}:lost", exc.reason)
        raise
    return "never interrupted"


@job(name="tests.fencing_main.held", queue="reports", retry=QUICK)
def held(key: str) -> str:
    """Its first run marks its pool process and sleeps (the test stops that process); the
    second run (on another worker) marks itself and waits for the test's flag."""
    return _held(key)


# Each run's hard limit fires 40 s after it started (the soft one at 36 s): the first run's
# while it is stopped, the second run's (started some 10 s later) after the test's checks.
@job(name="tests.fencing_main.held_limited", queue="reports", retry=QUICK, time_limit=40)
def held_limited(key: str) -> str:
    """held, with a hard time limit."""
    return _held(key)


def _held(key: str) -> str:
    run = mark(f"{key}:runs")
    if run == 1:
        mark(f"{key}:pid", os.getpid())
        time.sleep(300)
        return "run 1"
    mark(f"{key}:second", os.getpid())
    wait_for_flag(f"{key}:resume", timeout=120)
    return f"run {run}"
