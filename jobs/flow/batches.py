"""Batches: jobs followed as one, with callbacks that fire exactly once.

    with jobs.batch(description="March invoices", on_success=notify.s("done"),
                    on_complete=report.s(), on_death=page.s()) as b:
        for invoice in invoices:
            invoice_send.enqueue(invoice.pk)

Every job enqueued inside the block (enqueue, enqueue_many, .delay/.apply_async, a canvas)
joins the batch, and the block is one transaction (a savepoint inside the caller's): all the
members are accepted, with the batch's counters, or none. Each member's finish moves the
counters in its own transaction (jobs.ledger.batch), so they cannot drift, and the finish
that ends the last member writes the callback's job in that transaction too, under an id
derived from the batch: exactly once across redelivered finishes, dead workers and relays.
A callback is called with the batch id first, then the signature's own arguments; its job
belongs to the batch's owner and is a child of the job that opened the batch, if any. The
same signature given as on_complete and on_success runs once when both are due together (a
batch whose members all succeeded), and again only on a later success.

- on_complete: every member ended (succeeded, dead or cancelled) and every child batch
  completed.
- on_success: every member and every child batch succeeded; may come after on_complete, when
  the dead members are replayed from the dead letters and succeed.
- on_death: the first time a member is dead-lettered.

A running member adds jobs to its own batch with ``with jobs.batch(jobs.current_batch()):``;
a batch opened inside a running member (or inside another batch's block) is a child: its
parent completes only after it. An empty batch completes, and succeeds, at once.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import transaction

from jobs.core import context, events
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import BacklotError, UnknownTask
from jobs.core.options import check_priority, check_queue
from jobs.core.payload import payload_check
from jobs.core.states import ACTIVE_STATES, JobState
from jobs.enqueue.publish import publish_job
from jobs.enqueue.routing import job_queue
from jobs.flow.cancellation import cancel_many
from jobs.flow.deadletters import BulkOutcome, dead_letter_replay_many
from jobs.ledger import batch as batch_ledger
from jobs.models import CALLBACK_KINDS, Batch, BatchState, DeadLetter, DeadLetterStatus, Job
from jobs.worker.registry import task_by_name

logger = logging.getLogger(__name__)


class BatchEnded(BacklotError):
    """Jobs cannot join a batch that has ended (complete or succeeded): open a new one."""


def _batch_id(value: Batch | str | uuid.UUID) -> uuid.UUID:
    raw = value.id if isinstance(value, Batch) else value
    try:
        return uuid.UUID(str(raw))
    except ValueError:
        raise ValueError(f"{raw!r} is not a batch id") from None


def _callback(kind: str, signature: Any) -> dict[str, Any] | None:
    """A callback signature (``some_job.s(...)``, or the job itself) as the batch keeps it:
    the job's row is written from this when the callback fires."""
    if signature is None:
        return None
    name = getattr(signature, "task", None)
    if not isinstance(name, str):  # a task object, not a signature
        name = getattr(signature, "name", None)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        options: dict[str, Any] = {}
    else:
        args = list(signature.args or ())
        kwargs = dict(signature.kwargs or {})
        options = dict(signature.options or {})
    if not isinstance(name, str):
        raise TypeError(
            f"{kind} must be a job signature (some_job.s(...)) or a job, got {signature!r}"
        )
    task = task_by_name(name)
    if not task.track:
        raise ValueError(f"{kind}: {name} has track=False; a batch callback needs the job ledger")
    payload_check(
        task_name=name,
        args=[str(uuid.uuid4()), *args],
        kwargs=kwargs,
        max_bytes=backlot_settings().MAX_PAYLOAD_BYTES,
    )
    priority = options.get("priority")
    running = context.running_job()
    return {
        "parent": running.job_id if running else None,
        "task": name,
        "args": args,
        "kwargs": kwargs,
        "queue": check_queue(job_queue(task, args, kwargs, options.get("queue"))),
        "priority": check_priority(task.default_priority if priority is None else priority),
        "max_attempts": task.policy.max_attempts,
    }


def _running_member_batch() -> uuid.UUID | None:
    """The batch of the job running in this process, if it is a member of one."""
    running = context.running_job()
    if running is None:
        return None
    batch_id: uuid.UUID | None = (
        Job.objects.filter(id=running.job_id).values_list("batch_id", flat=True).first()
    )
    return batch_id


def current_batch() -> Batch | None:
    """Inside a running job: the batch it is a member of (None outside one, or for a job in
    no batch). ``with jobs.batch(jobs.current_batch()):`` adds jobs to it."""
    batch_id = _running_member_batch()
    return None if batch_id is None else Batch.objects.filter(id=batch_id).first()


@contextmanager
def batch(
    existing: Batch | str | uuid.UUID | None = None,
    *,
    description: str = "",
    on_success: Any = None,
    on_complete: Any = None,
    on_death: Any = None,
    owner: Any = None,
) -> Iterator[Batch]:
    """Open a batch (or, given one, add to it): jobs enqueued inside the block join it, in one
    transaction with the batch's counters. Yields the batch row (its counters as of the end
    of the block once it has ended)."""
    if existing is not None:
        if description or owner is not None or any((on_success, on_complete, on_death)):
            raise ValueError(
                "jobs.batch(existing) adds jobs to a batch; its description, owner and "
                "callbacks were set when it was opened"
            )
        with _reopened(_batch_id(existing)) as row:
            yield row
        return
    callbacks = {
        kind: spec
        for kind, spec in (
            ("on_success", _callback("on_success", on_success)),
            ("on_complete", _callback("on_complete", on_complete)),
            ("on_death", _callback("on_death", on_death)),
        )
        if spec is not None
    }
    enclosing = context.joining_batch()
    parent_id = uuid.UUID(enclosing.batch_id) if enclosing else _running_member_batch()
    user = owner if getattr(owner, "pk", None) else context.acting_user()
    running = context.running_job()
    owner_id = user.pk if user is not None else (running.owner_id if running else None)
    with transaction.atomic():
        row = Batch(
            description=str(description)[:255],
            owner_id=owner_id,
            parent_id=parent_id,
            callbacks=callbacks,
        )
        batch_ledger.opened(row)
        if parent_id is not None and not batch_ledger.child_opened(parent_id=parent_id):
            raise BatchEnded(f"Batch {parent_id} has ended: a child batch cannot open in it")
        joining = context.JoiningBatch(str(row.id))
        with context.joining(joining):
            yield row
        batch_ledger.members_added(
            batch_id=row.id, waiting=joining.added, cancelled=joining.born_cancelled
        )
        row.refresh_from_db()
        announced = {
            "batch_id": str(row.id),
            "description": row.description,
            "owner_id": row.owner_id,
            "parent_id": str(parent_id) if parent_id else None,
            "total": row.total,
        }
        transaction.on_commit(
            lambda: events.send(events.batch_opened, task=events.BATCH_SENDER, **announced)
        )


@contextmanager
def _reopened(batch_id: uuid.UUID) -> Iterator[Batch]:
    row = Batch.objects.filter(id=batch_id).first()
    if row is None:
        raise Batch.DoesNotExist(f"No batch {batch_id}")
    if row.state != BatchState.RUNNING:
        raise BatchEnded(f"Batch {batch_id} has ended ({row.state}); open a new batch")
    with transaction.atomic():
        joining = context.JoiningBatch(str(row.id))
        with context.joining(joining):
            yield row
        if (joining.added or joining.born_cancelled) and not batch_ledger.members_added(
            batch_id=row.id, waiting=joining.added, cancelled=joining.born_cancelled
        ):
            # It ended while the block ran: its members roll back with the block.
            raise BatchEnded(f"Batch {batch_id} ended meanwhile; nothing was added to it")
        row.refresh_from_db()


# --- callbacks reach the broker right after the finish that fired them commits ---------------
def _publish_callback(sender: str, *, callback_job_id: str | None = None, **_: Any) -> None:
    """Publish a callback's job (written by the finish that fired it); if this fails, or the
    process dies first, the relay publishes it from the outbox."""
    if callback_job_id is None:
        return
    job = Job.objects.filter(
        id=callback_job_id, state=JobState.QUEUED, published_at__isnull=True
    ).first()
    if job is None:
        return
    try:
        task = task_by_name(job.task_name)
    except UnknownTask:
        logger.error("Batch callback %s names unknown task %s", job.id, job.task_name)
        return
    publish_job(job=job, task=task)


for _signal in (events.batch_death, events.batch_completed, events.batch_succeeded):
    _signal.connect(_publish_callback, dispatch_uid=f"backlot-batch-callback-{id(_signal)}")


# --- operator actions -----------------------------------------------------------------------
def _tree(batch_id: uuid.UUID) -> list[uuid.UUID]:
    """The batch and its descendant batches."""
    found, frontier = [batch_id], [batch_id]
    while frontier:
        frontier = list(Batch.objects.filter(parent_id__in=frontier).values_list("id", flat=True))
        found += frontier
    return found


def batch_cancel(*, batch: Batch | str | uuid.UUID, by: Any = None) -> tuple[int, int]:
    """Cancel the members of the batch (and of its child batches) that have not ended, through
    jobs.cancel: a waiting one never runs, a running one is asked to stop. Returns (cancelled
    or asked to stop, already ended meanwhile). The batch completes once they have ended."""
    ids = _tree(_batch_id(batch))
    batch_ledger.cancel_requested(batch_id=ids[0])
    members = Job.objects.filter(batch_id__in=ids, state__in=ACTIVE_STATES).values_list(
        "id", flat=True
    )
    return cancel_many(list(members), by=by)


def batch_replay_dead(*, batch: Batch | str | uuid.UUID, by: Any = None) -> BulkOutcome:
    """Replay the batch's dead members (their unresolved dead letters) in bulk: each replay
    takes its dead member's place in the batch, which may then succeed."""
    ids = _tree(_batch_id(batch))
    return dead_letter_replay_many(
        queryset=DeadLetter.objects.filter(job__batch_id__in=ids, status=DeadLetterStatus.DEAD),
        by=by,
    )


__all__ = [
    "CALLBACK_KINDS",
    "Batch",
    "BatchEnded",
    "batch",
    "batch_cancel",
    "batch_replay_dead",
    "current_batch",
]
