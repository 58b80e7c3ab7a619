"""Jobs used only by the benchmarks; worker processes import this module (-I benchmarks.jobs).

Each Backlot job has a bare Celery twin doing the same thing, so a ratio compares the platform
and nothing else. Every name starts with "bench.".
"""

from __future__ import annotations

import functools
import time
from typing import Any

import redis
from celery import shared_task
from django.conf import settings

from jobs.worker.decorators import job

# Redis lists the stamping jobs append to; the runner reads and deletes them.
STAMPS = "bench:stamps:"


@functools.cache
def bench_redis() -> redis.Redis:
    """A connection pool of our own (redis-py resets it in forked pool processes)."""
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=2)


def stamp(key: str, value: float | str) -> None:
    bench_redis().rpush(STAMPS + key, value)


# --- no-ops: drain throughput, enqueue rate, bulk enqueue, Redis memory -------------------


@shared_task(name="bench.bare_noop", ignore_result=True)
def bare_noop(*args: Any, **kwargs: Any) -> None:
    """Bare Celery, no result backend: the baseline everything is compared with."""


@shared_task(name="bench.bare_noop_results")
def bare_noop_results(*args: Any, **kwargs: Any) -> None:
    """Bare Celery storing its result with django-celery-results (the project's backend)."""


@job(name="bench.noop")
def noop(*args: Any, **kwargs: Any) -> None:
    """Backlot with the ledger (track=True, the default)."""


@job(name="bench.noop_untracked", track=False)
def noop_untracked(*args: Any, **kwargs: Any) -> None:
    """Backlot with the ledger off (track=False)."""


# --- latency: the first thing each job does is write down when it started ----------------


@shared_task(name="bench.bare_stamp", ignore_result=True)
def bare_stamp(key: str) -> None:
    stamp(key, repr(time.time()))


@job(name="bench.stamp")
def tracked_stamp(key: str) -> None:
    stamp(key, repr(time.time()))


@job(name="bench.stamp_untracked", track=False)
def untracked_stamp(key: str) -> None:
    stamp(key, repr(time.time()))


# --- rate limiter: 50/s across every worker process ----------------------------------------

BENCH_RATE = "50/s"


@job(name="bench.rate_limited", rate_limit=BENCH_RATE)
def rate_limited(key: str) -> None:
    stamp(key, repr(time.time()))


# --- the gates of the project's emails.send: a keyed rate limit and concurrency limit ------


def _gate_key(args: tuple, kwargs: dict) -> str:
    return "bench-provider"


@job(
    name="bench.gated",
    rate_limit=settings.EMAIL_RATE_LIMIT,
    rate_key=_gate_key,
    concurrency=settings.EMAIL_CONCURRENCY,
    concurrency_key=_gate_key,
)
def gated(*args: Any, **kwargs: Any) -> None:
    """A no-op behind the gates emails.send has (its enqueue parks it at them)."""


# --- progress: a tight loop with and without self.progress --------------------------------


@job(name="bench.progress_loop", bind=True)
def progress_loop(self: Any, key: str, steps: int, report: bool, work_us: float = 0) -> None:
    """`steps` iterations, each spinning `work_us` microseconds (0: nothing) and, with
    `report`, calling self.progress; stamps the loop's run time (seconds)."""
    work = work_us / 1e6
    clock = time.perf_counter
    started = clock()
    for step in range(1, steps + 1):
        if work:
            until = clock() + work
            while clock() < until:
                pass
        if report:
            self.progress(step, steps)
    stamp(key, repr(clock() - started))


# --- the brokers compared (case amqp): a no-op that counts itself done ----------------------

# Redis counters the counting jobs INCR; a drain on RabbitMQ cannot be timed by the broker
# alone (a passive declare gives the ready messages, not the unacknowledged ones).
COUNTS = "bench:counts:"


@shared_task(name="bench.bare_count", ignore_result=True)
def bare_count(key: str, *args: Any) -> None:
    """Bare Celery, no result backend: one Redis INCR."""
    bench_redis().incr(COUNTS + key)


@job(name="bench.count")
def tracked_count(key: str, *args: Any) -> None:
    """Backlot with the ledger: the same INCR."""
    bench_redis().incr(COUNTS + key)
