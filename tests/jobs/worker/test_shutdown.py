"""SIGTERM: an idle worker stops at once; the soft shutdown waits only while a job runs."""

from __future__ import annotations

import signal
import time

from config.celery import app
from jobs.broker.queues import queue_depths, unacknowledged
from jobs.models import DeadLetter, Job, JobState
from jobs.testing import Worker as PlatformWorker
from tests.conftest import LOG_DIR, ROOT, marks, wait_until
from tests.support.shutdown_tasks import fails_late
from tests.support.tasks import slow_once


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
    wait. The soft shutdown reads the pool's results only when the signal lands there
    (jobs.worker.shutdown); one landing while the loop still handles a message or a result
    falls back to Celery's sleep."""
    replies = app.control.inspect(destination=[worker.name], timeout=1).active() or {}
    running = {task["id"] for tasks in replies.values() for task in tasks}
    return set(job_ids) <= running


def test_a_worker_stops_when_its_running_job_ends(start_worker, clean_redis, transactional_db):
    # given: a worker running a job that needs JOB_SECONDS more when SIGTERM comes
    worker = start_worker("soft-stop", queues="reports", concurrency=1)
    handle = slow_once.using(queue="reports").enqueue("soft-stop", JOB_SECONDS)
    wait_until(lambda: marks("soft-stop"), timeout=30, what="the job to start")
    wait_until(lambda: waiting_on(worker, handle.id), timeout=30, what="the worker to wait on it")

    # when
    worker.process.send_signal(signal.SIGTERM)
    termed = time.monotonic()
    code = worker.process.wait(timeout=60)

    # then: the job ran to its end, and the worker stopped then, not after the 30 s timeout
    took = time.monotonic() - termed
    job = Job.objects.get(id=handle.id)
    assert (job.state, job.attempts) == (JobState.SUCCEEDED, 1), worker.output()[-3000:]
    assert code == 0
    assert took < JOB_SECONDS + 7, (
        f"the worker took {took:.1f} s to stop after a {JOB_SECONDS} s job"
    )
    # ... with its message acknowledged: nothing left in Redis to run it again
    assert unacknowledged() == 0 and queue_depths(["reports"]) == {"reports": 0}


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
        worker.process.send_signal(signal.SIGTERM)
        termed = time.monotonic()
        code = worker.process.wait(timeout=60)
    finally:
        worker.stop()

    # then: it stopped when the longer job ended, each outcome recorded and acknowledged
    took = time.monotonic() - termed
    assert (slow.job().state, slow.job().attempts) == (JobState.SUCCEEDED, 1)
    assert (failing.job().state, failing.job().attempts) == (JobState.DEAD, 1)
    assert DeadLetter.objects.filter(job_id_value=failing.id).count() == 1
    assert code == 0, worker.output()[-3000:]
    assert took < JOB_SECONDS + 7, f"the worker took {took:.1f} s to stop"
    assert unacknowledged() == 0 and queue_depths(["reports"]) == {"reports": 0}
