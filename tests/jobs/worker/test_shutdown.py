"""SIGTERM: an idle worker stops at once; the soft shutdown waits only while a job runs."""

from __future__ import annotations

import signal
import time

from config.celery import app
from jobs import enqueue_many
from jobs.broker.queues import queue_depths, unacknowledged
from jobs.models import DeadLetter, Job, JobState
from jobs.testing import Worker as PlatformWorker
from tests.conftest import LOG_DIR, ROOT, marks, wait_until
from tests.support.shutdown_tasks import fails_late
from tests.support.tasks import add, slow_once


def test_an_idle_worker_stops_at_once_on_sigterm(start_worker):
    # given: an idle worker with the platform's 30 s soft shutdown
    assert app.conf.worker_soft_shutdown_timeout == 30.0
    worker = start_worker("idle-stop", queues="default", concurrency=1)

    # when
    worker.process.send_signal(signal.SIGTERM)
    termed = time.monotonic()
    code = worker.process.wait(timeout=25)

    # then: it exits cleanly well before the soft shutdown's timeout
    took = time.monotonic() - termed
    assert code == 0
    assert took < 10, f"an idle worker took {took:.1f} s to stop"
    assert "Initiating Soft Shutdown" not in worker.output()


JOB_SECONDS = 3.0


def waiting_on(worker: PlatformWorker, *job_ids: str) -> bool:
    """Whether the worker's main process lists these jobs as running (remote control's
    `active`): it took in their start and answered from its event loop, which is back in its
    wait, where the soft shutdown reads the pool's results (jobs.worker.shutdown puts off a
    signal that lands elsewhere: test_a_busy_worker_stops_when_its_running_job_ends)."""
    replies = app.control.inspect(destination=[worker.name], timeout=1).active() or {}
    running = {task["id"] for tasks in replies.values() for task in tasks}
    return set(job_ids) <= running


def terminated(worker: PlatformWorker) -> tuple[int, float]:
    """SIGTERM to the worker: its exit code, and the seconds it took to exit."""
    worker.process.send_signal(signal.SIGTERM)
    termed = time.monotonic()
    code = worker.process.wait(timeout=60)
    return code, time.monotonic() - termed


def test_a_worker_stops_when_its_running_job_ends(start_worker, clean_redis, transactional_db):
    # given: a worker running a job that needs JOB_SECONDS more when SIGTERM comes
    worker = start_worker("soft-stop", queues="reports", concurrency=1)
    handle = slow_once.using(queue="reports").enqueue("soft-stop", JOB_SECONDS)
    wait_until(lambda: marks("soft-stop"), timeout=30, what="the job to start")
    wait_until(lambda: waiting_on(worker, handle.id), timeout=30, what="the worker to wait on it")

    # when
    code, took = terminated(worker)

    # then: the job ran to its end, and the worker stopped then, not after the 30 s timeout
    job = Job.objects.get(id=handle.id)
    assert (job.state, job.attempts) == (JobState.SUCCEEDED, 1), worker.output()[-3000:]
    assert code == 0
    assert took < JOB_SECONDS + 7, (
        f"the worker took {took:.1f} s to stop after a {JOB_SECONDS} s job"
    )
    # ... with its message acknowledged: nothing left in Redis to run it again
    assert unacknowledged() == 0 and queue_depths(["reports"]) == {"reports": 0}


SHORT_JOBS = 3000


def test_a_busy_worker_stops_when_its_running_job_ends(start_worker, clean_redis, transactional_db):
    # given: a worker whose event loop is busy with short jobs (its second process runs them)
    # while a job needing JOB_SECONDS runs: a SIGTERM then lands mostly outside the loop's poll,
    # where the soft shutdown cannot read results (jobs.worker.shutdown puts it off till the poll)
    worker = start_worker("busy-stop", queues="reports", concurrency=2)
    handle = slow_once.using(queue="reports").enqueue("busy-stop", JOB_SECONDS)
    wait_until(lambda: marks("busy-stop"), timeout=30, what="the long job to start")
    short = enqueue_many(add, [((i, 1), {}) for i in range(SHORT_JOBS)], queue="reports")
    wait_until(
        lambda: Job.objects.filter(id__in=short[:1000], state=JobState.SUCCEEDED).count() >= 50,
        timeout=30,
        what="short jobs to run",
    )

    # when
    code, took = terminated(worker)

    # then: the long job ran once, to its end, and the worker stopped then, not after 30 s
    job = Job.objects.get(id=handle.id)
    assert (job.state, job.attempts) == (JobState.SUCCEEDED, 1), worker.output()[-3000:]
    assert code == 0
    assert took < JOB_SECONDS + 7, f"the worker took {took:.1f} s to stop"
    # ... every short job either ran once or is back in its queue, none held or run twice
    ran = Job.objects.filter(id__in=short, state=JobState.SUCCEEDED)
    assert not ran.filter(attempts__gt=1).exists()
    assert unacknowledged() == 0
    assert ran.count() + queue_depths(["reports"])["reports"] == SHORT_JOBS


def test_the_soft_shutdown_waits_for_the_last_running_job_and_records_each(
    worker_env, clean_redis, transactional_db
):
    # given: two jobs running when SIGTERM comes, one failing after 1 s, one ending after 3 s
    worker = PlatformWorker(
        "config",
        queues="reports",
        concurrency=2,
        name="soft-two",
        env=worker_env,
        cwd=ROOT,
        log_dir=LOG_DIR,
        extra_args=["-I", "tests.support.tasks,tests.support.shutdown_tasks",
                    "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"],
    )  # fmt: skip
    try:
        failing = fails_late.enqueue("soft-two", 1.0)
        slow = slow_once.using(queue="reports").enqueue("soft-two", JOB_SECONDS)
        wait_until(lambda: len(marks("soft-two")) == 2, timeout=30, what="both jobs to start")
        # (the failing job may have ended by then: its 1 s is not waited for)
        wait_until(lambda: waiting_on(worker, slow.id), timeout=30, what="the worker to wait")

        # when
        code, took = terminated(worker)
    finally:
        worker.stop()

    # then: it stopped when the longer job ended, each outcome recorded and acknowledged
    assert (slow.job().state, slow.job().attempts) == (JobState.SUCCEEDED, 1)
    assert (failing.job().state, failing.job().attempts) == (JobState.DEAD, 1)
    assert DeadLetter.objects.filter(job_id_value=failing.id).count() == 1
    assert code == 0, worker.output()[-3000:]
    assert took < JOB_SECONDS + 7, f"the worker took {took:.1f} s to stop"
    assert unacknowledged() == 0 and queue_depths(["reports"]) == {"reports": 0}
