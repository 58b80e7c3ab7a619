"""Jobs for the fault-injection suite; fault workers import this module (-I).

Every job counts its runs in the SHARED test Redis (FAULTS_COUNTER_URL, never the private
Redis a fault test restarts) and applies its effect once with jobs.worker.effects.effect_once. The
effect is a row in the `faults_applied` table (no unique constraint), written in the same
transaction as the Effect row: a second application would show as a second row, so the
duplicate count the tests assert is exact, even when a process is killed mid-job.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from functools import lru_cache
from typing import Any

import redis
from billiard.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import connection

from jobs.core.policies import Retryable, RetryPolicy
from jobs.models import Job
from jobs.worker.decorators import job
from jobs.worker.effects import effect_once

APPLIED_TABLE = "faults_applied"
# Fast retries: the faults are the subject, not the backoff.
QUICK_RETRY = RetryPolicy(max_attempts=3, base_delay=0.2, factor=1.0, jitter=False)
# A 5 s hard limit keeps the claim lease (limit + 60 s) as short as the platform allows.
TIME_LIMIT = 5


@lru_cache(maxsize=1)
def counter() -> redis.Redis:
    """The shared test Redis, where run counters survive a restart of the private one."""
    url = os.environ.get("FAULTS_COUNTER_URL") or settings.REDIS_URL
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


def count_run(run: str, item: int) -> int:
    """Count one run of `item`; returns how many runs it has had (this one included)."""
    return int(counter().hincrby(f"faults:{run}:runs", str(item), 1))


def apply_effect(run: str, item: int, job_id: str | None) -> bool:
    """The job's effect, at most once per (run, item); True when this call applied it."""
    with effect_once(f"faults:{run}:{item}") as effect:
        if effect.done:
            return False
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {APPLIED_TABLE} (run, item, job_id, pid) VALUES (%s, %s, %s, %s)",
                [run, item, job_id, os.getpid()],
            )
        return True


@job(name="faults.effect", bind=True, time_limit=TIME_LIMIT, retry=QUICK_RETRY)
def effect(self: Any, run: str, item: int, seconds: float = 0.0) -> int:
    """Count the run, work for `seconds`, apply the effect once."""
    count_run(run, item)
    if seconds:
        time.sleep(seconds)
    apply_effect(run, item, self.request.id)
    return item


@job(name="faults.quick", bind=True, time_limit=120, retry=QUICK_RETRY)
def quick(self: Any, run: str, item: int, seconds: float = 0.0, fail: bool = False) -> int:
    """Counts its run, works for `seconds` on its first run, returns: no ledger write of its
    own (DEFER_CLAIM's short job); `fail` raises a retryable error on its first run."""
    runs = count_run(run, item)
    if seconds and runs == 1:
        time.sleep(seconds)
    if fail and runs == 1:
        raise ConnectionError(f"quick {item} fails its first run")
    return item


@job(name="faults.slow", bind=True, time_limit=120, retry=QUICK_RETRY)
def slow(self: Any, run: str, item: int, seconds: float) -> int:
    """A long job (SIGTERM tests): counts its start, sleeps, applies its effect once."""
    count_run(run, item)
    time.sleep(seconds)
    apply_effect(run, item, self.request.id)
    counter().hincrby(f"faults:{run}:done", str(item), 1)
    return item


@job(name="faults.poison", bind=True, time_limit=TIME_LIMIT, retry=QUICK_RETRY)
def poison(self: Any, run: str, item: int) -> None:
    """Always fails with a retryable error."""
    count_run(run, item)
    raise Retryable(f"poison {item} always fails")


def failures_planned(seed: int, item: int) -> tuple[int, bool]:
    """How many leading attempts of `item` fail (0 = none; 99 = every one), and whether a
    failure strikes after the effect committed. About 10 % of items fail; deterministic."""
    rng = random.Random(seed * 1_000_003 + item)
    if rng.random() >= 0.10:
        return 0, False
    return rng.choice([1, 1, 1, 2, 2, 99]), rng.random() < 0.5


@job(name="faults.flaky", bind=True, time_limit=TIME_LIMIT, retry=QUICK_RETRY)
def flaky(self: Any, run: str, item: int, seed: int, seconds: float = 0.0) -> int:
    """Fails transiently per failures_planned(), sometimes after its effect is applied."""
    count_run(run, item)
    if seconds:
        time.sleep(seconds)
    fails, after_effect = failures_planned(seed, item)
    attempt = Job.objects.filter(id=self.request.id).values_list("attempts", flat=True).first() or 1
    failing = attempt <= fails
    if failing and not after_effect:
        raise ConnectionError(f"transient failure of {item}, attempt {attempt}")
    apply_effect(run, item, self.request.id)
    if failing:
        raise ConnectionError(f"transient failure of {item} after its effect, attempt {attempt}")
    return item


@job(name="faults.soft_stop", bind=True, soft_time_limit=1, time_limit=60, retry=QUICK_RETRY)
def soft_stop(self: Any, run: str, item: int) -> str:
    """Stops at its soft time limit and says so (a solo worker raises it: jobs.worker.watchdog)."""
    count_run(run, item)
    try:
        time.sleep(30)
    except SoftTimeLimitExceeded:
        return "stopped at the soft limit"
    return "slept"


@job(name="faults.stubborn", bind=True, soft_time_limit=1, time_limit=2, retry=QUICK_RETRY)
def stubborn(self: Any, run: str, item: int) -> None:
    """Swallows its soft time limit, as code stuck in a C call would: only the hard one ends it."""
    count_run(run, item)
    while True:
        with contextlib.suppress(SoftTimeLimitExceeded):
            time.sleep(0.05)
