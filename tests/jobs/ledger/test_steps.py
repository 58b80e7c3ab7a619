"""The step writes of jobs.ledger.steps against the real database: fenced by the run's claim,
and a dead letter's replay (one, or many at once as the admin's action does) copies the dead
job's finished steps to the new job."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import dead_letter_replay_many, ledger
from jobs.core.conf import backlot_settings
from jobs.flow.retention import retention_purge
from jobs.models import DeadLetter, Job, JobSignal, JobState, JobStep, StepState
from tests.support import step_tasks

pytestmark = pytest.mark.django_db


def running_job(**fields: object) -> Job:
    values: dict = {
        "task_name": step_tasks.three.name,
        "args": ["k"],
        "queue": "reports",
        "state": JobState.RUNNING,
        "attempts": 1,
        "max_attempts": 4,
        "lease_owner": uuid.uuid4(),
        "lease_expires_at": timezone.now() + timedelta(seconds=30),
    }
    return Job.objects.create(id=uuid.uuid4(), **{**values, **fields})


def write(job: Job, fn: Any, lease_owner: str | None = None, **values: Any) -> bool:
    owner = str(job.lease_owner) if lease_owner is None else lease_owner
    return bool(fn(job_id=str(job.id), attempt=1, lease_owner=owner, lease_seconds=30, **values))


def test_step_writes_are_fenced_by_the_claim():
    job = running_job()

    # a run holding the claim writes its step
    assert write(job, ledger.step_started, name="fetch", position=0)
    assert write(job, ledger.step_succeeded, name="fetch", result={"rows": [1]})
    # one whose claim another run took over writes nothing
    stale = str(uuid.uuid4())
    assert not write(job, ledger.step_started, name="sum", position=1, lease_owner=stale)
    assert not write(job, ledger.step_failed, name="fetch", exc=ValueError("x"), lease_owner=stale)

    (step,) = JobStep.objects.of_job(job.id)
    assert (step.name, step.state, step.attempts, step.result) == (
        "fetch",
        StepState.SUCCEEDED,
        1,
        {"rows": [1]},
    )
    assert step.result_bytes == len('{"rows":[1]}')


def test_a_sleep_gives_its_attempt_back_and_is_fenced():
    job = running_job()
    wake = timezone.now() + timedelta(minutes=5)
    arguments: dict[str, Any] = {
        "name": "sleep-1",
        "position": 0,
        "wake_at": wake,
        "run_seconds": 0.1,
    }

    assert not ledger.sleep(
        job_id=str(job.id), attempt=1, lease_owner=str(uuid.uuid4()), **arguments
    )
    assert ledger.sleep(
        job_id=str(job.id), attempt=1, lease_owner=str(job.lease_owner), **arguments
    )

    job.refresh_from_db()
    assert (job.state, job.attempts, job.scheduled_for) == (JobState.SCHEDULED, 0, wake)
    step = JobStep.objects.get(job=job)
    assert (step.kind, step.state, step.wake_at) == ("sleep", StepState.SLEEPING, wake)


def test_a_bulk_replay_copies_the_finished_steps():
    # given: two jobs dead at their third step, after two finished steps
    dead = []
    for _ in range(2):
        job = running_job()
        for position, name in enumerate(["fetch", "sum", "post"]):
            write(job, ledger.step_started, name=name, position=position)
            if name != "post":
                write(job, ledger.step_succeeded, name=name, result=position)
        write(job, ledger.step_failed, name="post", exc=ConnectionError("away"))
        ledger.give_up(
            job_id=str(job.id),
            defaults=ledger.Defaults(job.task_name, "reports", 5),
            args=["k"],
            kwargs={},
            attempt=1,
            exc=ConnectionError("away"),
        )
        dead.append(job)

    # when: both are replayed at once (the admin's action)
    outcome = dead_letter_replay_many(
        queryset=DeadLetter.objects.filter(job_id_value__in=[j.id for j in dead])
    )

    # then: each new job has its own dead job's finished steps, not the failed one
    assert outcome.done == 2
    for new_id in outcome.job_ids:
        letter = Job.objects.get(id=new_id).replay_of
        assert letter is not None
        origin = Job.objects.get(id=letter.job_id_value)
        steps = [(s.name, s.state, s.result, s.copied_from) for s in JobStep.objects.of_job(new_id)]
        assert steps == [
            ("fetch", StepState.SUCCEEDED, 0, origin.id),
            ("sum", StepState.SUCCEEDED, 1, origin.id),
        ]


def test_a_signal_sent_while_the_job_runs_wakes_its_wait_at_once():
    # given: a running job that gets its signal before it parks in the wait
    job = running_job()
    assert ledger.signal_sent(job_id=str(job.id), name="ok", payload=1, step="wait:ok") == "kept"

    # when: the run parks in wait_for("ok") with a timeout an hour away
    timeout = timezone.now() + timedelta(hours=1)
    woken = ledger.sleep(
        job_id=str(job.id),
        name="wait:ok",
        position=0,
        wake_at=timeout,
        attempt=1,
        lease_owner=str(job.lease_owner),
        run_seconds=0.1,
        kind="wait",
        event="ok",
    )

    # then: it is due now, not at its timeout
    assert woken is not None and woken < timeout
    job.refresh_from_db()
    assert job.state == JobState.SCHEDULED and job.scheduled_for == woken
    assert ledger.signal_sent(job_id=str(job.id), name="ok", payload=2, step="wait:ok") == (
        "duplicate"
    )


def test_a_jobs_steps_and_signals_stay_until_retention_removes_the_job():
    # given: two succeeded jobs with a step and a signal, one past JOB_RETENTION_DAYS
    old, recent = running_job(), running_job()
    for job in (old, recent):
        write(job, ledger.step_started, name="fetch", position=0)
        write(job, ledger.step_succeeded, name="fetch", result=1)
        ledger.signal_sent(job_id=str(job.id), name="ok", payload=1, step="wait:ok")
    days = backlot_settings().JOB_RETENTION_DAYS
    long_ago = timezone.now() - timedelta(days=days + 1)
    Job.objects.filter(id=old.id).update(
        state=JobState.SUCCEEDED, enqueued_at=long_ago, finished_at=long_ago
    )
    Job.objects.filter(id=recent.id).update(state=JobState.SUCCEEDED, finished_at=timezone.now())

    # when retention runs
    retention_purge()

    # then: the old job went with its steps and signals; the recent one keeps them
    assert not JobStep.objects.filter(job_id=old.id).exists()
    assert not JobSignal.objects.filter(job_id=old.id).exists()
    assert JobStep.objects.filter(job_id=recent.id).count() == 1
    assert JobSignal.objects.filter(job_id=recent.id).count() == 1
