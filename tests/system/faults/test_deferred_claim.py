"""DEFER_CLAIM (jobs.ledger.deferred, jobs.broker.running): a short job writes its ledger row
once, at its finish, on a `-P solo` worker; a job that outlives the first third of its lease
writes its claim then; the status API, the jobs list and AsyncResult say running from the run's
Redis record while the row is not written yet; a run that vanished unclaimed is counted as a
worker crash and runs again. The clients enqueue with DEFER_CLAIM too, so that a first delivery
runs without reading its row (jobs.broker.running.fresh); a cancel before it still wins.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery.result import AsyncResult
from django.conf import settings
from django.db import connection
from django.test import override_settings

import jobs
from config.celery import app as celery_app
from jobs.broker import running
from jobs.broker.redis import redis_client
from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.system.faults.conftest import Client, runs, states, wait_finished

UPDATES = "faults_job_updates"


def succeeded_after(
    job_id: str, run_id: str, *, attempts: int, crashes: int, what: str, timeout: float = 60
) -> Job:
    """Wait for the job to finish; it succeeded on attempt `attempts` with `crashes` crashes,
    its code ran once per attempt."""
    wait_finished([job_id], timeout=timeout, what=what)
    job = Job.objects.get(id=job_id)
    assert (job.state, job.attempts, job.crashes) == (JobState.SUCCEEDED, attempts, crashes)
    assert runs(run_id) == Counter({0: attempts})
    return job


def run_records(private_redis: Any, ids: list[str]) -> int:
    """How many of these jobs' runs have a record in Redis (jobs.broker.running)."""
    return sum(private_redis.client.exists(f"{running.PREFIX}{i}") for i in ids)


@pytest.fixture
def client_procs(fault_env: dict[str, str], start_fault_worker: Any) -> Iterator[Client]:
    """Client processes that enqueue with DEFER_CLAIM: their messages are stamped `born`."""
    client = Client({**fault_env, "BACKLOT_DEFER_CLAIM": "1"})
    yield client
    client.close()


@pytest.fixture
def updates_per_job(transactional_db: None) -> Iterator[Callable[[list[str]], Counter]]:
    """Every UPDATE of a jobs_job row, counted per job by a trigger of the test's own."""
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE IF NOT EXISTS {UPDATES} (job_id uuid)")
        cursor.execute(f"TRUNCATE {UPDATES}")
        cursor.execute(
            "CREATE OR REPLACE FUNCTION faults_count_update() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN INSERT INTO {UPDATES} VALUES (NEW.id); "
            "RETURN NULL; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER faults_count_update AFTER UPDATE ON jobs_job FOR EACH ROW "
            "EXECUTE FUNCTION faults_count_update()"
        )

    def counted(ids: list[str]) -> Counter:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT job_id::text, count(*) FROM {UPDATES} WHERE job_id::text = ANY(%s) "
                "GROUP BY job_id",
                [ids],
            )
            return Counter(dict(cursor.fetchall()))

    try:
        yield counted
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER IF EXISTS faults_count_update ON jobs_job")
            cursor.execute("DROP FUNCTION IF EXISTS faults_count_update()")
            cursor.execute(f"DROP TABLE IF EXISTS {UPDATES}")


@pytest.mark.parametrize(
    ("pool", "defer", "writes"),
    [("solo", "1", 1), ("solo", "0", 2), ("prefork", "1", 1)],
    ids=["deferred", "claimed", "prefork"],
)
def test_a_short_job_writes_its_row_once_with_the_claim_deferred(
    pool, defer, writes, private_redis, start_fault_worker, client_procs, run_id, updates_per_job
):
    # given a solo worker, with the claim deferred or not, or a prefork one deferring it
    start_fault_worker("deferred", pool=pool, concurrency=1, BACKLOT_DEFER_CLAIM=defer)

    # when short jobs run
    ids = client_procs.enqueue("quick", run_id, 12)
    wait_finished(ids, timeout=60, what="the short jobs")

    # then each ran once and succeeded on its first attempt, with its start, end and result,
    # and its row was written once after its INSERT (twice when the run writes its claim)
    assert runs(run_id) == Counter(dict.fromkeys(range(12), 1))
    for item, job in enumerate(Job.objects.filter(id__in=ids).order_by("enqueued_at", "id")):
        assert job.state == JobState.SUCCEEDED, job.state
        assert (job.attempts, job.deliveries, job.crashes) == (1, 1, 0)
        assert job.started_at is not None and job.finished_at is not None
        assert job.started_at <= job.finished_at
        assert job.result == item and job.lease_expires_at is None
    assert updates_per_job(ids) == Counter(dict.fromkeys(ids, writes))
    # and once their messages are acknowledged, Redis keeps nothing of their runs
    wait_until(
        lambda: private_redis.unacked() == 0 and run_records(private_redis, ids) == 0,
        timeout=10,
        interval=0.05,
        what="the acknowledgements and their runs' records to go",
    )


def test_a_job_that_outlives_its_first_interval_writes_its_claim_then(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a solo worker deferring claims, with 6 s leases (the first renewal at 2 s)
    start_fault_worker(
        "deferred-long",
        pool="solo",
        concurrency=1,
        BACKLOT_DEFER_CLAIM="1",
        BACKLOT_LEASE_SECONDS="6",
    )

    # when a job runs for 8 s
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 8})

    # then its row says running, under a lease, while it runs; and it succeeds once
    wait_until(
        lambda: Job.objects.filter(
            id=job_id, state=JobState.RUNNING, lease_expires_at__isnull=False
        ).exists(),
        timeout=30,
        interval=0.2,
        what="the long job's claim to be written",
    )
    succeeded_after(job_id, run_id, attempts=1, crashes=0, what="the long job")


def test_the_status_api_says_running_before_the_row_is_written(
    private_redis, start_fault_worker, client_procs, run_id, admin_client, monkeypatch
):
    # given a solo worker deferring claims (30 s leases: the claim would be written at 10 s),
    # and a caller whose task tracks its start (Celery's track_started)
    start_fault_worker("deferred-status", pool="solo", concurrency=1, BACKLOT_DEFER_CLAIM="1")
    backlot = {**settings.BACKLOT, "REDIS_URL": private_redis.url, "DEFER_CLAIM": True}
    monkeypatch.setattr(celery_app.tasks["faults.quick"], "track_started", True)

    def seen(job_id: str) -> tuple[str, str, str]:
        """The job's state as its status, its item in the jobs list and AsyncResult say."""
        (item,) = [
            i for i in admin_client.get("/api/jobs/").json()["items"] if i["job_id"] == job_id
        ]
        status = admin_client.get(f"/api/jobs/{job_id}/").json()["state"]
        return status, item["state"], AsyncResult(job_id, app=celery_app).state

    # when a job runs for 4 s
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 4})
    with override_settings(REDIS_URL=private_redis.url, BACKLOT=backlot):
        redis_client.cache_clear()
        try:
            # then its status, its list item and its AsyncResult say it runs while it runs,
            # though its row still waits
            wait_until(
                lambda: seen(job_id)[0] == JobState.RUNNING,
                timeout=30,
                interval=0.1,
                what="the job's status to say running",
            )
            assert seen(job_id)[1:] == (JobState.RUNNING, "STARTED")
            assert Job.objects.get(id=job_id).state == JobState.QUEUED
            wait_finished([job_id], timeout=60, what="the job")
            assert seen(job_id) == (JobState.SUCCEEDED, JobState.SUCCEEDED, "SUCCESS")
        finally:
            redis_client.cache_clear()


def test_a_worker_killed_in_an_unclaimed_run_counts_a_crash_and_the_job_runs_again(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a solo worker deferring claims (9 s leases: the claim would be written at 3 s)
    lease = {"BACKLOT_DEFER_CLAIM": "1", "BACKLOT_LEASE_SECONDS": "9"}
    first = start_fault_worker("deferred-kill", pool="solo", concurrency=1, **lease)
    client_procs.start_relay()

    # when the worker is killed while a job's first run has not written its claim
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 60})
    wait_until(lambda: runs(run_id)[0] == 1, timeout=30, interval=0.05, what="the run to start")
    first.kill()
    assert Job.objects.get(id=job_id).state == JobState.QUEUED  # nothing written by the run
    start_fault_worker("deferred-next", pool="solo", concurrency=1, **lease)

    # then the job runs again and succeeds, with the lost run counted as a worker crash
    succeeded_after(
        job_id, run_id, attempts=2, crashes=1, what="the job after the kill", timeout=120
    )


def test_a_pool_process_killed_in_an_unclaimed_run_counts_a_crash_and_the_job_runs_again(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a prefork worker deferring claims (9 s leases: the claim would be written at 3 s),
    # and no relay: its own main process must record the lost run
    lease = {"BACKLOT_DEFER_CLAIM": "1", "BACKLOT_LEASE_SECONDS": "9"}
    worker = start_fault_worker("deferred-pool-kill", pool="prefork", concurrency=1, **lease)

    # when its pool process is killed while a job's first run has not written its claim
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 60})
    wait_until(lambda: runs(run_id)[0] == 1, timeout=30, interval=0.05, what="the run to start")
    assert Job.objects.get(id=job_id).state == JobState.QUEUED  # nothing written by the run
    (pid,) = worker.pool_pids()
    os.kill(pid, signal.SIGKILL)

    # then the job runs again on the worker's new pool process and succeeds, with the lost run
    # counted as a worker crash
    succeeded_after(job_id, run_id, attempts=2, crashes=1, what="the job after the kill")


def test_a_stopped_pool_processs_unclaimed_run_is_taken_over_once_its_lease_lapses(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a prefork worker deferring claims, with 3 s leases (the claim would be written at
    # 1 s), and the relay
    lease = {"BACKLOT_DEFER_CLAIM": "1", "BACKLOT_LEASE_SECONDS": "3"}
    first = start_fault_worker("deferred-pool-stop", pool="prefork", concurrency=1, **lease)
    client_procs.start_relay(interval=0.5)

    # when its pool process stops (SIGSTOP) before the job's run wrote its claim, while its
    # main process goes on, and another worker is started
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 60})
    wait_until(lambda: runs(run_id)[0] == 1, timeout=30, interval=0.02, what="the run to start")
    (pid,) = first.pool_pids()
    os.kill(pid, signal.SIGSTOP)
    try:
        assert Job.objects.get(id=job_id).state == JobState.QUEUED  # nothing written by the run
        start_fault_worker("deferred-pool-next", pool="prefork", concurrency=1, **lease)

        # then the first worker's main process writes the run's claim under its lapsed lease,
        # the relay sends the job again, and the other worker runs it to its success, with the
        # stopped run counted as a crash
        succeeded_after(job_id, run_id, attempts=2, crashes=1, what="the job taken over")
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_second_delivery_during_an_unclaimed_run_is_dropped(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a solo worker deferring claims, running a job for 6 s without writing its claim
    lease = {"BACKLOT_DEFER_CLAIM": "1"}
    first = start_fault_worker("deferred-first", pool="solo", concurrency=1, **lease)
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 6})
    wait_until(lambda: runs(run_id)[0] == 1, timeout=30, interval=0.05, what="the run to start")
    assert Job.objects.get(id=job_id).state == JobState.QUEUED

    # when a copy of its message reaches a second worker meanwhile (a duplicate, as a restore
    # or a re-send racing the run would make)
    second = start_fault_worker("deferred-second", pool="solo", concurrency=1, **lease)
    first.probe.send_task(
        "faults.quick",
        kwargs={"run": run_id, "item": 0, "seconds": 6},
        task_id=job_id,
        queue="default",
    )
    wait_until(
        lambda: "duplicate" in second.log_path.read_text(errors="replace") or runs(run_id)[0] > 1,
        timeout=30,
        interval=0.1,
        what="the second worker to take the copy",
    )

    # then the copy did not run: the job ran once and succeeded on its first attempt
    succeeded_after(job_id, run_id, attempts=1, crashes=0, what="the job")


def test_a_cancel_during_an_unclaimed_run_stops_it_at_its_first_claim_write(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a solo worker deferring claims (6 s leases: its first claim write at 2 s), running
    # a job for 60 s that has not written its claim
    start_fault_worker(
        "deferred-cancel",
        pool="solo",
        concurrency=1,
        BACKLOT_DEFER_CLAIM="1",
        BACKLOT_LEASE_SECONDS="6",
    )
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"seconds": 60})
    wait_until(lambda: runs(run_id)[0] == 1, timeout=30, interval=0.05, what="the run to start")

    # when it is cancelled
    cancellation = jobs.cancel(job_id)

    # then it reads cancelled at once, its run is stopped (the worker runs the next job long
    # before the first one's 60 s), and nothing of the run is written over the cancellation
    assert cancellation.state == JobState.CANCELLED
    (next_id,) = client_procs.enqueue("quick", run_id, 1, start=1)
    wait_finished([next_id], timeout=40, what="the job after the cancelled one")
    job = Job.objects.get(id=job_id)
    assert job.state == JobState.CANCELLED and job.result is None and job.run_seconds is None
    assert runs(run_id) == Counter({0: 1, 1: 1})


def test_a_job_cancelled_while_its_fresh_message_waits_never_runs(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a job whose fresh first message waits, no worker running yet
    (job_id,) = client_procs.enqueue("quick", run_id, 1)

    # when it is cancelled, and then a solo worker deferring claims starts
    assert client_procs.run("cancel", job_id=job_id)["state"] == JobState.CANCELLED
    start_fault_worker("deferred-cancelled", pool="solo", concurrency=1, BACKLOT_DEFER_CLAIM="1")

    # then the job never runs (the worker runs the job enqueued after it) and stays cancelled
    (next_id,) = client_procs.enqueue("quick", run_id, 1, start=1)
    wait_finished([next_id], timeout=40, what="the job after the cancelled one")
    assert runs(run_id) == Counter({1: 1})
    assert Job.objects.get(id=job_id).state == JobState.CANCELLED


def test_a_retried_job_fails_then_succeeds_with_the_claim_deferred(
    private_redis, start_fault_worker, client_procs, run_id
):
    # given a solo worker deferring claims
    start_fault_worker("deferred-retry", pool="solo", concurrency=1, BACKLOT_DEFER_CLAIM="1")

    # when a job fails its first run (a retryable error) and is retried
    (job_id,) = client_procs.enqueue("quick", run_id, 1, kwargs={"fail": True})

    # then its second run, delivered to a retrying row that is due, succeeds
    job = succeeded_after(job_id, run_id, attempts=2, crashes=0, what="the retried job")
    assert [failure["attempt"] for failure in job.failures] == [1]


# --- a solo worker's successes, written together (jobs.worker.finishes) ----------------------

# Successes wait until this many do, or 600 s: longer than any of these tests.
WAITING = {"BACKLOT_SUCCESS_BATCH": "4", "BACKLOT_SUCCESS_BATCH_SECONDS": "600"}


def wait_succeeded_lines(worker: Any, count: int) -> None:
    """Until the worker logged `count` successes (the log line follows the success's hand-off
    to the batch, jobs.worker.outcomes.succeeded)."""
    wait_until(
        lambda: worker.output().count("job succeeded id=") >= count,
        timeout=30,
        interval=0.05,
        what=f"{count} successes in the worker's log",
    )


POOLS = pytest.mark.parametrize("pool", ["solo", "prefork"])


@POOLS
def test_a_workers_successes_are_written_together_and_their_messages_acked_then(
    pool, private_redis, start_fault_worker, client_procs, run_id, updates_per_job, admin_client
):
    # given a worker that writes its short successes four at a time: a solo worker, or a
    # prefork one whose pool processes hand theirs back to its main process
    worker = start_fault_worker(
        "batch", pool=pool, concurrency=2, BACKLOT_DEFER_CLAIM="1", **WAITING
    )
    backlot = {**settings.BACKLOT, "REDIS_URL": private_redis.url, "DEFER_CLAIM": True}

    # when three short jobs succeed
    ids = client_procs.enqueue("quick", run_id, 3)
    wait_succeeded_lines(worker, 3)

    # then their rows still wait, their status says running (their runs' records), and their
    # messages are held (unacknowledged) until the successes are written
    assert run_records(private_redis, ids) == 3
    with override_settings(REDIS_URL=private_redis.url, BACKLOT=backlot):
        redis_client.cache_clear()
        try:
            assert [admin_client.get(f"/api/jobs/{i}/").json()["state"] for i in ids] == [
                JobState.RUNNING
            ] * 3
        finally:
            redis_client.cache_clear()
    assert states(ids) == Counter({JobState.QUEUED: 3})
    assert private_redis.unacked() == 3

    # when a fourth succeeds
    ids += client_procs.enqueue("quick", run_id, 1, start=3)

    # then the four rows are written, once each, and the four messages acknowledged
    wait_finished(ids, timeout=30, what="the four jobs")
    wait_until(lambda: private_redis.unacked() == 0, timeout=10, interval=0.05, what="the acks")
    assert run_records(private_redis, ids) == 0  # their records went with the acks
    assert runs(run_id) == Counter(dict.fromkeys(range(4), 1))
    assert updates_per_job(ids) == Counter(dict.fromkeys(ids, 1))
    rows = {str(j.id): j for j in Job.objects.filter(id__in=ids)}
    for item, job_id in enumerate(ids):
        job = rows[job_id]
        assert (job.state, job.attempts, job.result) == (JobState.SUCCEEDED, 1, item)
    # each row's finish is its run's end, not the write's: the first ended before the last began
    first_end, last_start = rows[ids[0]].finished_at, rows[ids[3]].started_at
    assert first_end is not None and last_start is not None and first_end < last_start


@POOLS
def test_a_warm_shutdown_writes_the_waiting_successes_before_it_stops(
    pool, private_redis, start_fault_worker, client_procs, run_id
):
    # given a worker holding three successes it has not written
    worker = start_fault_worker(
        "batch-stop", pool=pool, concurrency=2, BACKLOT_DEFER_CLAIM="1", **WAITING
    )
    ids = client_procs.enqueue("quick", run_id, 3)
    wait_succeeded_lines(worker, 3)
    assert states(ids) == Counter({JobState.QUEUED: 3})

    # when it is stopped (SIGTERM: a deploy)
    worker.stop()
    assert worker.process.returncode == 0, worker.output()[-3000:]

    # then it wrote them and acknowledged their messages first: nothing runs again
    assert states(ids) == Counter({JobState.SUCCEEDED: 3})
    assert private_redis.unacked() == 0 and private_redis.queue_depth() == 0
    assert runs(run_id) == Counter(dict.fromkeys(range(3), 1))


@POOLS
def test_a_worker_killed_with_successes_unwritten_runs_their_jobs_again(
    pool, private_redis, start_fault_worker, client_procs, run_id
):
    # given a worker holding two successes it has not written (3 s leases: their run records
    # lapse soon), and the relay
    lease = {"BACKLOT_DEFER_CLAIM": "1", "BACKLOT_LEASE_SECONDS": "3"}
    first = start_fault_worker("batch-kill", pool=pool, concurrency=2, **lease, **WAITING)
    client_procs.start_relay()
    ids = client_procs.enqueue("quick", run_id, 2)
    wait_succeeded_lines(first, 2)

    # when it is killed (kill -9: the host lost)
    first.kill()
    assert states(ids) == Counter({JobState.QUEUED: 2})  # nothing was written
    start_fault_worker("batch-next", pool="solo", concurrency=1, **lease)

    # then no job is lost: their messages were still unacknowledged, so each job runs again
    # and succeeds, the lost run counted as a worker crash (at least once, as for any run
    # that died before its end)
    wait_finished(ids, timeout=120, what="the jobs after the kill")
    assert runs(run_id) == Counter(dict.fromkeys(range(2), 2))
    for job in Job.objects.filter(id__in=ids):
        assert (job.state, job.attempts, job.crashes) == (JobState.SUCCEEDED, 2, 1)
