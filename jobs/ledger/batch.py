"""Writes to batches, each in the transaction of the member's own write that causes it.

A member's finish (run.succeed, run.give_up, cancel.*) moves its batch's counters in one
UPDATE … SET pending = pending - 1 … RETURNING, in the finish's own transaction: the counters
cannot drift from the members' states, and the UPDATE's row lock orders the finishes of one
batch. A member's success that does not end its batch (on PostgreSQL, after this process's
claim) is one statement, the finish's UPDATE and the counters' (_FOLDED): one transaction, no
lock held across a round trip. The finish that ends the last member changes the batch's
state (guarded by jobs.states.BATCH_TRANSITIONS) and inserts the callback's job row in the same
transaction, with an id derived from the batch and the callback kind: it is written once
however often a finish is delivered, and it reaches the broker like any job — right after
commit (a receiver of the batch events in jobs.batches publishes it), else from the outbox by
the relay.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from django.db import connection, transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from .. import events
from ..models import Batch, DeadLetter, Job
from ..states import BatchState, DeadLetterStatus, JobState, batch_sources, sources

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


def _db(value: Any) -> Any:
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
        key = _db(job_id)
    else:
        where, key = f"{quote('id')} = %s", _db(batch_id)
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


def members_replayed(*, pks: Iterable[int]) -> None:
    """Dead letters `pks` were replayed in bulk (their new jobs point at them by replay_of):
    each new job takes its dead member's place in that member's batch."""
    by_batch: dict[Any, list[int]] = {}
    for pk, batch_id in DeadLetter.objects.filter(
        pk__in=list(pks), status=DeadLetterStatus.DEAD, job__batch__isnull=False
    ).values_list("pk", "job__batch_id"):
        by_batch.setdefault(batch_id, []).append(pk)
    for batch_id in sorted(by_batch, key=str):
        moved = Job.objects.filter(replay_of_id__in=by_batch[batch_id], batch__isnull=True).update(
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
P = ParamSpec("P")
R = TypeVar("R")


# The job this process claimed last, and its batch (None: in no batch). batch_id is written
# with the row and never changes, so the finish of that job, known to be in no batch, is its
# one UPDATE as before: no transaction and no batch statement for the jobs of no batch (measured
# on the loaded 2-core machine: +1.4 ms per finish, 3.3 -> 4.6 ms median, with them).
_claimed: ContextVar[tuple[str, Any] | None] = ContextVar("backlot_claimed_batch", default=None)


def claimed(*, job_id: Any, batch_id: Any) -> None:
    """A claim of `job_id` read its batch (run.claim)."""
    _claimed.set((str(job_id), batch_id))


def _claimed_batch(job_id: Any) -> tuple[bool, Any]:
    """(known, batch id) of `job_id` as this process's last claim read it: known is False for
    a job this process did not claim last (a finish without its claim: worker_lost, run_job of
    another process); batch id None for a job in no batch."""
    last = _claimed.get()
    if last is None or last[0] != str(job_id):
        return False, None
    return True, last[1]


# A member's success folded into one statement with its batch's counter move (PostgreSQL).
# Locks are taken in the order every other writer takes them, the job's row, then its batch's:
# `moved`'s one-time filter locks the member's row if the finish's fence holds (it then holds
# until commit), then `moved` moves the counters only when this end neither empties the batch
# nor finds it ended (its UPDATE re-reads the row it waited for), and the finish's own UPDATE
# runs only with that move. One statement is one transaction: both writes or neither, as the
# issue requires, and no row lock is held across a client round trip (the transaction path
# holds the batch's from its UPDATE to its COMMIT, one round trip later: the two pool
# processes of a worker finishing members of one batch queued on it there). When nothing was
# written the finish takes the transaction path, which settles the batch.
_FOLDED = """WITH moved AS (
    UPDATE {batches} SET {pending} = {pending} - 1, {counter} = {counter} + 1
    WHERE {id} = %s AND {state} IN ({states}) AND ({pending} > 1 OR {children_pending} > 0)
    AND EXISTS (SELECT 1 FROM {jobs} WHERE {fence} FOR UPDATE)
    RETURNING 1
)
{update} AND EXISTS (SELECT 1 FROM moved)"""

# The counter a member's end moves (besides pending), for the outcomes that may be folded.
_FOLDABLE = {JobState.SUCCEEDED: "succeeded"}


class _NotFoldable(Exception):
    """The finish write's first statement is not the UPDATE of the member's row: it is not
    run, and the finish takes the transaction path."""


class _Folding:
    """An execute wrapper (connection.execute_wrapper) around a member's finish write: its
    first statement, the UPDATE of the member's row, runs as _FOLDED (whose row count is that
    UPDATE's); any other first statement is not run."""

    def __init__(self, *, batch_id: Any, outcome: str) -> None:
        self.batch_key = _db(batch_id)
        self.counter = _FOLDABLE[JobState(outcome)]
        self.folded = False

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.folded:
            return execute(sql, params, many, context)
        quote = connection.ops.quote_name
        head = f"UPDATE {quote(Job._meta.db_table)} SET "
        assignments, where, fence = sql.partition(" WHERE ")
        if many or not sql.startswith(head) or not where or "%%" in sql:
            raise _NotFoldable(sql[:80])
        # Django's placeholders are %s (a literal % is %%, refused above); the SET's come first.
        setting = assignments.count("%s")
        states = batch_sources("member_ended")
        folded = _FOLDED.format(
            jobs=quote(Job._meta.db_table),
            batches=quote(Batch._meta.db_table),
            fence=fence,
            id=quote("id"),
            state=quote("state"),
            pending=quote("pending"),
            children_pending=quote("children_pending"),
            counter=quote(self.counter),
            states=", ".join(["%s"] * len(states)),
            # Django writes a WHERE of several terms in parentheses: one more AND binds to all.
            update=sql,
        )
        self.folded = True
        params = list(params)
        arguments = [self.batch_key, *states, *params[setting:], *params]
        return execute(folded, arguments, many, context)


def moves_batch(outcome: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """The decorated finish write (keyword `job_id`; a truthy return when it ended the job)
    moves its member's batch counters in the same transaction (member_ended).

    A job in no batch (as its claim in this process read) is its write alone. A member's
    success, on PostgreSQL, is one statement with the counter move (_FOLDED), unless it ends
    the batch; every other finish is a transaction of the write and member_ended."""

    def wrap(write: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(write)
        def finish(*args: P.args, **kwargs: P.kwargs) -> R:
            job_id = kwargs["job_id"]
            known, batch_id = _claimed_batch(job_id)
            if known and batch_id is None:
                return write(*args, **kwargs)
            if known and outcome in _FOLDABLE and connection.vendor == "postgresql":
                folding = _Folding(batch_id=batch_id, outcome=outcome)
                doomed = connection.needs_rollback
                try:
                    with connection.execute_wrapper(folding):
                        done = write(*args, **kwargs)
                except _NotFoldable as exc:
                    # nothing was sent: the caller's transaction is as it was (Django's
                    # update marked it for rollback when the wrapper raised)
                    if connection.in_atomic_block:
                        transaction.set_rollback(doomed)
                    logger.warning("%s of %s not folded: %s", write.__name__, job_id, exc)
                else:
                    if done:
                        return done
                # Not written: the batch's end is due (the transaction path settles it), the
                # batch had ended, or the run lost its claim (the write below says so again).
            with transaction.atomic():
                done = write(*args, **kwargs)
                if done:
                    member_ended(job_id=job_id, outcome=outcome, batch_id=batch_id)
            return done

        return finish

    return wrap


def cancels_members(write: Callable[[list[Any]], int]) -> Callable[[Iterable[Any]], int]:
    """The decorated cancel of waiting jobs runs in one transaction with their batches'
    counters: the members among them are locked first, then counted cancelled."""

    @functools.wraps(write)
    def cancel(job_ids: Iterable[Any]) -> int:
        ids = list(job_ids)
        with transaction.atomic():
            members = waiting_members(ids)
            cancelled = write(ids)
            members_cancelled(members)
        return cancelled

    return cancel


def members_of_batches(dead_letters: Iterable[DeadLetter]) -> set[int]:
    """The pks of those dead letters whose job is a member of a batch (its replay goes back to
    that batch: members_replayed)."""
    pks = [d.pk for d in dead_letters]
    if not pks:
        return set()
    return set(
        DeadLetter.objects.filter(pk__in=pks, job__batch__isnull=False).values_list("pk", flat=True)
    )
