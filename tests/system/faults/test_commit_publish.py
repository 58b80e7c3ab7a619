"""Fault 5: the enqueuing process dies between the database commit and the publish."""

from __future__ import annotations

import time

from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.system.faults.conftest import applied, dead_letters, figures, runs, states, wait_finished

JOBS, PUBLISHED = 20, 10
# A job its process committed and died before publishing is sent again within this many
# seconds of the crash (jobs.flow.relay: MISSING_AFTER + MISSING_EVERY + the relay's interval)
RECOVERY_BOUND = 15.0


def test_process_killed_between_commit_and_publish_the_relay_sends_the_rest(
    private_redis, start_fault_worker, client_procs, run_id
):
    """A process enqueues 20 jobs in one transaction and dies (os._exit in an on-commit hook)
    after the commit, once 10 of the 20 publish hooks ran; then a worker and the relay run.

    Each row is inserted marked published (one write per enqueue), so the 10 orphans are the
    jobs whose message is not in Redis: the relay's reconcile of messages missing from Redis
    sends them again. Pass figures: 20 rows committed, 10 messages in Redis at the crash; every
    orphan sent again (in Redis or taken by the worker) within RECOVERY_BOUND of the crash;
    after recovery 20/20 succeeded, each run exactly once, 20 effects, 0 duplicates, 0 dead
    letters; within 60 s.
    """
    began = time.monotonic()
    crash = client_procs.run_raw(
        "die", task="effect", run=run_id, start=0, count=JOBS, published=PUBLISHED
    )
    assert crash.returncode == 17, crash.stderr[-3000:]
    crashed = time.monotonic()
    ids = [
        str(i)
        for i in Job.objects.filter(task_name="faults.effect", kwargs__run=run_id).values_list(
            "id", flat=True
        )
    ]
    held = set(private_redis.queued_ids())
    orphans = [i for i in ids if i not in held]
    in_redis = private_redis.queue_depth()

    # when the relay runs
    client_procs.start_relay()

    # then: every orphan is sent again within the bound docs/reliability.md states
    def resent() -> bool:
        taken = {
            str(i)
            for i in Job.objects.filter(id__in=orphans, attempts__gt=0).values_list("id", flat=True)
        }
        waiting = set(private_redis.queued_ids())
        return all(i in taken or i in waiting for i in orphans)

    wait_until(
        resent, timeout=RECOVERY_BOUND - (time.monotonic() - crashed), interval=0.2,
        what=f"the orphans sent again within {RECOVERY_BOUND} s of the crash",
    )  # fmt: skip
    resent_after = time.monotonic() - crashed
    # and no message Redis held was sent twice: one message per job
    assert sorted(private_redis.queued_ids()) == sorted(ids)
    # and a worker
    start_fault_worker("orphans", concurrency=2)
    recovered = wait_finished(ids, timeout=60, what="jobs of the crashed process")
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    figures(
        f"crash between commit and publish: {len(ids)} committed, "
        f"{len(ids) - len(orphans)} published, "
        f"{in_redis} in Redis at the crash; {counts[JobState.SUCCEEDED]}/{JOBS} succeeded, "
        f"{len(orphans)} orphans sent again {resent_after:.1f} s after the crash, "
        f"runs per job {sorted(set(started.values()))}, "
        f"{len(effects)} effects, {dead_letters(ids)} dead letters, "
        f"recovered in {recovered:.1f} s, "
        f"{time.monotonic() - began:.1f} s"
    )
    assert len(ids) == JOBS and len(orphans) == JOBS - PUBLISHED and in_redis == PUBLISHED
    assert counts[JobState.SUCCEEDED] == JOBS, dict(counts)
    assert len(started) == JOBS and set(started.values()) == {1}, "a job ran twice"
    assert len(effects) == JOBS and max(effects.values()) == 1
    assert dead_letters(ids) == 0
