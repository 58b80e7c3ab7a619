"""Two deliveries of one job at the same time never run a step twice: the claim fences the
step writes (jobs.ledger.steps). Real worker processes, Redis and PostgreSQL: a second copy of
the message delivered while the first run is inside a step, and a stopped worker whose job a
second worker took over (SIGSTOP past a short lease, the relay re-queues it, SIGCONT)."""

from __future__ import annotations

import functools
import os
import signal
import time

from jobs.enqueue.publish import publish_job
from jobs.models import Job, JobState, JobStep, StepState
from tests.conftest import set_flag, wait_until
from tests.jobs.worker.test_fencing import fencing_counts, relay_until
from tests.jobs.worker.test_steps import (  # noqa: F401 (step_worker: the fixture)
    ended,
    history,
    runs,
    step_worker,
)
from tests.support import step_tasks

LEASE = "3"  # the stopped run's lease lapses after 3 s


def test_a_second_copy_delivered_while_a_step_runs_runs_no_step(step_worker, unique):  # noqa: F811
    # given: two workers, and a 3-step job whose second step holds its first run
    first = step_worker("fence-copy-a")
    handle = step_tasks.held.enqueue(unique)
    wait_until(lambda: runs(f"{unique}:two"), timeout=60, what="step 2 to start")
    second = step_worker("fence-copy-b")

    # when: a second copy of its message reaches the other worker meanwhile
    row = Job.objects.get(id=handle.id)
    assert publish_job(job=row, task=step_tasks.held, mark_published=False)
    wait_until(
        lambda: "steps.held" in second.output() and handle.id in second.output(),
        timeout=60,
        what="the copy to reach the second worker",
    )
    set_flag(f"{unique}:resume")
    job = wait_until(functools.partial(ended, handle.id), timeout=60, what="the job")

    # then: each step ran once, by the first run; the copy ran none
    assert job.state == JobState.SUCCEEDED, job.error
    assert job.attempts == 1 and job.result == [{"rows": [1, 2, 3]}, 6, "total 6"]
    assert (runs(f"{unique}:one"), runs(f"{unique}:two"), runs(f"{unique}:three")) == (1, 1, 1)
    assert history(handle.id) == [
        ("fetch", StepState.SUCCEEDED, 1),
        ("sum", StepState.SUCCEEDED, 1),
        ("post", StepState.SUCCEEDED, 1),
    ]
    assert first.process.poll() is None and second.process.poll() is None


def test_a_stopped_run_taken_over_writes_no_step_and_runs_no_later_one(step_worker, unique):  # noqa: F811
    # given: a worker with short leases whose job's first run holds in its second step
    first = step_worker("fence-stop-a", BACKLOT_LEASE_SECONDS=LEASE)
    handle = step_tasks.held.enqueue(unique)
    wait_until(lambda: runs(f"{unique}:two"), timeout=60, what="step 2 to start")

    # when: the worker stops (main process and pool) past its lease; the relay re-queues the
    # job and a second worker runs it to its end
    os.killpg(first.process.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    relay_until(
        lambda: Job.objects.get(id=handle.id).state == JobState.QUEUED,
        timeout=60,
        what="the lapsed lease to be re-queued",
    )
    assert time.monotonic() - stopped_at >= float(LEASE) - 0.5  # not before the lease lapsed
    step_worker("fence-stop-b", BACKLOT_LEASE_SECONDS=LEASE)
    job = relay_until(functools.partial(ended, handle.id), timeout=90, what="the second run")
    assert job.state == JobState.SUCCEEDED, job.error
    # and the first run resumes inside step 2 (its flag set: nothing holds it there)
    os.killpg(first.process.pid, signal.SIGCONT)
    set_flag(f"{unique}:resume")
    wait_until(
        lambda: "lost its claim; its finish was refused" in first.output(),
        timeout=60,
        what=f"the first run to stop, its claim lost\n{first.output()[-3000:]}",
    )

    # then: steps 1 and 3 ran once (step 3 by the second run only); step 2's function ran in
    # both runs, and only the second run's result is stored; the job is as the second run left it
    assert (runs(f"{unique}:one"), runs(f"{unique}:two"), runs(f"{unique}:three")) == (1, 2, 1)
    assert history(handle.id) == [
        ("fetch", StepState.SUCCEEDED, 1),
        ("sum", StepState.SUCCEEDED, 2),
        ("post", StepState.SUCCEEDED, 1),
    ]
    assert JobStep.objects.get(job_id=handle.id, name="sum").job_attempt == 2
    job = Job.objects.get(id=handle.id)
    assert job.state == JobState.SUCCEEDED and job.attempts == 2
    assert job.result == [{"rows": [1, 2, 3]}, 6, "total 6"]
    assert fencing_counts().get("refused:finish", 0) >= 1  # counted (the metrics' fencing counts)
    assert first.process.poll() is None  # the stopped worker lives on
