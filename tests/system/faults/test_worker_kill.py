"""Fault 1: `kill -9` a worker (main and pool processes) in the middle of its jobs."""

from __future__ import annotations

import time

from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.system.faults.conftest import (
    applied,
    dead_letters,
    figures,
    finished_count,
    running_ids,
    runs,
    states,
    wait_finished,
)

JOBS = 200


def test_kill_9_mid_run_every_job_completes_with_its_effect_once(
    private_redis, start_fault_worker, client_procs, run_id
):
    """kill -9 of a worker's whole process group while it runs 200 jobs (0.2 s each); a new
    worker and the relay take over.

    Pass figures: 200/200 succeeded, 0 dead letters, 200 effects applied, 0 duplicates; the
    jobs running at the kill ran again (attempts >= 2); done within 150 s of the kill (the
    claim lease of a vanished worker is its hard time limit, 5 s, plus 60 s).
    """
    began = time.monotonic()
    ids = client_procs.enqueue("effect", run_id, JOBS, many=True, kwargs={"seconds": 0.2})
    client_procs.start_relay()
    first = start_fault_worker("kill-a", concurrency=2)

    # when: half the jobs are done and some run, the whole worker is killed at once
    wait_until(
        lambda: finished_count(ids) >= JOBS // 2, timeout=90, interval=0.2, what="half the jobs"
    )
    # running: its row says so, or its run's Redis record does (DEFER_CLAIM)
    in_flight = wait_until(
        lambda: running_ids(private_redis.client, ids),
        timeout=10,
        interval=0.01,
        what="a running job",
    )
    first.kill()
    killed_at = time.monotonic()
    stranded = running_ids(private_redis.client, ids)
    done_at_kill = finished_count(ids)
    start_fault_worker("kill-b", concurrency=2)

    # then
    recovery = wait_finished(ids, timeout=150, what="jobs after the kill")
    counts = states(ids)
    effects = applied(run_id)
    started = runs(run_id)
    duplicates = sum(n - 1 for n in effects.values() if n > 1)
    rerun = Job.objects.filter(id__in=stranded or in_flight, attempts__gte=2).count()
    figures(
        f"kill -9 worker mid-run: {counts[JobState.SUCCEEDED]}/{JOBS} succeeded, "
        f"{dead_letters(ids)} dead letters, {len(effects)} effects, {duplicates} duplicates, "
        f"{len(stranded)} stranded by the kill at {done_at_kill}/{JOBS} done, {rerun} re-run, "
        f"{sum(started.values())} runs, recovered {recovery:.1f} s after the kill, "
        f"{time.monotonic() - began:.1f} s"
    )
    assert counts[JobState.SUCCEEDED] == JOBS, dict(counts)
    assert dead_letters(ids) == 0
    assert len(effects) == JOBS and duplicates == 0
    assert stranded, "the kill hit no running job; the test proved nothing"
    assert rerun == len(stranded), "a job running at the kill did not run again"
    assert time.monotonic() - killed_at <= 150
