"""Fault 3: Redis restarted (AOF everysec) with a backlog of jobs waiting."""

from __future__ import annotations

import time

from jobs.models import Job, JobState
from tests.system.faults.conftest import applied, dead_letters, figures, runs, states, wait_finished

JOBS = 5000


def test_redis_restart_keeps_a_5000_job_backlog(
    private_redis, start_fault_worker, client_procs, run_id
):
    """5,000 jobs enqueued with no worker running; Redis restarted (same port and directory,
    AOF everysec, no relay running); then a worker drains the queue.

    Pass figures: 5,000 messages in Redis before and after the restart (the AOF reload, not the
    relay, brings them back); 5,000/5,000 succeeded, 0 dead letters, 5,000 effects, 0
    duplicates, every job run once; within 240 s.
    """
    began = time.monotonic()
    ids = client_procs.enqueue("effect", run_id, JOBS, many=True)
    assert Job.objects.filter(id__in=ids, published_at__isnull=True).count() == 0
    before = private_redis.queue_depth()

    # when
    private_redis.restart()
    after = private_redis.queue_depth()
    restarted = time.monotonic()
    start_fault_worker("restart", concurrency=2)

    # then
    drained = wait_finished(ids, timeout=240, what="jobs after the restart")
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    duplicates = sum(n - 1 for n in effects.values() if n > 1)
    figures(
        f"Redis restart: {before} queued before, {after} after the AOF reload; "
        f"{counts[JobState.SUCCEEDED]}/{JOBS} succeeded, {dead_letters(ids)} dead letters, "
        f"{len(effects)} effects, {duplicates} duplicates, {sum(started.values())} runs, "
        "drained in "
        f"{drained:.1f} s ({JOBS / drained:.0f} jobs/s), {time.monotonic() - began:.1f} s"
    )
    assert before == JOBS and after == JOBS
    assert counts[JobState.SUCCEEDED] == JOBS, dict(counts)
    assert dead_letters(ids) == 0
    assert len(effects) == JOBS and duplicates == 0
    assert sum(started.values()) == JOBS
    assert time.monotonic() - restarted <= 240
