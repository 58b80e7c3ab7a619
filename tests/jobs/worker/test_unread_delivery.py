"""DEFER_CLAIM's unread delivery (jobs.broker.running.fresh, jobs.ledger.deferred.unread): the
first delivery of a young message sent right after its row was written runs without reading the
row; an old message, a retry's, a re-send without the stamp, a cancelled job's and a copy of a
run that ended read it first. In process, on the test Redis and PostgreSQL: the delivery's
statements are counted (CaptureQueriesContext)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from celery.app.task import Context
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import jobs
from jobs import dead_letter_replay_many, ledger
from jobs.broker import running
from jobs.broker.redis import redis_client
from jobs.flow.cancellation import cancel
from jobs.models import DeadLetter, Job, JobState
from jobs.worker import execution, outcomes
from jobs.worker.deferred import DeferredClaim
from tests.support import tasks

QUEUE = "reports"  # no test worker consumes it: the message stays where the test reads it

pytestmark = pytest.mark.usefixtures("clean_redis")


@pytest.fixture
def deferring(settings: Any) -> None:
    settings.BACKLOT = {**settings.BACKLOT, "DEFER_CLAIM": True}


def message_of(job_id: str) -> dict[str, Any]:
    """The job's message as the queue holds it."""
    client = redis_client()
    for key in client.scan_iter(match=f"{QUEUE}*"):
        if client.type(key) != b"list":
            continue
        for raw in client.lrange(key, 0, -1):
            message = json.loads(raw)
            if message["headers"]["id"] == job_id:
                return message
    raise AssertionError(f"no message of {job_id} in {QUEUE}")


def delivery(job_id: str, **headers: Any) -> Context:
    """The request a worker makes of a message with these headers, with its claim token."""
    request = Context({"id": job_id, "retries": 0, "eta": None, **headers})
    setattr(request, outcomes.CLAIM_TOKEN, str(uuid.uuid4()))
    return request


def deliver(request: Context) -> tuple[ledger.Peeked | ledger.Dropped | None, int]:
    """The delivery's deferred claim, and how many statements it sent to the database."""
    with CaptureQueriesContext(connection) as queries:
        taken = execution.deferred_delivery(tasks.add, request, 30)
    return taken, len(queries)


def born_now(owner_id: int | None = None) -> list[Any]:
    return [int(time.time() * 1000), owner_id]


def test_an_enqueued_message_is_stamped_and_its_first_delivery_reads_no_row(
    deferring, transactional_db
):
    # given a job enqueued for a user with DEFER_CLAIM on
    owner = get_user_model().objects.create(username="unread-owner")
    handle = tasks.add.using(queue=QUEUE, owner=owner).enqueue(1, 2)
    headers = message_of(handle.id)["headers"]
    assert headers[running.BORN][1] == owner.pk

    # when its message is delivered for the first time
    taken, statements = deliver(delivery(handle.id, **{running.BORN: headers[running.BORN]}))

    # then the run starts without a statement to the database, as its owner's first attempt,
    # and the row still waits untouched
    assert statements == 0
    assert isinstance(taken, ledger.Peeked) and taken.assumed
    assert (taken.attempts, taken.claim.attempt, taken.claim.owner_id) == (0, 1, owner.pk)
    assert Job.objects.get(id=handle.id).state == JobState.QUEUED


def test_a_fan_out_stamps_its_messages_and_a_batch_a_celery_id_or_setting_off_does_not(
    deferring, transactional_db, settings
):
    (fanned,) = jobs.enqueue_many(tasks.add, [((1, 2), {})], queue=QUEUE)
    assert running.BORN in message_of(fanned)["headers"]
    with jobs.batch() as batch:
        member = tasks.add.using(queue=QUEUE).enqueue(3, 4)
    assert batch.id and running.BORN not in message_of(member.id)["headers"]
    # Celery's task_id (a Task.replace() takes over the replaced job's row, attempts and all)
    chosen = str(uuid.uuid4())
    tasks.add.apply_async((7, 8), task_id=chosen, queue=QUEUE)
    assert running.BORN not in message_of(chosen)["headers"]
    settings.BACKLOT = {**settings.BACKLOT, "DEFER_CLAIM": False}
    plain = tasks.add.using(queue=QUEUE).enqueue(5, 6)
    assert running.BORN not in message_of(plain.id)["headers"]


def test_a_dead_letters_replay_is_not_stamped(deferring, transactional_db):
    # given a dead letter (a replay of a dead batch member joins its batch after the insert:
    # its delivery must read the row, which says so)
    now = timezone.now()
    dead = DeadLetter.objects.create(
        job_id_value=uuid.uuid4(),
        task_name=tasks.add.name,
        args=[1, 2],
        kwargs={},
        queue=QUEUE,
        priority=5,
        exception_class="ConnectionError",
        exception_message="down",
        first_failed_at=now,
        last_failed_at=now,
    )

    # when it is replayed
    (replayed,) = dead_letter_replay_many(queryset=DeadLetter.objects.filter(pk=dead.pk)).job_ids

    # then its message carries no `born`: its first delivery reads the row
    assert running.BORN not in message_of(replayed)["headers"]


@pytest.mark.parametrize(
    "headers",
    [
        {running.BORN: [int(time.time() * 1000) - running.FRESH_MS - 1000, None]},
        {"retries": 1},
        {"eta": "2026-01-01T00:00:00+00:00"},
        {},
    ],
    ids=["old", "a-retry", "delayed", "not-stamped"],
)
def test_a_message_that_is_not_a_fresh_first_one_reads_the_row(
    deferring, transactional_db, headers
):
    # given a queued job, and a message of it that is old, a retry's, delayed or unstamped
    handle = tasks.add.using(queue=QUEUE).enqueue(1, 2)
    stamped = {running.BORN: born_now(), **headers}
    if not headers:
        stamped = {}

    # when it is delivered
    taken, statements = deliver(delivery(handle.id, **stamped))

    # then the row is read before the run starts
    assert statements == 1
    assert isinstance(taken, ledger.Peeked) and not taken.assumed


def test_a_fresh_message_of_a_cancelled_job_takes_the_claim_path(deferring, transactional_db):
    # given a queued job cancelled while its fresh message waits
    handle = tasks.add.using(queue=QUEUE).enqueue(1, 2)
    born = message_of(handle.id)["headers"][running.BORN]
    assert cancel(handle.id).state == JobState.CANCELLED

    # when the message is delivered
    taken, _ = deliver(delivery(handle.id, **{running.BORN: born}))

    # then it does not run unread: the claim path reads the cancelled row and drops it
    assert taken is None
    claimed = ledger.claim_delivery(job_id=handle.id, lease_seconds=30, lease_owner=None)
    assert isinstance(claimed, ledger.Dropped)


def test_a_fresh_copy_of_a_message_whose_run_ended_takes_the_claim_path(
    deferring, transactional_db
):
    # given a job whose first run started unread and ended (a failure, which wrote its claim)
    handle = tasks.add.using(queue=QUEUE).enqueue(1, 2)
    born = {running.BORN: message_of(handle.id)["headers"][running.BORN]}
    first = delivery(handle.id, **born)
    taken, _ = deliver(first)
    assert isinstance(taken, ledger.Peeked) and taken.assumed
    running.end(handle.id, getattr(first, outcomes.CLAIM_TOKEN))

    # when a copy of its message is delivered (a publish retried, a restore)
    again, statements = deliver(delivery(handle.id, **born))

    # then the copy does not run unread
    assert again is None and statements == 0


def test_an_unread_success_on_a_row_with_attempts_is_written_with_them(deferring, transactional_db):
    # given a waiting row whose attempt count the run could not know (a run elsewhere,
    # without a record here), and a run that assumed none
    handle = tasks.add.using(queue=QUEUE).enqueue(1, 2)
    Job.objects.filter(id=handle.id).update(state=JobState.RETRYING, attempts=1)
    token = str(uuid.uuid4())
    peeked = ledger.unread(job_id=handle.id, token=token, max_attempts=3, owner_id=None)
    deferred = DeferredClaim(handle.id, peeked.attempts, token, timezone.now(), 30, assumed=True)

    # when its success is written
    written = deferred.succeed(0.01, 3)

    # then the row takes it, as the run after its first
    job = Job.objects.get(id=handle.id)
    assert written and (job.state, job.attempts, job.result) == (JobState.SUCCEEDED, 2, 3)


def test_an_unread_success_on_a_cancelled_row_is_not_written(deferring, transactional_db):
    # given a row cancelled while a run that did not read it ran
    handle = tasks.add.using(queue=QUEUE).enqueue(1, 2)
    cancel(handle.id)
    token = str(uuid.uuid4())
    deferred = DeferredClaim(handle.id, 0, token, timezone.now(), 30, assumed=True)

    # when its success is written, then it is refused and the row stays cancelled
    assert deferred.succeed(0.01, 3) is False
    job = Job.objects.get(id=handle.id)
    assert (job.state, job.attempts, job.result) == (JobState.CANCELLED, 0, None)
