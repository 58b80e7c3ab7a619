"""Writes that resolve dead letters: replayed (one, or many in one UPDATE) or discarded, and
the lock a bulk replay takes on its rows first."""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

from django.db import connection
from django.db.models import Case, Exists, F, OuterRef, Subquery, When
from django.utils import timezone

from jobs.core.states import DeadLetterStatus
from jobs.ledger import batch
from jobs.ledger.steps import steps_copied
from jobs.models import DeadLetter, Job, JobStep
from jobs.models.step import StepState

logger = logging.getLogger(__name__)


def _user(by: Any) -> Any:
    return by if getattr(by, "pk", None) else None


# --- dead letters: replayed or discarded --------------------------------------------------
def dead_letter_replayed(*, dead_letter: DeadLetter, job_id: str | None, by: Any = None) -> None:
    """From dead to replayed: the dead letter points at its new job (locked by the caller)."""
    if job_id is not None:
        Job.objects.filter(id=job_id).update(replay_of=dead_letter)
        batch.member_replayed(dead_letter=dead_letter, job_id=job_id)
        # its finished steps are not run again (jobs.worker.steps)
        steps_copied(pairs=[(dead_letter.job_id_value, job_id)])
    DeadLetter.objects.filter(pk=dead_letter.pk, status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.REPLAYED,
        replayed_job_id=job_id,
        resolved_at=timezone.now(),
        resolved_by=_user(by),
    )


class DeadToReplay(NamedTuple):
    """A dead letter locked for a bulk replay, with what its replay needs."""

    pk: int
    task_name: str
    priority: int
    queue: str
    owner_id: int | None
    args: Any
    kwargs: Any
    batch_id: Any  # the dead job's batch, when it was a member (its replay goes back to it)
    steps_from: uuid.UUID | None  # the dead job, when it finished steps (its replay gets them)


def dead_letters_to_replay(*, pks: Sequence[int]) -> list[DeadToReplay]:
    """Those of dead letters `pks` still dead, locked for the caller's transaction; rows
    another operator holds are skipped (their replay is his).

    Tuples of the columns a replay reads, not model instances: instances with their owner
    joined, and a query each for the batch members and the finished steps, were half of a
    10,000-row bulk replay's time (cProfile). On PostgreSQL the pks go as one array: the ORM's
    IN of 1,000 placeholders cost the client more than the server's lock of the rows.

    On PostgreSQL the rows are found by primary key alone, and their status is read here, not
    in the WHERE: with `status = 'dead'` beside it, a planner whose statistics predate a burst
    of new dead letters (they count few dead rows) scans every unresolved dead letter through
    dl_status_idx for each chunk, comparing each with the chunk's 1,000 pks: 28 ms a chunk at
    10,000 unresolved, quadratic in their number. A row that is not dead any more stays locked
    until the chunk commits, unchanged."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_to_replay_sql(), [StepState.SUCCEEDED, list(pks)])
            loads = json.loads  # args and kwargs come as text, as JSONField reads them
            dead = DeadLetterStatus.DEAD
            return [
                DeadToReplay(pk, task, priority, queue, owner, loads(args), loads(kwargs), *rest)
                for pk, status, task, priority, queue, owner, args, kwargs, *rest in (
                    cursor.fetchall()
                )
                if status == dead
            ]
    finished = JobStep.objects.finished().filter(job_id=OuterRef("job_id_value"))
    rows = (
        DeadLetter.objects.select_for_update(skip_locked=True, of=("self",))
        .filter(pk__in=pks, status=DeadLetterStatus.DEAD)
        .annotate(steps_from=Case(When(Exists(finished), then=F("job_id_value"))))
        .order_by("pk")
        .values_list(
            "pk",
            "task_name",
            "priority",
            "queue",
            "owner_id",
            "args",
            "kwargs",
            "job__batch_id",
            "steps_from",
        )
    )
    return [DeadToReplay._make(row) for row in rows]


@functools.cache
def _to_replay_sql() -> str:
    q = connection.ops.quote_name
    columns = ", ".join(
        f"d.{q(name)}" for name in ("id", "status", "task_name", "priority", "queue", "owner_id")
    )
    finished = (
        f"SELECT FROM {q(JobStep._meta.db_table)} s "
        f"WHERE s.{q('job_id')} = d.{q('job_id_value')} AND s.{q('state')} = %s"
    )
    return (
        f"SELECT {columns}, d.{q('args')}::text, d.{q('kwargs')}::text, j.{q('batch_id')}, "
        f"CASE WHEN EXISTS ({finished}) THEN d.{q('job_id_value')} END "
        f"FROM {q(DeadLetter._meta.db_table)} d "
        f"LEFT JOIN {q(Job._meta.db_table)} j ON j.{q('id')} = d.{q('job_id')} "
        f"WHERE d.{q('id')} = ANY(%s) "
        f"ORDER BY d.{q('id')} FOR UPDATE OF d SKIP LOCKED"
    )


class Replayed(NamedTuple):
    """A dead letter replayed in bulk (locked by dead_letters_to_replay) and its new job."""

    pk: int
    job_id: str | None  # None when the task keeps no ledger row (track=False)
    steps_from: uuid.UUID | None  # the dead job whose finished steps the new job gets
    batch_id: Any  # the dead job's batch: the new job takes its place


def dead_letters_replayed(*, replays: Sequence[Replayed], by: Any = None) -> int:
    """From dead to replayed for many rows in one UPDATE, each pointing at its new job.

    The rows are dead_letters_to_replay's, locked and read dead in this transaction: on
    PostgreSQL the UPDATE finds them by primary key alone. The pks' `= ANY` beside the join on
    them is what makes it read them through the primary key: joined to the unnest only, or
    with a status condition beside it, each chunk's UPDATE read every dead letter (a hash of the
    table's sequential scan, or of every unresolved one through dl_status_idx when the
    statistics predate them)."""
    if not replays:
        return 0
    batch.members_replayed(
        members=[(r.batch_id, r.job_id) for r in replays if r.batch_id and r.job_id]
    )
    # each new job keeps its dead job's finished steps (jobs.worker.steps)
    steps_copied(pairs=[(r.steps_from, r.job_id) for r in replays if r.steps_from])
    now, user = timezone.now(), _user(by)
    if connection.vendor == "postgresql":
        pks = [r.pk for r in replays]
        # one array per column: the ORM's IN of 1,000 placeholders, and a subquery for each
        # row's new job, cost more on the client than the UPDATE on the server
        with connection.cursor() as cursor:
            cursor.execute(
                _replayed_sql(),
                [
                    DeadLetterStatus.REPLAYED,
                    now,
                    getattr(user, "pk", None),
                    array_text(pks),
                    array_text([r.job_id for r in replays]),
                    pks,  # psycopg's own array type (int2/4/8[]): the plan this was tuned with
                ],
            )
            return cursor.rowcount
    return DeadLetter.objects.filter(
        pk__in=[r.pk for r in replays], status=DeadLetterStatus.DEAD
    ).update(
        status=DeadLetterStatus.REPLAYED,
        replayed_job_id=Subquery(
            Job.objects.filter(replay_of_id=OuterRef("pk"))
            .order_by("-enqueued_at")
            .values("id")[:1]
        ),
        resolved_at=now,
        resolved_by=user,
    )


@functools.cache
def _replayed_sql() -> str:
    q = connection.ops.quote_name
    return (
        f"UPDATE {q(DeadLetter._meta.db_table)} d SET {q('status')} = %s, "
        f"{q('resolved_at')} = %s, {q('resolved_by_id')} = %s, {q('replayed_job_id')} = r.job "
        f"FROM unnest(%s::bigint[], %s::uuid[]) AS r(id, job) "
        f"WHERE d.{q('id')} = r.id AND d.{q('id')} = ANY(%s)"
    )


def array_text(values: Sequence[Any]) -> str:
    """A PostgreSQL array literal of ints or UUIDs ('{1,2,3}'), for a parameter the statement
    casts to its array type (unnest(%s::bigint[], %s::uuid[])). psycopg dumps a Python list
    element by element in Python: ~3 ms for a chunk's 1,000 ids (cProfile), the literal is one
    join. Not for `= ANY(%s)` beside a planner-sensitive scan: there psycopg picks the array's
    type from its values (int2[] for small pks), and a bigint[] literal made PostgreSQL's plan
    with stale statistics a sequential scan of the dead letters (the test of the chunk's lock,
    tests/jobs/flow/test_deadletter_bulk_replay.py). Only for values whose text needs no
    quoting (ints, UUIDs); None (a track=False task's job) is NULL."""
    return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"


def dead_letters_discarded(*, queryset: Any, by: Any = None) -> int:
    """From dead to discarded: an operator decided these will not run."""
    return queryset.filter(status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.DISCARDED, resolved_at=timezone.now(), resolved_by=_user(by)
    )
