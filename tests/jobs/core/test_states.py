"""The state machine's table against the ledger: every event, from every state.

For each event of jobs.core.states.TRANSITIONS the ledger write that carries it out is run on a row
in each JobState: it must change the row exactly when the table allows the from-state, and
lead where the table says. A new event without a case here fails the first test. The batch
table (BATCH_TRANSITIONS) is walked the same way against jobs.ledger.batch at the end.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs import ledger
from jobs.core.states import BATCH_TRANSITIONS, TRANSITIONS
from jobs.ledger import batch as _batch_ledger  # noqa: F401  (ledger.batch below)
from jobs.models import Batch, BatchState, DeadLetter, Job, JobState

PAST = timedelta(minutes=5)


def row(state: JobState, **fields: Any) -> Job:
    """A job in `state` that any event could act on: attempt 1, a lapsed lease, due, published."""
    now = timezone.now()
    values: dict[str, Any] = {
        "task_name": "tests.add",
        "args": [1, 2],
        "queue": "default",
        "state": state,
        "attempts": 1,
        "max_attempts": 5,
        "enqueued_at": now - PAST,
        "published_at": now - PAST,
        "scheduled_for": now - PAST,
        "lease_expires_at": now - PAST,
    }
    return Job.objects.create(id=uuid.uuid4(), **{**values, **fields})


def claim(job: Job) -> Any:
    return ledger.claim(job_id=str(job.id), lease_seconds=30)


def take_over(job: Job) -> Any:
    # a row some run handed over with Task.replace(), taken over by its replacement
    Job.objects.filter(id=job.id).update(error=ledger.REPLACED)
    successor = Job(id=job.id, task_name="tests.total", args=[[1]], queue="default", priority=5)
    return ledger.take_over(successor)


def drop_early(job: Job) -> Any:
    # a copy delivered long before the job's time is dropped and the job goes back to the outbox
    Job.objects.filter(id=job.id).update(scheduled_for=timezone.now() + timedelta(hours=1))
    return ledger.claim(job_id=str(job.id), lease_seconds=30)


WRITES: dict[str, Callable[[Job], Any]] = {
    "claim": claim,
    "renew": lambda job: ledger.renew(job_id=str(job.id), attempt=1, lease_seconds=30),
    "progress": lambda job: ledger.progress(job_id=str(job.id), done=3, total=9, message="m"),
    "succeed": lambda job: ledger.succeed(job_id=str(job.id), attempt=1, run_seconds=0.1),
    # DEFER_CLAIM: the row as the delivery read it, attempt count 1
    "claim_deferred": lambda job: ledger.claim_deferred(
        job_id=str(job.id),
        attempts=1,
        lease_owner=str(uuid.uuid4()),
        started=timezone.now(),
        lease_seconds=30,
    ),
    "succeed_unclaimed": lambda job: ledger.succeed_unclaimed(
        job_id=str(job.id),
        attempts=1,
        lease_owner=str(uuid.uuid4()),
        started=timezone.now(),
        run_seconds=0.1,
    ),
    "run_lost": lambda job: ledger.run_lost(job_id=str(job.id), lease_owner=str(uuid.uuid4())),
    "retry_later": lambda job: ledger.retry_later(
        job_id=str(job.id),
        attempt=1,
        failures=[],
        exc=ConnectionError("x"),
        delay=5,
        run_seconds=0.1,
    ),
    "release": lambda job: ledger.release(job_id=str(job.id)),
    "lease_lapsed": lambda job: ledger.lapsed_leases_requeued(now=timezone.now()),
    "give_up": lambda job: ledger.give_up(
        job_id=str(job.id),
        defaults=ledger.Defaults("tests.add", "default", 5),
        args=[1, 2],
        kwargs={},
        attempt=1,
        exc=ValueError("no"),
    ),
    "mark_published": lambda job: (
        Job.objects.filter(id=job.id).update(published_at=None),
        ledger.mark_published([job.id]),
    ),
    "republish": lambda job: ledger.republish(
        now=timezone.now(),
        published_before=timezone.now(),
        lost_after=timedelta(0),
    ),
    "drop_early": drop_early,
    "cancel": lambda job: ledger.cancel_waiting([job.id]),
    "request_cancel": lambda job: ledger.request_cancel([job.id]),
    "run_cancelled": lambda job: ledger.run_cancelled(job_id=str(job.id)),
    "replace": lambda job: ledger.replace(job_id=str(job.id), attempt=1),
    "take_over": take_over,
    "sleep": lambda job: ledger.sleep(
        job_id=str(job.id),
        name="sleep-1",
        position=0,
        wake_at=timezone.now() + timedelta(hours=1),
        attempt=1,
        lease_owner=None,
        run_seconds=0.1,
    ),
}


def changed(before: Job, after: Job, event: str) -> bool:
    """Whether the write did what `event` does to a row (its own marks included)."""
    if event == "renew":
        return after.lease_expires_at != before.lease_expires_at
    if event == "progress":
        return after.progress_done == 3
    if event == "request_cancel":
        return after.cancel_requested_at is not None
    if event == "mark_published":
        return after.published_at is not None
    if event == "republish":
        return after.published_at is None
    if event == "drop_early":
        return after.published_at is None and after.state == before.state
    return after.state != before.state or (event == "claim" and after.attempts == 2)


def test_every_event_of_the_table_has_a_case():
    assert set(WRITES) == set(TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("event", sorted(TRANSITIONS))
@pytest.mark.parametrize("state", list(JobState))
def test_each_write_follows_the_table(event, state):
    # given a row in `state`
    before = row(state)
    transition = TRANSITIONS[event]

    # when the ledger write of `event` runs on it
    WRITES[event](before)

    # then it changed the row exactly when the table allows the from-state, to the table's state
    after = Job.objects.get(id=before.id)
    allowed = transition.allows(state)
    assert changed(before, after, event) == allowed, (event, state)
    if allowed and transition.target is not None:
        assert after.state == transition.target
    if not allowed or transition.target is None:
        # an early copy of a job that need not wait (queued, or running under a lapsed lease)
        # is simply claimed
        claimed = event == "drop_early" and not allowed and TRANSITIONS["claim"].allows(state)
        assert after.state == (TRANSITIONS["claim"].target if claimed else state)
    if event == "give_up":
        assert DeadLetter.objects.filter(job_id_value=str(before.id)).exists() == allowed


@pytest.mark.django_db
def test_a_run_that_lost_its_claim_changes_nothing():
    job = row(JobState.RUNNING, lease_expires_at=timezone.now() + PAST)

    assert not ledger.succeed(job_id=str(job.id), attempt=2, run_seconds=1)
    assert (
        ledger.retry_later(
            job_id=str(job.id), attempt=2, failures=[], exc=OSError(), delay=1, run_seconds=1
        )
        is None
    )
    assert (
        ledger.give_up(
            job_id=str(job.id),
            defaults=ledger.Defaults("tests.add", "default", 5),
            args=[],
            kwargs={},
            attempt=2,
            exc=OSError(),
            claimed_attempt=2,
        )
        is None
    )
    assert Job.objects.get(id=job.id).state == JobState.RUNNING


# --- batches: jobs.core.states.BATCH_TRANSITIONS against jobs.ledger.batch -----------------------
def batch_row(state: BatchState, **counters: int) -> Batch:
    return Batch.objects.create(state=state, **counters)


def member(batch: Batch, state: JobState) -> Job:
    return row(state, batch=batch)


def _ended(outcome: JobState) -> Callable[[Batch], Any]:
    def write(batch: Batch) -> Any:
        ledger.batch.member_ended(job_id=member(batch, outcome).id, outcome=outcome)

    return write


def _replayed(batch: Batch) -> Any:
    dead = member(batch, JobState.DEAD)
    letter = DeadLetter.objects.create(
        job=dead,
        job_id_value=str(dead.id),
        task_name="tests.add",
        queue="default",
        exception_class="ValueError",
        exception_message="no",
        first_failed_at=timezone.now(),
        last_failed_at=timezone.now(),
    )
    ledger.batch.member_replayed(dead_letter=letter, job_id=row(JobState.QUEUED).id)


# event -> (the batch's counters before, its write, whether the write did what the event does)
BATCH_WRITES: dict[str, tuple[dict[str, int], Callable[[Batch], Any], Callable[[Batch], bool]]] = {
    "members_added": (
        {"total": 1, "pending": 1},
        lambda b: ledger.batch.members_added(batch_id=b.id, waiting=2),
        lambda b: b.total == 3,
    ),
    "child_opened": (
        {"total": 1, "pending": 1},
        lambda b: ledger.batch.child_opened(parent_id=b.id),
        lambda b: b.children_pending == 1,
    ),
    "member_ended": (
        {"total": 2, "pending": 2},
        _ended(JobState.SUCCEEDED),
        lambda b: b.succeeded == 1 and b.pending == 1,
    ),
    "member_replayed": (
        {"total": 2, "pending": 1, "dead": 1},
        _replayed,
        lambda b: b.dead == 0 and b.pending == 2,
    ),
    "first_death": ({"total": 2, "pending": 2}, _ended(JobState.DEAD), lambda b: bool(b.died_at)),
    "batch_complete": (
        {"total": 2, "pending": 1, "dead": 1},
        _ended(JobState.SUCCEEDED),
        lambda b: b.completed_at is not None,
    ),
    "batch_succeed": (
        {"total": 1, "pending": 1},
        _ended(JobState.SUCCEEDED),
        lambda b: b.succeeded_at is not None,
    ),
}


def test_every_batch_event_has_a_case():
    assert set(BATCH_WRITES) == set(BATCH_TRANSITIONS)


@pytest.mark.django_db
@pytest.mark.parametrize("event", sorted(BATCH_TRANSITIONS))
@pytest.mark.parametrize("state", list(BatchState))
def test_each_batch_write_follows_the_table(event, state):
    # given a batch in `state`
    counters, write, did = BATCH_WRITES[event]
    batch = batch_row(state, **counters)
    transition = BATCH_TRANSITIONS[event]

    # when the ledger write of `event` runs on it
    write(batch)

    # then it did what the event does exactly when the table allows the from-state
    after = Batch.objects.get(id=batch.id)
    allowed = transition.allows(state)
    assert did(after) == allowed, (event, state)
    if allowed and transition.target is not None:
        assert after.state == transition.target
    if not allowed:
        assert after.state == state
