"""Issue 16's memory target: a worker's resident memory does not grow with the jobs it runs.

One worker as shipped (`-c 2` prefork, the project's settings) drains ledger-on no-op jobs in
steps; after each step (the queue and kombu's unacked hash empty) the resident set (VmRSS of
/proc/PID/status) of the main process and of each pool process is read. The figure is RSS after
all the jobs over RSS after the first 1,000, per process: the goal is at most 1.10 (no growth).
The pool processes must be the same ones throughout (no max-tasks-per-child recycling, no
crash), or the ratio would compare two processes: the case says so when they are not.
"""

from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.db import connection, transaction

from benchmarks import jobs as bench
from benchmarks.harness import CaseResult, Workers, empty_queues, pause, timed_drain
from benchmarks.sizes import Size
from jobs import enqueue_many as job_enqueue_many
from jobs.broker import timers

# Jobs drained in all (the issue: 100,000; `make bench` 20,000: ~60 s at ~350 ledger jobs/s),
# in steps: the first 1,000 are the baseline, then one reading per STEP jobs.
SIZE = Size(issue=100_000, bench=20_000, repeats=1)
BASELINE = 1_000
STEP = 5_000
CHUNK = 1_000  # rows per job_enqueue_many call, as the campaign fan-out does
GOAL = 1.10


def rss_kib(pid: int) -> int:
    """Resident set size of a process, in KiB (VmRSS: anonymous, file and shared pages)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def queue_ledger_jobs(count: int) -> None:
    for start in range(0, count, CHUNK):
        with transaction.atomic():
            job_enqueue_many(
                task=bench.noop,
                calls=[((i,), {}) for i in range(start, min(count, start + CHUNK))],
            )
    connection.close()


def run(*, full: bool = False) -> CaseResult:
    total = SIZE.count(full)
    result = CaseResult(
        case="worker_memory",
        title="Worker resident memory over a long ledger drain, one worker -c 2 (PostgreSQL)",
        params={
            "jobs": total,
            "issue_jobs": SIZE.issue,
            "baseline_jobs": BASELINE,
            "step": STEP,
            "worker": "celery -A config worker -c 2 -P prefork",
            "task": bench.noop.name,
        },
    )
    if total != SIZE.issue:
        result.notes.append(
            f"scaled: {total:,} jobs instead of {SIZE.issue:,} (15-minute budget; --full runs "
            f"{SIZE.issue:,})"
        )
    soft = settings.CELERY_TASK_SOFT_TIME_LIMIT or settings.CELERY_TASK_TIME_LIMIT
    if soft:
        result.notes.append(
            f"time limits on ({soft:,} s soft): each job's cancelled time-limit timer stays in "
            f"the event loop's heap until jobs.broker.timers purges it (every "
            f"{timers.PURGE_EVERY:g} s; see README)"
        )
    empty_queues()
    marks = [BASELINE, *range(STEP, total, STEP), total] if total > BASELINE else [total]
    readings: list[dict[str, object]] = []
    with Workers() as workers:
        worker = workers.start("memory", concurrency=2).wait_ready()
        pause([worker])
        main = worker.process.pid
        pool = sorted(worker.pool_pids())
        done = 0
        for mark in marks:
            queue_ledger_jobs(mark - done)
            timed_drain([worker], timeout=600)
            done = mark
            now_pool = sorted(worker.pool_pids())
            if now_pool != pool:
                result.notes.append(
                    f"pool processes changed after {done:,} jobs: {pool} -> {now_pool} "
                    "(recycled or crashed: their ratios compare different processes)"
                )
                pool = now_pool
            readings.append(
                {
                    "jobs": done,
                    "main_kib": rss_kib(main),
                    "pool_kib": {str(pid): rss_kib(pid) for pid in pool},
                }
            )
    result.extra["rss_readings"] = readings
    first, last = readings[0], readings[-1]
    processes = [("main", str(main), first["main_kib"], last["main_kib"])]
    first_pool, last_pool = first["pool_kib"], last["pool_kib"]
    assert isinstance(first_pool, dict) and isinstance(last_pool, dict)
    for n, pid in enumerate(sorted(last_pool, key=int), start=1):
        if pid in first_pool:
            processes.append((f"pool {n}", pid, first_pool[pid], last_pool[pid]))
    for name, pid, before, after in processes:
        assert isinstance(before, int) and isinstance(after, int)
        result.figure(
            f"{name} RSS after {first['jobs']:,}",
            [before / 1024],
            "MiB",
            higher_is_better=False,
            what=f"pid {pid}",
        )
        result.figure(
            f"{name} RSS after {last['jobs']:,}",
            [after / 1024],
            "MiB",
            higher_is_better=False,
            what=f"pid {pid}",
        )
        ratio = after / before
        result.figure(
            f"ratio {name} after {last['jobs']:,} / after {first['jobs']:,}", [ratio], "x"
        )
        result.target(
            f"worker {name} process: RSS after {last['jobs']:,} jobs / after {first['jobs']:,}",
            ratio,
            f"<= {GOAL}",
            ratio <= GOAL,
            detail=f"{before / 1024:.1f} -> {after / 1024:.1f} MiB",
        )
    return result
