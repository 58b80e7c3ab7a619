"""Accepting jobs: check the payload, write the ledger row in the caller's transaction, publish
after commit (the row is the outbox: what the broker did not take, the relay sends later).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.urls import NoReverseMatch, reverse
from django.utils import timezone

from jobs import ledger
from jobs.broker import broker
from jobs.core import events, tracing
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import BrokerUnavailable
from jobs.core.options import (
    check_arguments,
    check_priority,
    check_queue,
    resolve_start,
    storable_options,
)
from jobs.core.payload import payload_check
from jobs.core.states import JobState
from jobs.enqueue.lineage import born_cancelled, join_batch, lineage, on_commit_or_now
from jobs.enqueue.publish import Enqueueable, publish_job, with_born
from jobs.enqueue.routing import job_queue
from jobs.models import Job

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobHandle:
    """What enqueue returns: the job id, and whether this call created the job."""

    id: str
    task_name: str
    created: bool = True
    # When this call accepted the job it created (None where it returns another's job).
    enqueued_at: datetime | None = None

    @property
    def status_url(self) -> str:
        """The job's status route (BACKLOT['STATUS_URL_NAME'])."""
        name = backlot_settings().STATUS_URL_NAME
        try:
            return reverse(name, kwargs={"job_id": self.id})
        except NoReverseMatch as exc:
            raise ImproperlyConfigured(
                f"No URL named {name!r} for a job's status: mount jobs.web.api.router on your "
                "NinjaAPI, or set BACKLOT['STATUS_URL_NAME'] to its '<namespace>:job_status'"
            ) from exc

    def job(self) -> Job:
        return Job.objects.get(id=self.id)


# What _insert did with a job sent under a given id (see there).
INSERTED, REFUSED, REVOKED = "inserted", "refused", "revoked"


def _insert(job: Job, *, replacing: bool, alongside: Any = None) -> str:
    """Insert the job's row (one INSERT is atomic on its own: no BEGIN/COMMIT round trip).

    A job sent with a given id may be the task that Celery's Task.replace() froze with the id
    of the job it replaces: it takes that job's row over (jobs.ledger.replace). REFUSED when
    that job was cancelled meanwhile: the replacement is not sent, as a cancelled job's
    children are not. REVOKED when the id is a cancelled job's (a frozen signature sent again
    in another canvas): as a revoked id in Celery, its message is sent and discarded by the
    worker, and the row stays cancelled. The id of a job that is still active or ran to its
    end is refused with a ValueError naming it (one id, one job)."""
    if not replacing:
        ledger.insert(job, alongside)
        return INSERTED
    in_transaction = transaction.get_connection().in_atomic_block
    try:
        # a failed INSERT inside the caller's transaction must not break it: a savepoint then
        with transaction.atomic() if in_transaction else nullcontext():
            ledger.insert(job)
        return INSERTED
    except IntegrityError:
        if ledger.take_over(job):
            return INSERTED
        held = Job.objects.filter(id=job.id).values_list("state", "error", "task_name").first()
        if held is None:
            raise
        state, error, task_name = held
        if state == JobState.CANCELLED:
            return REFUSED if error == ledger.REPLACED else REVOKED
        raise ValueError(
            f"task_id {job.id} is already the id of a {state} job of {task_name}: a job id "
            "names one job; send this one without task_id (a new id)"
        ) from None


def enqueue(
    *,
    task: Enqueueable,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
    priority: int | None = None,
    delay: float | None = None,
    eta: datetime | None = None,
    on_commit: bool = True,
    owner: Any = None,
    task_id: str | None = None,
    queue: str | None = None,
    publish_options: Mapping[str, Any] | None = None,
    detached: bool = False,
    trace_parent: Mapping[str, str] | None = None,
    parent_stopping: bool | None = None,
    job_id: uuid.UUID | str | None = None,
    alongside: Any = None,
) -> JobHandle:
    """Accept a job: check its payload, write its ledger row, publish after commit.

    `alongside`: the caller's new model instance, inserted with the job's row (on PostgreSQL
    in the job's own statement: atomic without a transaction; jobs.ledger.alongside), its
    primary key set when enqueue returns; it is inserted also when an idempotency key returns
    another job.

    `job_id`: the new job's id, chosen by the caller (a fresh UUID), so that the caller's own
    row can be written with it before the job is (saves that row's UPDATE); an id already in
    the ledger fails the job's INSERT with IntegrityError. `task_id` is Celery's: the id of a
    job that Task.replace() froze, whose row the new one may take over (see _insert).

    With an idempotency key, a second enqueue while the first job is active (or succeeded
    within BACKLOT['IDEMPOTENCY_TTL']) writes and sends nothing and returns the first job.
    The job belongs to `owner`, else to the user acted for, else to the owner of the running
    job that enqueues it, whose child it is unless `detached` (jobs.core.context). Its trace is the
    current one, or `trace_parent`'s (a replay joins its original job's trace; jobs.core.tracing).
    """
    args, kwargs = list(args), dict(kwargs or {})
    if job_id is not None and task_id is not None:
        raise ValueError("pass job_id (a new job's id) or task_id (Celery's), not both")
    if alongside is not None:
        ledger.check_alongside(alongside)
        if task_id is not None or not task.track:
            raise ValueError(
                f"alongside= writes a row with a new job's ledger row: not with task_id, nor for "
                f"{task.name} if it has track=False"
            )
    if not on_commit and transaction.get_connection().in_atomic_block:
        raise ValueError(
            "on_commit=False inside a transaction would publish a job whose ledger row the "
            "worker cannot see yet; enqueue after the transaction, or keep on_commit=True"
        )
    conf = backlot_settings()
    queue = check_queue(job_queue(task, args, kwargs, queue))
    check_arguments(task, args, kwargs)
    payload_check(task_name=task.name, args=args, kwargs=kwargs, max_bytes=conf.MAX_PAYLOAD_BYTES)
    priority = check_priority(task.default_priority if priority is None else priority)
    now = timezone.now()
    start_at = resolve_start(delay, eta, now)
    if job_id is not None:
        job_id = job_id if isinstance(job_id, uuid.UUID) else uuid.UUID(job_id)
    else:
        job_id = uuid.UUID(task_id) if task_id else uuid.uuid4()
    job = ledger.new_job(
        id=job_id,
        task_name=task.name,
        args=args,
        kwargs=kwargs,
        queue=queue,
        priority=priority,
        **lineage(owner, detached),
        idempotency_key=idempotency_key or "",
        state=JobState.SCHEDULED if start_at else JobState.QUEUED,
        max_attempts=task.policy.max_attempts,
        enqueued_at=now,
        scheduled_for=start_at,
        publish_options=storable_options(publish_options),
        trace_context=tracing.job_published(
            queue=queue, task=task.name, job_id=str(job_id), parent=trace_parent
        ),
    )
    joining = join_batch(job, task)
    if not task.track:
        if idempotency_key:
            raise ValueError(f"{task.name} has track=False: idempotency keys need the job ledger")
        on_commit_or_now(on_commit, lambda: _publish_untracked(job, task, publish_options))
        return JobHandle(id=str(job.id), task_name=task.name, enqueued_at=now)
    if born_cancelled(job, now, parent_stopping):
        if task_id is not None and Job.objects.filter(id=job.id).exists():
            # the task of a Task.replace(), its replaced job's row already there: nothing to send
            return JobHandle(id=str(job.id), task_name=task.name)
        ledger.insert(job, alongside)
        if joining is not None:
            joining.born_cancelled += 1
        return JobHandle(id=str(job.id), task_name=task.name)

    publishes = start_at is None or broker.takes_countdown((start_at - now).total_seconds())
    # Inserted already marked published: the message goes right after (after commit), and a
    # row marked by a second UPDATE cost the enqueue a round trip. A publish that fails puts
    # it back in the outbox (below); one lost with its process after the commit is found
    # missing from Redis by the relay's reconcile (jobs.flow.relay, MISSING_AFTER). RabbitMQ
    # cannot show what it holds: there the row is marked once the publish is confirmed.
    # Long delays wait in the ledger, unpublished; the relay publishes them when due.
    marked = publishes and broker.lists_held_messages()
    if marked:
        job.published_at = now
    if idempotency_key:
        ttl = timedelta(seconds=conf.IDEMPOTENCY_TTL)
        holder = ledger.insert_holding_key(
            job=job, key=idempotency_key, ttl=ttl, now=now, alongside=alongside
        )
        if holder is not None:  # not a new member: the job that holds the key is another's
            return JobHandle(id=str(holder.id), task_name=task.name, created=False)
    else:
        inserted = _insert(job, replacing=task_id is not None, alongside=alongside)
        if inserted == REFUSED:  # its replaced job was cancelled
            return JobHandle(id=str(job.id), task_name=task.name)
        if inserted == REVOKED:  # sent for the worker to discard, as Celery's revoked ids

            def resend_revoked() -> None:
                publish_job(job=job, task=task, options=publish_options, mark_published=False)

            on_commit_or_now(on_commit, resend_revoked)
            return JobHandle(id=str(job.id), task_name=task.name, created=False)
    if joining is not None:
        joining.added += 1

    def accepted() -> None:
        options = publish_options
        # DEFER_CLAIM: a first message, due now, in no batch, of a row of its own (not one a
        # Task.replace() took over, whose attempts are the replaced job's), says when it was sent
        if conf.DEFER_CLAIM and marked and not (start_at or joining or task_id):
            options = with_born(task, publish_options, job.owner_id)
        # a row marked published: Redis's reply is not waited for (the relay's reconcile re-sends
        # a message Redis refused or lost; jobs.broker.unanswered)
        if (
            publishes
            and not publish_job(
                job=job, task=task, options=options, mark_published=not marked, answered=not marked
            )
            and marked
        ):
            ledger.unpublish(job.id)  # the broker is away: the relay publishes it
        _announce(job)

    on_commit_or_now(on_commit, accepted)
    # a row a Task.replace() took over (task_id given) keeps the enqueued_at of the job replaced
    return JobHandle(
        id=str(job.id), task_name=task.name, enqueued_at=now if task_id is None else None
    )


def _announce(job: Job) -> None:
    events.send(
        events.job_enqueued,
        task=job.task_name,
        job_id=str(job.id),
        queue=job.queue,
        priority=job.priority,
        scheduled_for=job.scheduled_for,
        owner_id=job.owner_id,
    )


def _publish_untracked(job: Job, task: Enqueueable, options: Mapping[str, Any] | None) -> None:
    """An untracked job has no ledger row to wait in: a broker outage is the caller's error."""
    if not publish_job(job=job, task=task, options=options):
        raise BrokerUnavailable(f"Broker unavailable: untracked job {task.name} was not sent")
    _announce(job)
