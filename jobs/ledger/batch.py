"""Writes to batches, each in the transaction of the member's own write that causes it.

A member's finish (run.succeed, run.give_up, cancel.*) moves its batch's counters in one
UPDATE … SET pending = pending - 1 … RETURNING, in the finish's own transaction: the counters
cannot drift from the members' states, and the UPDATE's row lock orders the finishes of one
batch. A member's success that does not end its batch (on PostgreSQL, after this process's
claim) is one statement, the finish's UPDATE and the counters' (jobs.ledger.batch_finish, where
the finish writes' decorators live): one transaction, no lock held across a round trip. The
finish that ends the last member changes the batch's state (guarded by
jobs.core.states.BATCH_TRANSITIONS) and inserts the callback's job row in the same transaction,
with an id derived from the batch and the callback kind: it is written once however often a
finish is delivered, and it reaches the broker like any job — right after commit (a receiver
of the batch events in jobs.flow.batches publishes it), else from the outbox by the relay.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from jobs.core import events
from jobs.core.states import BatchState, JobState, batch_sources, sources
from jobs.models import Batch, DeadLetter, Job

logger = logging.getLogger(__name__)

# A callback's job id: one per batch and kind, so a second insert of it is a no-op.
CALLBACK_NAMESPACE = uuid.UUID("5b0c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3")

_COUNTERS = (
    "total",
    "pending",
    "succeeded",
    "dead",
    "cancelled",
    "children_pending",
    "children_unsucceeded",
)
_RETURNING = ("id", "state", *_COUNTERS, "died_at", "parent_id")
# What a member's end does to its batch's counters.
_ENDED = {
    JobState.SUCCEEDED: {"pending": -1, "succeeded": 1},
    JobState.DEAD: {"pending": -1, "dead": 1},
    JobState.CANCELLED: {"pending": -1, "cancelled": 1},
}


def callback_job_id(batch_id: Any, kind: str) -> uuid.UUID:
    """The job id of a batch's `kind` callback (on_success, on_complete, on_death)."""
    return uuid.uuid5(CALLBACK_NAMESPACE, f"{batch_id}:{kind}")


@dataclass(frozen=True)
class _Row:
    """A batch's counters as the UPDATE that moved them returned them."""

    id: uuid.UUID
    state: str
    total: int
    pending: int
    succeeded: int
    dead: int
    cancelled: int
    children_pending: int
    children_unsucceeded: int
    died_at: Any
    parent_id: Any


def db_value(value: Any) -> Any:
    return Batch._meta.pk.get_db_prep_value(uuid.UUID(str(value)), connection)


def _move(
    event: str, deltas: Mapping[str, int], *, batch_id: Any = None, job_id: Any = None
) -> _Row | None:
    """Add `deltas` to the counters of a batch (by id, or the batch of member `job_id`) in
    one UPDATE … RETURNING, if it is in a from-state of `event`; None otherwise."""
    quote = connection.ops.quote_name
    table = quote(Batch._meta.db_table)
    sets = ", ".join(f"{quote(c)} = {quote(c)} + %s" for c in deltas)
    states = batch_sources(event)
    if job_id is not None:
        where = (
            f"{quote('id')} = (SELECT {quote('batch_id')} FROM {quote(Job._meta.db_table)} "
            f"WHERE {quote('id')} = %s)"
        )
        key = db_value(job_id)
    else:
        where, key = f"{quote('id')} = %s", db_value(batch_id)
    sql = (
        f"UPDATE {table} SET {sets} WHERE {where} "
        f"AND {quote('state')} IN ({', '.join(['%s'] * len(states))}) "
        f"RETURNING {', '.join(quote(c) for c in _RETURNING)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*deltas.values(), key, *states])
        row = cursor.fetchone()
    if row is None:
        return None
    values = dict(zip(_RETURNING, row, strict=True))
    values["id"] = uuid.UUID(str(values["id"]))
    return _Row(**values)


# --- a batch opens, members join ------------------------------------------------------------
def opened(batch: Batch) -> None:
    """A new batch (running, no members yet): one INSERT in the opener's transaction."""
    batch.save(force_insert=True)


def members_added(*, batch_id: Any, waiting: int, cancelled: int = 0) -> bool:
    """Jobs joined the batch (written in this transaction): total and pending grow; False when
    the batch has ended meanwhile (the caller rolls the members back). A batch left with
    nothing pending (an empty one) completes here."""
    row = _move(
        "members_added",
        {"total": waiting + cancelled, "pending": waiting, "cancelled": cancelled},
        batch_id=batch_id,
    )
    if row is None:
        return False
    _settle(row, timezone.now())
    return True


def child_opened(*, parent_id: Any) -> bool:
    """A child batch opened in `parent_id`: the parent completes only after it."""
    return (
        _move(
            "child_opened", {"children_pending": 1, "children_unsucceeded": 1}, batch_id=parent_id
        )
        is not None
    )


# --- members end ----------------------------------------------------------------------------
def member_ended(*, job_id: Any, outcome: str, batch_id: Any = None) -> None:
    """A member ended (succeeded, dead or cancelled) in this transaction: its batch's counters
    move, and the batch completes when it was the last. No-op for a job not in a batch."""
    deltas = _ENDED[JobState(outcome)]
    if batch_id is not None:
        row = _move("member_ended", deltas, batch_id=batch_id)
    else:
        row = _move("member_ended", deltas, job_id=job_id)
    if row is not None:
        _settle(row, timezone.now(), died=str(job_id) if outcome == JobState.DEAD else None)


def waiting_members(job_ids: Iterable[Any]) -> Counter[Any]:
    """Of `job_ids`, the waiting members of a batch, locked, counted by batch: what a cancel of
    them is about to end (see members_cancelled)."""
    return Counter(
        Job.objects.select_for_update()
        .filter(id__in=list(job_ids), state__in=sources("cancel"), batch__isnull=False)
        .values_list("batch_id", flat=True)
    )


def members_cancelled(counts: Mapping[Any, int]) -> None:
    """Waiting members were cancelled in this transaction (`counts` per batch)."""
    now = timezone.now()
    for batch_id in sorted(counts, key=str):  # one order for every canceller: no deadlock
        n = counts[batch_id]
        row = _move("member_ended", {"pending": -n, "cancelled": n}, batch_id=batch_id)
        if row is not None:
            _settle(row, now)


def cancel_requested(*, batch_id: Any) -> None:
    """Someone cancelled the batch's members that had not ended (a mark for its page)."""
    Batch.objects.filter(id=batch_id, cancel_requested_at__isnull=True).update(
        cancel_requested_at=timezone.now()
    )


# --- a dead member replayed -----------------------------------------------------------------
def member_replayed(*, dead_letter: DeadLetter, job_id: Any) -> None:
    """A dead member's dead letter was replayed as job `job_id` (in this transaction): the new
    job takes its place in the batch, pending again."""
    original = dead_letter.job_id
    if original is None:
        return
    batch_id = Job.objects.filter(id=original).values_list("batch_id", flat=True).first()
    if batch_id is None:
        return
    if Job.objects.filter(id=job_id, batch__isnull=True).update(batch_id=batch_id):
        _move("member_replayed", {"dead": -1, "pending": 1}, batch_id=batch_id)


def members_replayed(*, members: Iterable[tuple[Any, Any]]) -> None:
    """Dead members were replayed in bulk: each (batch id, new job id) takes its dead
    member's place in that batch."""
    by_batch: dict[Any, list[Any]] = {}
    for batch_id, job_id in members:
        by_batch.setdefault(batch_id, []).append(job_id)
    for batch_id in sorted(by_batch, key=str):
        moved = Job.objects.filter(id__in=by_batch[batch_id], batch__isnull=True).update(
            batch_id=batch_id
        )
        if moved:
            _move("member_replayed", {"dead": -moved, "pending": moved}, batch_id=batch_id)


# --- the batch ends: state, callbacks, the parent -------------------------------------------
def _settle(row: _Row, now: datetime, *, died: str | None = None) -> None:
    """After a counter move (row locked by it): fire on_death for a first death; complete
    and/or succeed the batch when nothing is pending; tell the parent."""
    announced: list[tuple[Any, dict[str, Any]]] = []
    if (
        died is not None
        and row.died_at is None
        and Batch.objects.filter(
            id=row.id, died_at__isnull=True, state__in=batch_sources("first_death")
        ).update(died_at=now)
    ):
        announced.append(
            (
                events.batch_death,
                {"job_id": died, "callback_job_id": _fire(row.id, "on_death", now)},
            )
        )
    ended = row.pending == 0 and row.children_pending == 0
    if ended:
        was_running = row.state == BatchState.RUNNING
        clean = row.dead == 0 and row.cancelled == 0 and row.children_unsucceeded == 0
        completed = succeeded = False
        if clean:
            succeeded = bool(
                Batch.objects.filter(id=row.id, state__in=batch_sources("batch_succeed")).update(
                    state=BatchState.SUCCEEDED,
                    succeeded_at=now,
                    completed_at=Coalesce(F("completed_at"), Value(now)),
                )
            )
            completed = succeeded and was_running
        elif was_running:
            completed = bool(
                Batch.objects.filter(id=row.id, state__in=batch_sources("batch_complete")).update(
                    state=BatchState.COMPLETE, completed_at=now
                )
            )
        counters = {
            "total": row.total,
            "succeeded": row.succeeded,
            "dead": row.dead,
            "cancelled": row.cancelled,
        }
        if completed:
            cb = _fire(row.id, "on_complete", now)
            announced.append((events.batch_completed, {**counters, "callback_job_id": cb}))
        if succeeded:
            # the same callback as on_complete, due at the same moment, runs once (its job)
            cb = _fire(row.id, "on_success", now, unless_same_as="on_complete" if completed else "")
            announced.append((events.batch_succeeded, {**counters, "callback_job_id": cb}))
        if row.parent_id is not None and (completed or succeeded):
            deltas = {"children_pending": -1 if completed else 0}
            deltas["children_unsucceeded"] = -1 if succeeded else 0
            parent = _move("member_ended", deltas, batch_id=row.parent_id)
            if parent is not None:
                _settle(parent, now)
    if announced:
        batch_id = str(row.id)

        def send() -> None:
            for signal, arguments in announced:
                events.send(signal, task=events.BATCH_SENDER, batch_id=batch_id, **arguments)

        transaction.on_commit(send)


def _fire(batch_id: uuid.UUID, kind: str, now: datetime, unless_same_as: str = "") -> str | None:
    """Insert the job of the batch's `kind` callback (once: its id is derived from both);
    returns its id, or None when the batch has no such callback. With `unless_same_as`, a
    callback equal to that kind's (fired in the same transaction) is that kind's job."""
    batch = Batch.objects.only("callbacks", "owner_id").get(id=batch_id)
    callbacks = batch.callbacks or {}
    spec = callbacks.get(kind)
    if not spec:
        return None
    if unless_same_as and callbacks.get(unless_same_as) == spec:
        return str(callback_job_id(batch_id, unless_same_as))
    job = Job(
        id=callback_job_id(batch_id, kind),
        task_name=spec["task"],
        args=[str(batch_id), *spec.get("args", [])],
        kwargs=dict(spec.get("kwargs", {})),
        queue=spec["queue"],
        priority=spec["priority"],
        max_attempts=spec["max_attempts"],
        owner_id=batch.owner_id,
        # the job that opened the batch: a cancel of it reaches the callback (jobs.cancel)
        parent_id=spec.get("parent"),
        state=JobState.QUEUED,
        enqueued_at=now,
    )
    Job.objects.bulk_create([job], ignore_conflicts=True)
    return str(job.id)


# --- the finish writes that move a member's batch --------------------------------------------
