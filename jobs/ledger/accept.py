"""Writes that accept jobs into the ledger and keep its outbox: new rows (one, with a caller's
row alongside, one holding an idempotency key; many by COPY: jobs.ledger.bulk), published marks,
and the relay's resets."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import F, Q
from django.utils import timezone

from jobs.core.states import JobState, sources, target
from jobs.ledger import alongside as companion
from jobs.ledger import binding
from jobs.ledger.run import Defaults, give_up
from jobs.ledger.values import insert_values
from jobs.models import DeadLetter, IdempotencyRecord, Job

logger = logging.getLogger(__name__)


# --- enqueue: a new row, queued or scheduled -----------------------------------------------
def insert(job: Job, alongside: Any = None) -> None:
    """A new job (queued, or scheduled for later): one INSERT, atomic on its own.

    The statement is built once per database and set of columns, and the row's values prepared
    as Model.save(force_insert=True) prepares them (jobs.ledger.values), without the ORM's
    per-call query compilation (two thirds of an enqueue's Python work, measured). A nullable
    column whose value is None is left out (its column defaults to NULL): 15 of Job's 35 at a
    plain enqueue, each a value prepared and bound for nothing. On PostgreSQL the values are
    bound on the server (jobs.ledger.binding). Job has no pre_save/post_save receivers of the
    platform's; the documented hook is events.job_enqueued, sent after commit.

    `alongside`: the caller's new row, inserted with the job (jobs.ledger.alongside): on
    PostgreSQL in this same statement, elsewhere just before it in one transaction."""
    db = connections[DEFAULT_DB_ALIAS]  # `connection`, resolved once (see insert_values)
    if alongside is not None and db.vendor != "postgresql":
        with transaction.atomic(savepoint=False):
            companion.insert_alone(alongside, db)
            insert(job)
        return
    columns, values = insert_values(job, db)
    with binding.cursor(db) as cursor:
        if alongside is None:
            cursor.execute(_insert_sql(db.vendor, columns), values)
        else:
            row_fields, row_values = companion.values(alongside, db)
            model: Any = type(alongside)
            sql = _with_row_sql(model, row_fields, _insert_sql(db.vendor, columns))
            cursor.execute(sql, [*row_values, *values])
            companion.saved(alongside, cursor.fetchone()[0], db)
    job._state.adding = False
    job._state.db = db.alias


@functools.lru_cache(maxsize=64)
def _with_row_sql(model: Any, row_fields: tuple[Any, ...], job_sql: str) -> str:
    """PostgreSQL: the caller's row as a CTE of the job's INSERT, which returns its key."""
    caller, pk = _caller_cte(model, row_fields)
    return f"WITH {caller} {job_sql} RETURNING (SELECT {pk} FROM caller)"


def _caller_cte(model: Any, row_fields: tuple[Any, ...]) -> tuple[str, str]:
    """The CTE `caller` inserting the caller's row (PostgreSQL), and its key's quoted column."""
    pk = connection.ops.quote_name(model._meta.pk.column)
    return f"caller AS ({companion.insert_sql(model, row_fields, 'postgresql')})", pk


@functools.lru_cache(maxsize=64)
def _insert_sql(vendor: str, columns: tuple[str, ...]) -> str:
    quote = connection.ops.quote_name
    names = ", ".join(quote(column) for column in columns)
    marks = ", ".join(["%s"] * len(columns))
    return f"INSERT INTO {quote(Job._meta.db_table)} ({names}) VALUES ({marks})"


def insert_holding_key(
    *, job: Job, key: str, ttl: timedelta, now: datetime, alongside: Any = None
) -> Job | None:
    """Insert `job` holding the idempotency `key`, or return the job that already holds it.
    The caller's row `alongside` (see insert) is inserted in either case.

    Runs in the caller's transaction (or its own). The key's row goes first, `INSERT ... ON
    CONFLICT DO NOTHING`: a new key inserts it and then the job (the record's foreign key is
    checked at commit), an existing one inserts nothing, so no savepoint is needed to survive
    the conflict (two round trips inside a transaction where the savepoints and the ORM's saves
    took six; on PostgreSQL both INSERTs are one statement, _insert_with_record). A concurrent
    enqueue of the same key waits on the key's index entry until the first commits (then finds
    it held) or rolls back (then inserts it).
    """
    scoped = f"{job.task_name}:{key}"
    if connection.vendor == "postgresql" and _insert_with_record(job, scoped, now, alongside):
        return None
    with transaction.atomic(savepoint=False):
        if connection.vendor != "postgresql":
            if alongside is not None:
                companion.insert_alone(alongside, connections[DEFAULT_DB_ALIAS])
            with connection.cursor() as cursor:
                cursor.execute(_record_sql(connection.vendor), _record_values(scoped, job.id, now))
                taken = cursor.rowcount == 1
            if taken:
                insert(job)
                return None
        # Lock the record alone: a join would let PostgreSQL drop the row when another enqueue
        # re-points it to a new job while we wait for the lock.
        record = IdempotencyRecord.objects.select_for_update(of=("self",)).get(key=scoped)
        if record.holds(ttl, now):
            return record.job
        # The holder is dead or its success has expired: this enqueue takes the key over.
        insert(job)
        record.job = job
        record.created_at = now
        record.save(update_fields=["job", "created_at"])
        return None


def _insert_with_record(job: Job, key: str, now: datetime, alongside: Any = None) -> bool:
    """PostgreSQL: the key's record and the job in one statement (the record's INSERT ... ON
    CONFLICT DO NOTHING as a CTE, the job's row inserted only when it took the key), atomic on
    its own: one round trip where two were (and, outside a transaction, no BEGIN and COMMIT
    around them). False, with nothing written, when the key is held: the caller then looks at
    its holder. A concurrent enqueue of the key waits on its index entry, as before. The
    caller's row `alongside` is a third CTE of it, inserted whether or not the key was taken."""
    db = connections[DEFAULT_DB_ALIAS]
    columns, values = insert_values(job, db)
    record = _record_values(key, job.id, now)
    with binding.cursor(db) as cursor:
        if alongside is None:
            cursor.execute(_insert_with_record_sql(columns), [*record, *values])
            taken = cursor.rowcount == 1
        else:
            row_fields, row_values = companion.values(alongside, db)
            sql = _insert_with_record_sql(columns, (type(alongside), row_fields))
            cursor.execute(sql, [*row_values, *record, *values])
            pk, taken = cursor.fetchone()
            companion.saved(alongside, pk, db)
    if taken:
        job._state.adding = False
        job._state.db = db.alias
    return taken


@functools.lru_cache(maxsize=64)
def _insert_with_record_sql(
    columns: tuple[str, ...], alongside: tuple[Any, tuple[Any, ...]] | None = None
) -> str:
    quote = connection.ops.quote_name
    names = ", ".join(quote(column) for column in columns)
    marks = ", ".join(["%s"] * len(columns))
    job = (
        f"INSERT INTO {quote(Job._meta.db_table)} ({names}) "
        f"SELECT {marks} WHERE EXISTS (SELECT FROM record)"
    )
    record = f"record AS ({_record_sql('postgresql')} RETURNING 1)"
    if alongside is None:
        return f"WITH {record} {job}"
    caller, pk = _caller_cte(*alongside)
    return (
        f"WITH {caller}, {record}, job AS ({job} RETURNING 1) "
        f"SELECT (SELECT {pk} FROM caller), EXISTS (SELECT FROM job)"
    )


def _record_values(key: str, job_id: uuid.UUID, now: datetime) -> list[Any]:
    fields = _record_fields()
    values = (key, job_id, now)
    return [
        field.get_db_prep_save(value, connection)
        for field, value in zip(fields, values, strict=True)
    ]


@functools.cache
def _record_fields() -> tuple[Any, ...]:
    """The record's key, job and created_at fields, in the order of _record_sql's columns."""
    by_name = {f.name: f for f in IdempotencyRecord._meta.concrete_fields}
    return (by_name["key"], by_name["job"], by_name["created_at"])


@functools.cache
def _record_sql(vendor: str) -> str:
    quote = connection.ops.quote_name
    key, job, created_at = _record_fields()
    columns = ", ".join(quote(f.column) for f in (key, job, created_at))
    return (
        f"INSERT INTO {quote(IdempotencyRecord._meta.db_table)} ({columns}) VALUES (%s, %s, %s) "
        f"ON CONFLICT ({quote(key.column)}) DO NOTHING"
    )


# --- published marks (the outbox) ----------------------------------------------------------
def mark_published(
    job_ids: Iterable[str | uuid.UUID], *, now: datetime | None = None, attempts: int | None = None
) -> int:
    """The broker took these jobs' messages: they leave the outbox (state unchanged).

    `attempts`: the runs each job had when its message was sent. A row claimed since (a run
    that may already have failed and put it back in the outbox for its retry) is not marked:
    where rows are marked after the broker's confirm (RabbitMQ), a fast worker can get there
    first, and the mark would hide the retry from the relay."""
    ids = list(job_ids)
    if len(ids) != 1:
        rows = Job.objects.filter(id__in=ids, state__in=sources("mark_published"))
        if attempts is not None:
            rows = rows.filter(attempts=attempts)
        return rows.update(published_at=now or timezone.now())
    # One job (every single enqueue): the same UPDATE, built once (see insert()).
    fields = Job._meta
    published = fields.get_field("published_at").get_db_prep_save(now or timezone.now(), connection)
    key = fields.pk.get_db_prep_save(uuid.UUID(str(ids[0])), connection)
    params = [published, key, *_published_from()]
    if attempts is not None:
        params.append(attempts)
    with connection.cursor() as cursor:
        cursor.execute(_published_sql(connection.vendor, attempts is not None), params)
        return int(cursor.rowcount)


@functools.cache
def _published_from() -> tuple[str, ...]:
    return tuple(sources("mark_published"))


@functools.cache
def _published_sql(vendor: str, fenced: bool) -> str:
    quote = connection.ops.quote_name
    states = ", ".join(["%s"] * len(_published_from()))
    fence = f" AND {quote('attempts')} = %s" if fenced else ""
    return (
        f"UPDATE {quote(Job._meta.db_table)} SET {quote('published_at')} = %s "
        f"WHERE {quote('id')} = %s AND {quote('state')} IN ({states}){fence}"
    )


def unpublish(*job_ids: str | uuid.UUID) -> int:
    """Back into the outbox: waiting jobs whose message their publisher could not hand over
    (state unchanged, published_at cleared); the relay publishes them when they are due."""
    rows = Job.objects.filter(id__in=job_ids, state__in=sources("republish"))
    return rows.update(published_at=None)


def lapsed_leases_requeued(*, now: datetime, max_crashes: int | None = None) -> int:
    """From running to queued: jobs whose worker stopped renewing (died, lost its host), each
    lapse counted as a crash. With `max_crashes`, a job at its last allowed crash is left for
    lapsed_lease_dead."""
    lapsed: dict[str, Any] = {
        "state__in": sources("lease_lapsed"),
        "lease_expires_at__lt": now,
    }
    if max_crashes is not None:
        lapsed["crashes__lt"] = max_crashes - 1
    return Job.objects.active_where(**lapsed).update(
        state=target("lease_lapsed"),
        lease_expires_at=None,
        published_at=None,
        crashes=F("crashes") + 1,
    )


def lapsed_lease_dead(*, job_id: str, now: datetime, exc: BaseException) -> DeadLetter | None:
    """From running to dead, with its dead letter: a job whose lease lapsed once too often
    (its worker was lost that many times running it); None if it renewed, was claimed or
    finished meanwhile."""
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .filter(id=job_id, state__in=sources("lease_lapsed"), lease_expires_at__lt=now)
            .first()
        )
        if job is None:
            return None
        Job.objects.filter(id=job_id).update(crashes=F("crashes") + 1)
        return give_up(
            job_id=job_id,
            defaults=Defaults(job.task_name, job.queue, job.priority),
            args=job.args,
            kwargs=job.kwargs,
            attempt=job.attempts,
            exc=exc,
            failures=list(job.failures or []),
        )


def waiting_but_due(now: datetime, lost_after: timedelta, **fields: Any) -> Any:
    """Jobs that wait for a worker and may run now: queued, or scheduled/retrying whose time
    came more than `lost_after` ago; `fields` narrow them by the columns jobs_activejob
    copies (Job.objects.active_where)."""
    return Job.objects.active_where(
        Q(state=JobState.QUEUED)
        | Q(state__in=(JobState.SCHEDULED, JobState.RETRYING), scheduled_for__lt=now - lost_after),
        **fields,
    )


def republish(
    *,
    now: datetime,
    published_before: datetime,
    lost_after: timedelta,
    queue: str | None = None,
    job_ids: Iterable[Any] | None = None,
) -> int:
    """Back into the outbox: waiting jobs published before `published_before` whose message
    the broker lost (state unchanged, published_at cleared); only `job_ids` when given."""
    narrow: dict[str, Any] = {"state__in": sources("republish")}
    if queue is not None:
        narrow["queue"] = queue
    rows = waiting_but_due(now, lost_after, published_at__lt=published_before, **narrow)
    if job_ids is not None:
        rows = rows.filter(id__in=list(job_ids))
    return rows.update(published_at=None)
