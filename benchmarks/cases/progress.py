"""Case 9: a job calling self.progress in a tight loop of 100,000 steps vs the same loop
without it: UPDATEs of the ledger table and the loop's run time.

UPDATEs are counted by PostgreSQL (pg_stat_user_tables.n_tup_upd of jobs_job) around each
job. A backend reports its counts when it exits, so this case's worker runs with
DB_CONN_MAX_AGE=0 (Django closes the connection after each job; the progress timer thread
closes its own), and this process closes its connection after enqueueing. The loop's run
time is measured inside the job.
"""

from __future__ import annotations

import time
import uuid

import psycopg
from django.conf import settings
from django.db import connection

from benchmarks import jobs as bench
from benchmarks.harness import CaseResult, Workers, empty_queues, wait_stamp, wait_until
from benchmarks.sizes import SIZES
from jobs.models import Job, JobState

# The slow variant's work per step: 100,000 steps then take about 3 s, long enough for the
# throttle's steady state (one write per BACKLOT['PROGRESS_INTERVAL']) to show.
SLOW_WORK_US = 30.0


def updates_of_job_table() -> int:
    db = settings.DATABASES["default"]
    with psycopg.connect(
        host=db["HOST"],
        port=db["PORT"],
        user=db["USER"],
        dbname=db["NAME"],
        password=db["PASSWORD"] or None,
        autocommit=True,
    ) as conn:
        row = conn.execute(
            "select n_tup_upd from pg_stat_user_tables where relname = 'jobs_job'"
        ).fetchone()
    return int(row[0]) if row else 0


def settled_updates(timeout: float = 10) -> int:
    """n_tup_upd once it stopped moving (backends flush their counts as they exit)."""
    deadline = time.monotonic() + timeout
    last = updates_of_job_table()
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = updates_of_job_table()
        if now == last:
            return now
        last = now
    return last


def run(*, full: bool = False) -> CaseResult:
    size = SIZES["progress"]
    steps = size.count(full)
    interval = settings.BACKLOT["PROGRESS_INTERVAL"]
    result = CaseResult(
        case="progress",
        title=f"9. Progress: self.progress in a loop of {steps:,} steps "
        "vs the bare loop (PostgreSQL)",
        params={"steps": steps, "rounds": size.repeats, "progress_interval_s": interval},
    )
    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise RuntimeError("the progress case counts UPDATEs with PostgreSQL's statistics")
    # variant -> (report progress?, microseconds of work per step)
    variants = {
        "with_progress": (True, 0.0),
        "without": (False, 0.0),
        "slow_with_progress": (True, SLOW_WORK_US),
    }
    empty_queues()
    runs: dict[str, list[float]] = {name: [] for name in variants}
    updates: dict[str, list[int]] = {name: [] for name in variants}
    with Workers() as workers:
        workers.start("progress", concurrency=2, env={"DB_CONN_MAX_AGE": "0"}).wait_ready()
        for round_no in range(size.repeats + 1):  # round 0 warms up
            names = list(variants) if round_no % 2 == 0 else list(reversed(variants))
            for name in names:
                report, work_us = variants[name]
                if round_no == 0 and work_us:
                    continue
                key = f"progress-{uuid.uuid4().hex[:8]}"
                before = settled_updates()
                handle = bench.progress_loop.enqueue(key, steps, report, work_us)
                connection.close()
                popped = wait_stamp(key, 120)
                if popped is None:
                    raise TimeoutError(f"{name}: the progress job did not finish")

                def succeeded(job_id: str = handle.id) -> bool:
                    return Job.objects.filter(id=job_id, state=JobState.SUCCEEDED).exists()

                wait_until(succeeded, 30, what="the job to succeed")
                connection.close()
                after = settled_updates()
                if round_no:
                    runs[name].append(popped)
                    updates[name].append(after - before)
    baseline = sorted(updates["without"])[len(updates["without"]) // 2]
    result.figure(
        "loop with progress",
        runs["with_progress"],
        "s",
        higher_is_better=False,
        what=f"{steps:,} x self.progress(step, total)",
    )
    result.figure(
        "loop without", runs["without"], "s", higher_is_better=False, what="the same loop, no call"
    )
    result.figure(
        "cost per progress call",
        [
            (a - b) / steps * 1e6
            for a, b in zip(runs["with_progress"], runs["without"], strict=True)
        ],
        "µs",
        higher_is_better=False,
    )
    result.figure(
        "UPDATEs, job without",
        updates["without"],
        "rows",
        higher_is_better=False,
        what="n_tup_upd of jobs_job over the whole job: enqueue, claim, finish",
    )
    worst = 0.0
    for name, label in (("with_progress", "tight loop"), ("slow_with_progress", "slow loop")):
        writes = [u - baseline for u in updates[name]]
        result.figure(
            f"progress writes, {label}",
            writes,
            "rows",
            higher_is_better=False,
            what="UPDATEs of the job minus those of the job without progress",
        )
        # A job shorter than a second still gets its first and its final write.
        per_second = [w / max(r, 1.0) for w, r in zip(writes, runs[name], strict=True)]
        result.figure(
            f"progress writes/s, {label}",
            per_second,
            "writes/s",
            higher_is_better=False,
            what="writes / max(run time, 1 s)",
        )
        worst = max(worst, *per_second)
    result.figure(
        "slow loop run time",
        runs["slow_with_progress"],
        "s",
        higher_is_better=False,
        what=f"{steps:,} steps of {SLOW_WORK_US:.0f} µs work each, with progress",
    )
    result.target("progress writes per second per job (worst round)", worst, "<= 2", worst <= 2)
    return result
