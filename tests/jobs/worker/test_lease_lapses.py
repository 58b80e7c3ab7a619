"""A lapsed lease is a lost run, counted as a crash like a pool process dying: the relay
re-queues the job until its MAX_WORKER_CRASHES-th lapse, which dead-letters it, and a delivery
that takes a lapsed lease over counts one too (tests/system/faults/test_lost_worker.py has a
job killing its real workers)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import events, ledger
from jobs.flow.relay import job_relay
from jobs.models import DeadLetter, Job, JobState

PAST = timedelta(minutes=5)
# A name no process defines: the sweep leaves the re-queued row in the ledger instead of
# publishing it to a worker of the suite (the rows here are not committed).
TASK = "tests.lease_lapses.nowhere"


def running(crashes: int, *, lapsed: bool = True) -> Job:
    now = timezone.now()
    return Job.objects.create(
        id=uuid.uuid4(),
        task_name=TASK,
        args=[1, 2],
        queue="default",
        state=JobState.RUNNING,
        attempts=crashes + 1,
        max_attempts=5,
        crashes=crashes,
        enqueued_at=now - PAST,
        published_at=now - PAST,
        lease_expires_at=now - PAST if lapsed else now + PAST,
    )


@pytest.fixture
def dead_events() -> Any:
    seen: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs)

    events.job_dead.connect(receiver, weak=False)
    yield seen
    events.job_dead.disconnect(receiver)


@pytest.mark.django_db
def test_a_lapse_below_the_cap_requeues_and_counts_a_crash(clean_redis: None) -> None:
    job = running(crashes=1)
    alive = running(crashes=2, lapsed=False)

    job_relay()

    job.refresh_from_db()
    alive.refresh_from_db()
    assert (job.state, job.crashes) == (JobState.QUEUED, 2)
    assert (alive.state, alive.crashes) == (JobState.RUNNING, 2)


@pytest.mark.django_db
def test_the_max_crashes_th_lapse_dead_letters_the_job(
    clean_redis: None, dead_events: list[dict[str, Any]]
) -> None:
    job = running(crashes=2)  # MAX_WORKER_CRASHES is 3

    job_relay()

    job.refresh_from_db()
    letter = DeadLetter.objects.get(job_id_value=job.id)
    assert (job.state, job.crashes) == (JobState.DEAD, 3)
    assert letter.exception_class == "billiard.exceptions.WorkerLostError"
    assert "worker lost 3 times" in letter.exception_message
    assert letter.attempts == job.attempts == 3
    assert [e["job_id"] for e in dead_events] == [str(job.id)]
    job_relay()  # a second sweep finds nothing more to do
    assert DeadLetter.objects.filter(job_id_value=job.id).count() == 1


@pytest.mark.django_db
def test_taking_a_lapsed_lease_over_counts_a_crash(clean_redis: None) -> None:
    job = running(crashes=0)

    claimed = ledger.claim(job_id=str(job.id), lease_seconds=30)

    job.refresh_from_db()
    assert claimed is not None and claimed.attempt == 2
    assert (job.state, job.crashes) == (JobState.RUNNING, 1)


@pytest.mark.django_db
def test_a_lapsed_lease_at_its_last_crash_is_not_taken_over_but_dead_lettered(
    clean_redis: None,
) -> None:
    job = running(crashes=2)

    assert ledger.claim(job_id=str(job.id), lease_seconds=30) is None
    job.refresh_from_db()
    assert (job.state, job.attempts, job.crashes) == (JobState.RUNNING, 3, 2)

    job_relay()
    job.refresh_from_db()
    assert job.state == JobState.DEAD
