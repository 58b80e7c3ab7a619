"""Jobs of tests/jobs/worker/test_fencing.py: runs that lose their claim (a stopped process, a
database the run cannot reach). Its workers import this module (-I) besides tests.support.tasks."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from jobs import LeaseLost
from jobs.core.policies import RetryPolicy
from jobs.worker.decorators import job
from jobs.worker.effects import effect_once
from tests.support.tasks import mark, wait_for_flag

# A lost run is not a failure: nothing here should need a retry, but a stray one stays quick.
QUICK = RetryPolicy(max_attempts=4, base_delay=0.2, factor=1.0, jitter=False)


@job(name="tests.fencing.stalls", queue="reports", retry=QUICK, bind=True)
def stalls(self: Any, key: str, swallow: bool = False) -> str:
    """Its first run announces itself and waits for the test's flag (the test stops the
    process meanwhile); every run then applies its effect once and returns which run it was.
    `swallow`: the run ignores LeaseLost and returns anyway (its finish must be refused)."""
    run = mark(f"{key}:runs")
    if run == 1:
        mark(f"{key}:stalling")
        with contextlib.suppress(LeaseLost):  # the renewer may stop the wait itself
            wait_for_flag(f"{key}:resume", timeout=120)
    try:
        with effect_once(f"fencing:{key}") as effect:
            if not effect.done:
                mark(f"{key}:applied", run)
    except LeaseLost as exc:
        mark(f"{key}:lost", f"{run}:{exc.reason}")
        if not swallow:
            raise
    return f"run {run}"


@job(name="tests.fencing.watches", queue="reports", retry=QUICK, bind=True)
def watches(self: Any, key: str) -> str:
    """Its first run reports progress until it is told it lost its claim (the test cuts its
    worker off the database); the next run returns at once."""
    run = mark(f"{key}:runs")
    if run > 1:
        return f"run {run}"
    deadline = time.monotonic() + 90
    step = 0
    try:
        while time.monotonic() < deadline:
            step += 1
            self.progress(step, None, f"step {step}")
            if step == 1:
                mark(f"{key}:running")
            time.sleep(0.05)
    except LeaseLost as exc:
        mark(f"{key}:lost", exc.reason)  # the mark's time is when the job learnt it
        raise
    return "never told"


@job(name="tests.fencing.noted", queue="reports", retry=QUICK)
def noted(key: str) -> None:
    """Marks that it ran (the lost-message test: which message reached a worker)."""
    mark(key)


@job(name="tests.fencing.sleeps", queue="reports", retry=QUICK)
def sleeps(key: str, seconds: float) -> None:
    """Holds a worker slot (and its message unacknowledged) for `seconds`."""
    mark(key)
    time.sleep(seconds)
