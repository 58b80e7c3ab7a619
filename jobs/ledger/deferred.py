"""The deferred claim (DEFER_CLAIM): a short job's run writes the ledger once, at its finish.

A delivery reads its row (`peek`, no write) and records the run in Redis
(jobs.broker.running); the run's success is then one UPDATE from the waiting state it read to
succeeded (`succeed_unclaimed`), fenced by that state and attempt count: a row another run
claimed, a cancel or a finish changed since the read is not written. A run that needs its
claim row (it outlives its first lease interval, calls progress(), an effect, a step, enqueues
a child, or fails) writes it first (`claim_deferred`), and from there is an ordinary claimed
run (jobs.ledger.run). A run that vanished before either write is recorded by the next
delivery (`run_lost`): running under a lapsed lease, which that delivery's claim takes over
and counts as a crash.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from jobs.core.states import sources, target
from jobs.ledger.busy import busy_retried
from jobs.ledger.claim import EARLY_TOLERANCE, Claim
from jobs.models import Job

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peeked:
    """A waiting row as a delivery read it: what the run needs, and the fence of its writes."""

    claim: Claim
    attempts: int  # the row's attempt count when read: the deferred writes match it
    # Not read: a fresh first message's row is known to wait with no attempt (jobs.broker.running)
    assumed: bool = False


def unread(*, job_id: str, token: str, max_attempts: int, owner_id: int | None) -> Peeked:
    """What peek() would read of the row of a fresh first message (jobs.broker.running.fresh),
    without reading it: waiting, no attempt yet; the deferred writes are fenced by that."""
    claim = Claim(str(job_id), 1, max_attempts, [], owner_id, str(token))
    return Peeked(claim, 0, assumed=True)


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


@functools.cache
def _fields() -> dict[str, Any]:
    return {f.name: f for f in Job._meta.fields}


def _db(name: str, value: Any, db: Any = connection) -> Any:
    return _fields()[name].get_db_prep_save(value, db)


def _id(job_id: str, db: Any = connection) -> Any:
    return Job._meta.pk.get_db_prep_value(uuid.UUID(str(job_id)), db)


def _states(event: str) -> tuple[str, list[str]]:
    states = [str(s) for s in sources(event)]
    return ", ".join(["%s"] * len(states)), states


def peek(*, job_id: str, token: str) -> Peeked | None:
    """The row of `job_id` if a delivery may run it without writing its claim first: waiting,
    due, not asked to stop, in no batch. None otherwise (the claim path decides)."""
    sql = (
        f"SELECT {_q('state')}, {_q('attempts')}, {_q('max_attempts')}, {_q('failures')}, "
        f"{_q('owner_id')}, {_q('scheduled_for')}, {_q('cancel_requested_at')}, "
        f"{_q('batch_id')} FROM {_q(Job._meta.db_table)} WHERE {_q('id')} = %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [_id(job_id)])
        row = cursor.fetchone()
    if row is None:
        return None
    state, attempts, max_attempts, failures, owner_id, scheduled_for, cancel, batch_id = row
    if state not in sources("claim_deferred") or cancel is not None or batch_id is not None:
        return None
    if scheduled_for is not None and _aware(scheduled_for) > timezone.now() + EARLY_TOLERANCE:
        return None
    if isinstance(failures, (str, bytes)):
        failures = json.loads(failures)
    claim = Claim(
        str(job_id), attempts + 1, max_attempts, list(failures or []), owner_id, str(token)
    )
    return Peeked(claim, attempts)


def _aware(value: datetime | str) -> datetime:
    """A timestamp column as read by a raw cursor: a datetime (PostgreSQL), or SQLite's text
    of a naive UTC time."""
    when = value if isinstance(value, datetime) else parse_datetime(value)
    if when is None:
        raise ValueError(f"not a timestamp: {value!r}")
    return when if timezone.is_aware(when) else when.replace(tzinfo=UTC)


@functools.cache  # per vendor: the quoting is the connection's
def _claim_sql(vendor: str, event: str, extra: str = "") -> str:
    placeholders, _ = _states(event)
    return (
        f"UPDATE {_q(Job._meta.db_table)} SET {_q('state')} = %s, "
        f"{_q('attempts')} = {_q('attempts')} + 1, {_q('deliveries')} = {_q('deliveries')} + 1, "
        f"{_q('started_at')} = COALESCE({_q('started_at')}, %s), {_q('last_started_at')} = %s, "
        f"{_q('lease_expires_at')} = %s, {_q('lease_owner')} = %s{extra} "
        f"WHERE {_q('id')} = %s AND {_q('state')} IN ({placeholders}) AND {_q('attempts')} = %s"
    )


def _execute(sql: str, params: list[Any], db: Any = connection) -> int:
    with db.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


@busy_retried  # SQLite's "database is locked" is waited out
def claim_deferred(
    *, job_id: str, attempts: int, lease_owner: str, started: datetime, lease_seconds: float
) -> bool:
    """The run writes the claim it deferred: from the waiting state it read to running, with
    its token and a lease from now. False when the row changed since (cancelled, finished,
    claimed by another run): the run has lost its job."""
    now = timezone.now()
    _, states = _states("claim_deferred")
    params = [
        str(target("claim_deferred")),
        _db("started_at", started),
        _db("last_started_at", started),
        _db("lease_expires_at", now + timedelta(seconds=lease_seconds)),
        _db("lease_owner", uuid.UUID(str(lease_owner))),
        _id(job_id),
        *states,
        int(attempts),
    ]
    return bool(_execute(_claim_sql(connection.vendor, "claim_deferred"), params))


@busy_retried  # SQLite's "database is locked" is waited out
def run_lost(*, job_id: str, lease_owner: str) -> bool:
    """A run that started without writing its claim and vanished (its Redis record lapsed):
    recorded as the claim it would have written, under a lease that has lapsed, so that the
    delivery's claim that follows takes it over and counts the crash (jobs.ledger.claim)."""
    now = timezone.now()
    placeholders, states = _states("run_lost")
    sql = (
        f"UPDATE {_q(Job._meta.db_table)} SET {_q('state')} = %s, "
        f"{_q('attempts')} = {_q('attempts')} + 1, "
        f"{_q('started_at')} = COALESCE({_q('started_at')}, %s), {_q('last_started_at')} = %s, "
        f"{_q('lease_expires_at')} = %s, {_q('lease_owner')} = %s "
        f"WHERE {_q('id')} = %s AND {_q('state')} IN ({placeholders})"
    )
    params = [
        str(target("run_lost")),
        _db("started_at", now),
        _db("last_started_at", now),
        _db("lease_expires_at", now - timedelta(seconds=1)),
        _db("lease_owner", uuid.UUID(str(lease_owner))),
        _id(job_id),
        *states,
    ]
    return bool(_execute(sql, params))


@dataclass(frozen=True)
class Success:
    """One unclaimed run's success, as succeed_unclaimed takes it (written with others)."""

    job_id: str
    attempts: int
    lease_owner: str
    started: datetime
    finished: datetime
    run_seconds: float
    result: Any = None


@busy_retried  # SQLite's "database is locked" is waited out
def succeed_unclaimed(
    *,
    job_id: str,
    attempts: int,
    lease_owner: str,
    started: datetime,
    run_seconds: float,
    result: Any = None,
) -> bool:
    """A run that never wrote its claim succeeded: from the waiting state it read to
    succeeded in one UPDATE (the claim's columns and the finish's). False when the row changed
    since the delivery read it: nothing is written."""
    db = connections[DEFAULT_DB_ALIAS]  # `connection`, resolved once (jobs.ledger.accept)
    success = Success(job_id, attempts, lease_owner, started, timezone.now(), run_seconds, result)
    params = _succeed_params(_success_row(success, db), db)
    return bool(_execute(_succeed_sql(db.vendor), params, db))


@busy_retried  # SQLite's "database is locked" is waited out
def succeed_unclaimed_many(successes: list[Success]) -> set[str]:
    """The successes of several unclaimed runs in one statement (PostgreSQL: an UPDATE from
    VALUES) or one transaction (SQLite), each fenced as succeed_unclaimed fences one: the ids
    written; a row that changed since its delivery read it is not."""
    if not successes:
        return set()
    db = connections[DEFAULT_DB_ALIAS]
    rows = [_success_row(s, db) for s in successes]
    if db.vendor != "postgresql":
        with transaction.atomic(using=db.alias):
            return {
                s.job_id
                for s, row in zip(successes, rows, strict=True)
                if _execute(_succeed_sql(db.vendor), _succeed_params(row, db), db)
            }
    _, states = _states("succeed_unclaimed")
    params = [str(target("succeed_unclaimed")), *[v for row in rows for v in row], *states]
    with db.cursor() as cursor:
        cursor.execute(_succeed_many_sql(len(rows)), params)
        return {str(found) for (found,) in cursor.fetchall()}


def _success_row(s: Success, db: Any) -> list[Any]:
    """A success's values as the database takes them: id, attempts, token, start, end, run
    seconds, result (None when it is not JSON)."""
    return [
        _id(s.job_id, db),
        int(s.attempts),
        _db("lease_owner", uuid.UUID(str(s.lease_owner)), db),
        _db("started_at", s.started, db),
        _db("finished_at", s.finished, db),
        _db("run_seconds", s.run_seconds, db),
        _db("result", _json_or_none(s.job_id, s.result), db),
    ]


def _json_or_none(job_id: str, result: Any) -> Any:
    try:
        json.dumps(result, cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        logger.warning("Job %s returned a value that is not JSON; its result is not stored", job_id)
        return None
    return result


def _succeed_params(row: list[Any], db: Any) -> list[Any]:
    """succeed_unclaimed's parameters from a row of succeed_unclaimed_many's."""
    job_id, attempts, owner, started, finished, run_seconds, result = row
    _, states = _states("succeed_unclaimed")
    params = [str(target("succeed_unclaimed")), started, started, None, owner, finished]
    return [*params, run_seconds, "", result, job_id, *states, attempts]


@functools.cache  # per number of rows: PostgreSQL's statement
def _succeed_many_sql(count: int) -> str:
    placeholders, _ = _states("succeed_unclaimed")
    q = _q
    types = ("uuid", "integer", "uuid", "timestamptz", "timestamptz", "double precision", "jsonb")
    row = f"({', '.join(f'%s::{kind}' for kind in types)})"
    return (
        f"UPDATE {q(Job._meta.db_table)} AS j SET {q('state')} = %s, "
        f"{q('attempts')} = j.{q('attempts')} + 1, {q('deliveries')} = j.{q('deliveries')} + 1, "
        f"{q('started_at')} = COALESCE(j.{q('started_at')}, v.started), "
        f"{q('last_started_at')} = v.started, {q('lease_expires_at')} = NULL, "
        f"{q('lease_owner')} = v.owner, {q('finished_at')} = v.finished, "
        f"{q('run_seconds')} = v.run_seconds, {q('error')} = '', {q('result')} = v.result "
        f"FROM (VALUES {', '.join([row] * count)}) "
        "AS v(id, attempts, owner, started, finished, run_seconds, result) "
        f"WHERE j.{q('id')} = v.id AND j.{q('state')} IN ({placeholders}) "
        f"AND j.{q('attempts')} = v.attempts RETURNING j.{q('id')}"
    )


@functools.cache  # per vendor: the quoting is the connection's
def _succeed_sql(vendor: str) -> str:
    extra = (
        f", {_q('finished_at')} = %s, {_q('run_seconds')} = %s, {_q('error')} = %s, "
        f"{_q('result')} = %s"
    )
    return _claim_sql(vendor, "succeed_unclaimed", extra)
