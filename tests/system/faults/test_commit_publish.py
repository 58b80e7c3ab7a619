"""Fault 5: the enqueuing process dies between the database commit and the publish."""

from __future__ import annotations

import time

from jobs.models import Job, JobState
from tests.system.faults.conftest import applied, dead_letters, figures, runs, states, wait_finished

JOBS, PUBLISHED = 20, 10


def test_process_killed_between_commit_and_publish_the_relay_sends_the_rest(
    private_redis, start_fault_worker, client_procs, run_id
):
    """A process enqueues 20 jobs in one transaction and dies (os._exit in an on-commit hook)
    after the commit, once 10 of the 20 publish hooks ran; then a worker and the relay run.

    Pass figures: 20 rows committed, 10 published and 10 messages in Redis at the crash; after
    recovery 20/20 succeeded, each run exactly once, 20 effects, 0 duplicates, 0 dead letters,
    the 10 orphans published by the relay; within 60 s.
    """
    began = time.monotonic()
    crash = client_procs.run_raw(
        "die", task="effect", run=run_id, start=0, count=JOBS, published=PUBLISHED
    )
    assert crash.returncode == 17, crash.stderr[-3000:]
    ids = [
        str(i)
        for i in Job.objects.filter(task_name="faults.effect", kwargs__run=run_id).values_list(
            "id", flat=True
        )
    ]
    orphans = [
        str(i)
        for i in Job.objects.filter(id__in=ids, published_at__isnull=True).values_list(
            "id", flat=True
        )
    ]
    in_redis = private_redis.queue_depth()

    # when
    start_fault_worker("orphans", concurrency=2)
    client_procs.start_relay()

    # then
    recovered = wait_finished(ids, timeout=60, what="jobs of the crashed process")
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    relayed = Job.objects.filter(id__in=orphans, published_at__isnull=False).count()
    figures(
        f"crash between commit and publish: {len(ids)} committed, "
        f"{len(ids) - len(orphans)} published, "
        f"{in_redis} in Redis at the crash; {counts[JobState.SUCCEEDED]}/{JOBS} succeeded, "
        f"{relayed}/{len(orphans)} orphans published by the relay, "
        f"runs per job {sorted(set(started.values()))}, "
        f"{len(effects)} effects, {dead_letters(ids)} dead letters, "
        f"recovered in {recovered:.1f} s, "
        f"{time.monotonic() - began:.1f} s"
    )
    assert len(ids) == JOBS and len(orphans) == JOBS - PUBLISHED and in_redis == PUBLISHED
    assert counts[JobState.SUCCEEDED] == JOBS, dict(counts)
    assert relayed == len(orphans)
    assert len(started) == JOBS and set(started.values()) == {1}, "a job ran twice"
    assert len(effects) == JOBS and max(effects.values()) == 1
    assert dead_letters(ids) == 0
