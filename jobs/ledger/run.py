"""Writes of a worker's run after its claim (jobs.ledger.claim): renew, progress, and the
outcome (succeeded, retrying, released, dead with its dead letter). Each is fenced by the
attempt and the claim token of the run holding the claim: a run that lost its claim changes
nothing."""

from __future__ import annotations

import functools
import json
import logging
import traceback as traceback_module
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import DEFAULT_DB_ALIAS, connection, connections, transaction
from django.db.models import F, Field
from django.utils import timezone

from jobs.core.states import DeadLetterStatus, JobState, sources, target
from jobs.ledger import batch_finish
from jobs.ledger.busy import busy_retried
from jobs.models import DeadLetter, Job

logger = logging.getLogger(__name__)

# Failures the ledger keeps per job (the newest); older ones are summarized by the count.
MAX_FAILURES_KEPT = 20


def _held(job_id: str, attempt: int | None, event: str, lease_owner: str | None = None) -> Any:
    """The row, if the run of `attempt` (and of the claim `lease_owner`, when given) still
    holds it in a from-state of `event`: the fence of every write a run makes."""
    rows = Job.objects.filter(id=job_id, state__in=sources(event))
    if attempt is not None:
        rows = rows.filter(attempts=attempt)
    if lease_owner is not None:
        rows = rows.filter(lease_owner=lease_owner)
    return rows


def _update_held(
    job_id: str, attempt: int | None, event: str, lease_owner: str | None, **values: Any
) -> int:
    """`_held(...).update(**values)` for plain values (no expressions), as one statement built
    once per shape and its values prepared by each field, as QuerySet.update does, without the
    ORM's per-call query compilation: ~0.4 ms of a worker's Python work per finished job on
    this machine, the largest part after the database's own time (measured). Returns the
    number of rows written. Its SQL has Django's shape (batch_finish folds it)."""
    db = connections[DEFAULT_DB_ALIAS]  # `connection`, resolved once (jobs.ledger.accept)
    fields = [_concrete(name) for name in values]
    states = sources(event)
    sql = _held_update_sql(
        db.vendor,
        tuple(f.column for f in fields),
        len(states),
        attempt is not None,
        lease_owner is not None,
    )
    params = [f.get_db_prep_save(values[f.name], db) for f in fields]
    params += [Job._meta.pk.get_db_prep_value(uuid.UUID(str(job_id)), db)]
    params += [str(state) for state in states]
    if attempt is not None:
        params.append(int(attempt))
    if lease_owner is not None:
        params.append(_concrete("lease_owner").get_db_prep_value(uuid.UUID(str(lease_owner)), db))
    with db.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


@functools.cache
def _concrete(name: str) -> Field[Any, Any]:
    field = Job._meta.get_field(name)
    assert isinstance(field, Field), name
    return field


@functools.cache
def _held_update_sql(
    vendor: str, columns: tuple[str, ...], states: int, attempt: bool, lease_owner: bool
) -> str:
    quote = connection.ops.quote_name
    assignments = ", ".join(f"{quote(column)} = %s" for column in columns)
    where = [f"{quote('id')} = %s", f"{quote('state')} IN ({', '.join(['%s'] * states)})"]
    if attempt:
        where.append(f"{quote('attempts')} = %s")
    if lease_owner:
        where.append(f"{quote('lease_owner')} = %s")
    # In parentheses, as Django writes a WHERE of several terms: one more AND binds to all.
    return f"UPDATE {quote(Job._meta.db_table)} SET {assignments} WHERE ({' AND '.join(where)})"


def renew(
    *, job_id: str, attempt: int, lease_seconds: float, lease_owner: str | None = None
) -> bool:
    """Running stays running: extend the lease of the run holding the claim; False once it
    no longer does. effect_once calls it inside its transaction as its fence: the UPDATE
    locks the row, so no other claim can take the job before that transaction commits."""
    return bool(
        _update_held(
            job_id,
            attempt,
            "renew",
            lease_owner,
            lease_expires_at=timezone.now() + timedelta(seconds=lease_seconds),
        )
    )


def progress(
    *,
    job_id: str,
    done: int,
    total: int | None,
    message: str,
    attempt: int | None = None,
    lease_owner: str | None = None,
) -> bool:
    """Running stays running: the latest progress step of a running job; with `attempt` and
    `lease_owner`, only of the run holding that claim. False when nothing was written."""
    return bool(
        _update_held(
            job_id,
            attempt,
            "progress",
            lease_owner,
            progress_done=max(0, int(done)),
            progress_total=None if total is None else max(0, int(total)),
            progress_message=message[:255],
        )
    )


@batch_finish.moves_batch(JobState.SUCCEEDED)  # in one transaction with its batch's counters
@busy_retried  # SQLite's "database is locked" is waited out
def succeed(
    *,
    job_id: str,
    attempt: int,
    run_seconds: float,
    result: Any = None,
    lease_owner: str | None = None,
) -> bool:
    """From running to succeeded, with the return value, in one UPDATE; a run that lost its
    claim changes nothing (False)."""
    try:
        json.dumps(result, cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        logger.warning("Job %s returned a value that is not JSON; its result is not stored", job_id)
        result = None
    return bool(
        _update_held(
            job_id,
            attempt,
            "succeed",
            lease_owner,
            state=target("succeed"),
            finished_at=timezone.now(),
            lease_expires_at=None,
            run_seconds=run_seconds,
            error="",
            result=result,
        )
    )


def describe_exception(exc: BaseException) -> tuple[str, str]:
    """(dotted class name, message) of an exception, as the ledger records it."""
    cls = type(exc)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    return name, str(exc)


# An exception's arguments are kept with its failure (so AsyncResult.get() and an errback see
# the exception as raised, not its message folded into one string) up to this size as JSON.
MAX_EXCEPTION_ARGS_BYTES = 2000


def exception_arguments(exc: BaseException) -> list[Any] | None:
    """The exception's args as JSON, or None when they are not JSON or too large."""
    try:
        text = json.dumps(list(exc.args))
    except (TypeError, ValueError):
        return None
    return json.loads(text) if len(text) <= MAX_EXCEPTION_ARGS_BYTES else None


def _failure_entry(
    attempt: int,
    exc: BaseException,
    when: datetime,
    *,
    run_seconds: float | None = None,
    worker: str | None = None,
    retry_in: float | None = None,
) -> dict[str, Any]:
    """One failed attempt as the job's `failures` keep it (the job page's timeline): when it
    started (from its run time) and ended, on which worker, what it raised, and the delay
    before the next attempt when it is retried."""
    name, message = describe_exception(exc)
    entry: dict[str, Any] = {
        "attempt": attempt,
        "at": when.isoformat(),
        "exception": name,
        "message": message[:1000],
    }
    if run_seconds is not None:
        entry["started"] = (when - timedelta(seconds=run_seconds)).isoformat()
    if worker:
        entry["worker"] = worker[:200]
    if retry_in is not None:
        entry["retry_in"] = round(retry_in, 3)
    arguments = exception_arguments(exc)
    if arguments is not None:
        entry["args"] = arguments
    return entry


@busy_retried  # SQLite's "database is locked" is waited out
def retry_later(
    *,
    job_id: str,
    attempt: int,
    failures: list[dict[str, Any]],
    exc: BaseException,
    delay: float,
    run_seconds: float,
    lease_owner: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    publishing: bool = False,
    worker: str | None = None,
) -> datetime | None:
    """From running to retrying: record the failed attempt and when the next is due; None when
    this run no longer holds the claim (nothing is written then). `args`/`kwargs`, when given,
    are what the next run is called with (Celery's self.retry(args=..., kwargs=...)).

    `publishing`: the caller hands the broker the next run's message right after this write,
    so the row reads published from this write on. Left unpublished between the two, a retry
    due sooner than the gap (a 0.2 s countdown on a loaded host) was also sent by the relay's
    sweep of due rows: two messages, and the second claimed a run of its own. A message the
    caller then fails to hand over goes back to the outbox (ledger.unpublish), and one lost
    with its caller is found missing by the relay's reconcile. Without it (a wait longer than
    the broker should hold) the row stays unpublished and the relay publishes it when due.
    """
    now = timezone.now()
    due = now + timedelta(seconds=delay)
    name, message = describe_exception(exc)
    arguments: dict[str, Any] = {}
    if args is not None:
        arguments["args"] = args
    if kwargs is not None:
        arguments["kwargs"] = kwargs
    updated = _held(job_id, attempt, "retry_later", lease_owner).update(
        **arguments,
        state=target("retry_later"),
        scheduled_for=due,
        published_at=now if publishing else None,
        lease_expires_at=None,
        failed_at=now,
        run_seconds=run_seconds,
        error=f"{name}: {message}",
        failures=[
            *failures,
            _failure_entry(
                attempt, exc, now, run_seconds=run_seconds, worker=worker, retry_in=delay
            ),
        ][-MAX_FAILURES_KEPT:],
    )
    return due if updated else None


def release(
    *,
    job_id: str,
    crashed: bool = False,
    attempt: int | None = None,
    lease_owner: str | None = None,
) -> int | None:
    """From running to queued: free a claim so the requeued message runs again (only the
    claim of `attempt` / `lease_owner` when given); returns the job's crash count, or None
    when no claim was freed (the job was not running, or another run holds it)."""
    fields: dict[str, Any] = {"state": target("release"), "lease_expires_at": None}
    if crashed:
        fields["crashes"] = F("crashes") + 1
    if not _held(job_id, attempt, "release", lease_owner).update(**fields):
        return None
    return Job.objects.filter(id=job_id).values_list("crashes", flat=True).first() or 0


@dataclass(frozen=True)
class Defaults:
    """What a dead letter records for a job with no ledger row (untracked, or never adopted)."""

    task_name: str
    queue: str
    priority: int


@batch_finish.moves_batch(JobState.DEAD)  # in one transaction with its batch's counters
@busy_retried  # SQLite's "database is locked" is waited out
def give_up(
    *,
    job_id: str,
    defaults: Defaults,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    attempt: int,
    exc: BaseException,
    traceback: str = "",
    failures: list[dict[str, Any]] | None = None,
    run_seconds: float | None = None,
    claimed_attempt: int | None = None,
    tracked: bool = True,
    lease_owner: str | None = None,
    worker: str | None = None,
) -> DeadLetter | None:
    """From active to dead, with its dead letter, in one transaction.

    With `claimed_attempt` (and `lease_owner`), only the run holding that claim may do it
    (None otherwise).
    """
    now = timezone.now()
    name, message = describe_exception(exc)
    tb = traceback or "".join(traceback_module.format_exception(exc))
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).first() if tracked else None
        if job is not None and (
            job.state not in sources("give_up")
            or (
                claimed_attempt is not None
                and (job.state != JobState.RUNNING or job.attempts != claimed_attempt)
            )
            or (lease_owner is not None and str(job.lease_owner) != str(lease_owner))
        ):
            logger.warning(
                "Job %s: run %s lost its claim; not writing a dead letter", job_id, claimed_attempt
            )
            return None
        last = _failure_entry(attempt, exc, now, run_seconds=run_seconds, worker=worker)
        history = (failures or []) + [last]
        if job is not None:
            job.state = target("give_up")
            job.finished_at = job.failed_at = now
            job.lease_expires_at = None
            job.error = f"{name}: {message}"
            job.failures = history[-MAX_FAILURES_KEPT:]
            if run_seconds is not None:
                job.run_seconds = run_seconds
            job.save(
                update_fields=[
                    "state",
                    "finished_at",
                    "failed_at",
                    "lease_expires_at",
                    "error",
                    "failures",
                    "run_seconds",
                ]
            )
        dead_letter, _ = DeadLetter.objects.update_or_create(
            job_id_value=job_id,
            status=DeadLetterStatus.DEAD,
            defaults={
                "job": job,
                "task_name": defaults.task_name,
                "args": list(args),
                "kwargs": dict(kwargs),
                "queue": job.queue if job else defaults.queue,
                "priority": job.priority if job else defaults.priority,
                "owner_id": job.owner_id if job else None,
                "attempts": attempt,
                "exception_class": name,
                "exception_message": message,
                "traceback": tb,
                "first_failed_at": datetime.fromisoformat(history[0]["at"]),
                "last_failed_at": now,
            },
        )
    return dead_letter
