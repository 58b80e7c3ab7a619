"""Case 7: a 50/s cluster-wide rate limit across 4 worker processes, and one acquire's cost.

4 workers with one pool process each (4 independent consumers asking the same bucket) drain
a backlog of rate-limited jobs (ledger on); each job stamps its start. The achieved rate is
(jobs - 1) / (last start - first start); the error is its distance from 50/s. The busiest
1-second window (most starts in any second) must stay within the limit + 10 %, and the
messages re-published for a slot (jobs.broker.gate_counts.RESENDS) below 1.5 per job.
"""

from __future__ import annotations

import time
import uuid

from django.db import connection, transaction

from benchmarks import jobs as bench
from benchmarks.harness import (
    CaseResult,
    Workers,
    empty_queues,
    pause,
    percentile,
    redis_client,
    resume,
    take_stamps,
    wait_until,
)
from benchmarks.sizes import SIZES
from jobs import enqueue_many as job_enqueue_many
from jobs.broker.ratelimit import RateLimiter, parse_rate

PROCESSES = 4


def run(*, full: bool = False) -> CaseResult:
    size, acquire_size = SIZES["ratelimit"], SIZES["acquire"]
    seconds = size.count(full)
    rate = 1 / parse_rate(bench.BENCH_RATE)
    jobs = int(seconds * rate)
    result = CaseResult(
        case="ratelimit",
        title=f"7. Rate limiter: {bench.BENCH_RATE} cluster-wide, "
        f"{PROCESSES} worker processes; acquire cost",
        params={
            "limit_per_s": rate,
            "seconds_of_load": seconds,
            "jobs_per_round": jobs,
            "workers": f"{PROCESSES} x celery worker -c 1",
            "rounds": size.repeats,
        },
    )
    if seconds != size.issue:
        result.notes.append(f"scaled: {seconds} s of load per round instead of {size.issue} s")
    achieved, errors, worst_second, resent = [], [], [], []
    empty_queues()
    with Workers() as workers:
        group = [workers.start(f"rate{i}", concurrency=1) for i in range(PROCESSES)]
        for worker in group:
            worker.wait_ready()
        pause(group)
        for _ in range(size.repeats):
            key = f"rate-{uuid.uuid4().hex[:8]}"
            RateLimiter().reset(bench.rate_limited.name)
            before = _rate_limited_count()
            for start in range(0, jobs, 1000):
                with transaction.atomic():
                    job_enqueue_many(
                        task=bench.rate_limited,
                        calls=[((key,), {}) for _ in range(start, min(jobs, start + 1000))],
                    )
            connection.close()
            resume(group)

            def all_stamped(key: str = key) -> bool:
                return redis_client().llen(bench.STAMPS + key) >= jobs

            wait_until(
                all_stamped,
                seconds * 3 + 60,
                interval=0.2,
                what="the rate-limited jobs",
            )
            pause(group)
            stamps = sorted(take_stamps(key))
            span = stamps[-1] - stamps[0]
            got = (len(stamps) - 1) / span
            achieved.append(got)
            errors.append((got - rate) / rate * 100)
            worst_second.append(max(_in_window(stamps, s, 1.0) for s in stamps))
            resent.append(_rate_limited_count() - before)
    result.figure("achieved rate", achieved, "jobs/s", what=f"target {rate:.0f}/s")
    result.figure("error", errors, "%", higher_is_better=False, what="(achieved - limit) / limit")
    result.figure(
        "busiest 1 s window",
        worst_second,
        "jobs",
        higher_is_better=False,
        what=f"most job starts within any 1-second window (limit {rate:.0f})",
    )
    result.figure(
        "re-sends per job",
        [r / jobs for r in resent],
        "x",
        higher_is_better=False,
        what="messages re-published to wait for their slot, per job",
    )

    # One acquire, from this process, on a bucket that always has room.
    limiter = RateLimiter()
    name = f"bench:acquire:{uuid.uuid4().hex[:6]}"
    calls = acquire_size.count(full)
    means, p99s = [], []
    ping = []
    client = redis_client()
    for _ in range(acquire_size.repeats):
        durations = []
        for _ in range(calls):
            started = time.perf_counter()
            limiter.acquire(name, "1000000/s")
            durations.append(time.perf_counter() - started)
        means.append(sum(durations) / calls * 1e6)
        p99s.append(percentile(durations, 99) * 1e6)
        started = time.perf_counter()
        for _ in range(calls):
            client.ping()
        ping.append((time.perf_counter() - started) / calls * 1e6)
    limiter.reset(name)
    result.figure(
        "acquire mean",
        means,
        "µs",
        higher_is_better=False,
        what=f"RateLimiter.acquire, {calls:,} calls",
    )
    result.figure("acquire p99", p99s, "µs", higher_is_better=False)
    result.figure(
        "redis PING (reference)", ping, "µs", higher_is_better=False, what="one round trip to Redis"
    )
    error = result.figures["error"]
    worst = max(abs(error["min"]), abs(error["max"]))
    result.target("rate limiter error (worst round, %)", worst, "within ±5 %", worst <= 5)
    busiest = max(worst_second)
    result.target(
        "busiest 1 s window (worst round, jobs)",
        busiest,
        f"<= limit + 10 % ({rate * 1.1:.0f})",
        busiest <= rate * 1.1,
    )
    per_job = max(r / jobs for r in resent)
    result.target("re-sends per job (worst round)", per_job, "< 1.5", per_job < 1.5)
    acquire = result.figures["acquire mean"]["median"]
    result.target("one token acquire (µs)", acquire, "<= 500 µs", acquire <= 500)
    return result


def _in_window(stamps: list[float], start: float, width: float) -> int:
    return sum(1 for s in stamps if start <= s < start + width)


def _rate_limited_count() -> int:
    """Messages re-published for a slot (jobs.broker.gate_counts.RESENDS): a job parked at enqueue
    and let through by its gate is sent once, and is not counted."""
    from jobs.broker.gate_counts import RESENDS

    value = redis_client().hget(RESENDS, bench.rate_limited.name)
    return int(value or 0)
