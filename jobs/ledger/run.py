"""Writes of a worker's run: claim, renew, progress, and the outcome (succeeded, retrying,
released, dead with its dead letter). Each is fenced by the attempt of the run holding the
claim: a run that lost its claim changes nothing."""

from __future__ import annotations

import json
import logging
import traceback as traceback_module
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, connection, transaction
from django.db.models import F
from django.utils import timezone

from ..conf import backlot_settings
from ..models import DeadLetter, Job
from ..states import DeadLetterStatus, JobState, sources, target
from . import batch
from .busy import busy_retried

logger = logging.getLogger(__name__)

# Failures the ledger keeps per job (the newest); older ones are summarized by the count.
MAX_FAILURES_KEPT = 20
# A scheduled job's message may arrive this much before its time (clock skew between hosts).
EARLY_TOLERANCE = timedelta(seconds=2)


# --- a worker's run -----------------------------------------------------------------------
@dataclass(frozen=True)
class Claim:
    """A worker's hold on a job for one run."""

    job_id: str
    attempt: int
    max_attempts: int
    failures: list[dict[str, Any]]
    owner_id: int | None = None  # the jobs this run enqueues belong to the same user
    # This claim's token (Job.lease_owner): every write of the run matches it, so a run whose
    # claim another run took over (after its lease lapsed) changes nothing.
    lease_owner: str | None = None


@dataclass(frozen=True)
class Dropped:
    """A delivery that did not claim its job, and why (for the per-path delivery counts):
    "duplicate" (running or finished), "early" (before its time), "missing" (no ledger row),
    "adopted_elsewhere" (a concurrent delivery adopted it)."""

    reason: str


_CLAIM_SQL = """
UPDATE {table} SET state = %s, attempts = attempts + 1, deliveries = deliveries + 1,
    started_at = COALESCE(started_at, %s), last_started_at = %s, lease_expires_at = %s,
    lease_owner = %s, crashes = crashes + (CASE WHEN state = %s THEN 1 ELSE 0 END)
WHERE id = %s AND (
    state = %s
    OR (state IN (%s, %s) AND (scheduled_for IS NULL OR scheduled_for <= %s))
    OR (state = %s AND (lease_expires_at IS NULL OR lease_expires_at < %s) AND crashes < %s))
RETURNING attempts, max_attempts, failures, owner_id, batch_id
"""


def claim(*, job_id: str, lease_seconds: float, adopt: Job | None = None) -> Claim | None:
    """From waiting (or running under a lapsed lease) to running, for this delivery; None
    when the message must be dropped (claim_delivery says why)."""
    claimed = claim_delivery(job_id=job_id, lease_seconds=lease_seconds, adopt=adopt)
    return claimed if isinstance(claimed, Claim) else None


def claim_delivery(
    *, job_id: str, lease_seconds: float, adopt: Job | None = None
) -> Claim | Dropped:
    """From waiting (or running under a lapsed lease) to running, for this delivery, with a new
    lease owner token; Dropped (with the reason) when the message must be dropped.

    Only a job that waits (queued, scheduled, retrying), or runs under an expired lease, can
    be claimed: a redelivered message of a running or finished job is a duplicate. A message
    with no ledger row (sent by name with send_task, bypassing enqueue) is adopted: `adopt`,
    an unsaved row describing it, is inserted and claimed.
    """
    now = timezone.now()
    claimed = _claim_in_one_statement(job_id=job_id, now=now, lease_seconds=lease_seconds)
    if claimed is not None:
        return claimed
    # Not claimable as it stands: find out why (missing, duplicate, early) under a row lock.
    with transaction.atomic():
        job = (
            Job.objects.select_for_update()
            .only(
                "state",
                "attempts",
                "max_attempts",
                "failures",
                "lease_expires_at",
                "started_at",
                "scheduled_for",
                "owner",
                "crashes",
            )
            .filter(id=job_id)
            .first()
        )
        if job is None:
            if adopt is None:
                logger.warning("Job %s has no ledger row; message dropped", job_id)
                return Dropped("missing")
            try:
                with transaction.atomic():
                    adopt.published_at = adopt.enqueued_at = now
                    adopt.save(force_insert=True)
            except IntegrityError:  # a concurrent delivery adopted it first
                logger.info("Job %s adopted by another delivery; dropped", job_id)
                return Dropped("adopted_elsewhere")
            job = adopt
        # A lapsed lease is a lost run: taking it over counts a crash, and the run that would
        # reach MAX_WORKER_CRASHES is not started (the relay's sweep dead-letters the job).
        expired = (
            job.state == JobState.RUNNING
            and (job.lease_expires_at is None or job.lease_expires_at < now)
            and job.crashes < _last_crash()
        )
        if job.state not in sources("claim") or (job.state == JobState.RUNNING and not expired):
            logger.info("Job %s is %s; duplicate delivery dropped", job_id, job.state)
            Job.objects.filter(id=job_id).update(deliveries=F("deliveries") + 1)
            return Dropped("duplicate")
        if (
            job.state in sources("drop_early")
            and job.scheduled_for is not None
            and job.scheduled_for > now + EARLY_TOLERANCE
        ):
            # A stray copy arrived before the job's time (a requeue, a relay duplicate): drop it
            # and let the relay publish the job when it is due.
            logger.info(
                "Job %s is not due until %s; early delivery dropped", job_id, job.scheduled_for
            )
            Job.objects.filter(id=job_id).update(deliveries=F("deliveries") + 1, published_at=None)
            return Dropped("early")
        job.state = target("claim")
        job.attempts += 1
        job.started_at = job.started_at or now
        job.last_started_at = now
        job.lease_expires_at = now + timedelta(seconds=lease_seconds)
        job.lease_owner = uuid.uuid4()
        job.crashes += 1 if expired else 0
        job.save(
            update_fields=[
                "state",
                "attempts",
                "started_at",
                "last_started_at",
                "lease_expires_at",
                "lease_owner",
                "crashes",
            ]
        )
        Job.objects.filter(id=job_id).update(deliveries=F("deliveries") + 1)
    return Claim(
        str(job_id),
        job.attempts,
        job.max_attempts,
        list(job.failures),
        job.owner_id,
        str(job.lease_owner),
    )


def _last_crash() -> int:
    """A job that crashed this often may not be taken over from a lapsed lease once more."""
    return backlot_settings().MAX_WORKER_CRASHES - 1


def _claim_in_one_statement(*, job_id: str, now: datetime, lease_seconds: float) -> Claim | None:
    """The common case in one UPDATE … RETURNING (PostgreSQL, SQLite ≥ 3.35): no transaction,
    no SELECT FOR UPDATE, one round trip. None when the job is not claimable as it stands."""
    fields = {f.name: f for f in Job._meta.fields}

    def at(value: datetime) -> Any:
        return fields["started_at"].get_db_prep_value(value, connection)

    token = uuid.uuid4()
    params = [
        target("claim"),
        at(now),
        at(now),
        at(now + timedelta(seconds=lease_seconds)),
        fields["lease_owner"].get_db_prep_value(token, connection),
        JobState.RUNNING,
        fields["id"].get_db_prep_value(uuid.UUID(str(job_id)), connection),
        JobState.QUEUED,
        JobState.SCHEDULED,
        JobState.RETRYING,
        at(now + EARLY_TOLERANCE),
        JobState.RUNNING,
        at(now),
        _last_crash(),
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            _CLAIM_SQL.format(table=connection.ops.quote_name(Job._meta.db_table)), params
        )
        row = cursor.fetchone()
    if row is None:
        return None
    attempts, max_attempts, failures, owner_id, batch_id = row
    batch.claimed(job_id=job_id, batch_id=batch_id)  # its finish skips a batch it is not in
    if isinstance(failures, (str, bytes)):
        failures = json.loads(failures)
    return Claim(str(job_id), attempts, max_attempts, list(failures or []), owner_id, str(token))


def _held(job_id: str, attempt: int | None, event: str, lease_owner: str | None = None) -> Any:
    """The row, if the run of `attempt` (and of the claim `lease_owner`, when given) still
    holds it in a from-state of `event`: the fence of every write a run makes."""
    rows = Job.objects.filter(id=job_id, state__in=sources(event))
    if attempt is not None:
        rows = rows.filter(attempts=attempt)
    if lease_owner is not None:
        rows = rows.filter(lease_owner=lease_owner)
    return rows


def renew(
    *, job_id: str, attempt: int, lease_seconds: float, lease_owner: str | None = None
) -> bool:
    """Running stays running: extend the lease of the run holding the claim; False once it
    no longer does. effect_once calls it inside its transaction as its fence: the UPDATE
    locks the row, so no other claim can take the job before that transaction commits."""
    return bool(
        _held(job_id, attempt, "renew", lease_owner).update(
            lease_expires_at=timezone.now() + timedelta(seconds=lease_seconds)
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
        _held(job_id, attempt, "progress", lease_owner).update(
            progress_done=max(0, int(done)),
            progress_total=None if total is None else max(0, int(total)),
            progress_message=message[:255],
        )
    )


@batch.moves_batch(JobState.SUCCEEDED)  # in one transaction with its batch's counters
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
        _held(job_id, attempt, "succeed", lease_owner).update(
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


def _failure_entry(attempt: int, exc: BaseException, when: datetime) -> dict[str, Any]:
    name, message = describe_exception(exc)
    entry = {
        "attempt": attempt,
        "at": when.isoformat(),
        "exception": name,
        "message": message[:1000],
    }
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
) -> datetime | None:
    """From running to retrying: record the failed attempt and when the next is due; None when
    this run no longer holds the claim (nothing is written then). `args`/`kwargs`, when given,
    are what the next run is called with (Celery's self.retry(args=..., kwargs=...)).

    The row is left unpublished: the caller publishes it (and marks it) when the broker should
    hold it, otherwise the relay does once it is due.
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
        published_at=None,
        lease_expires_at=None,
        failed_at=now,
        run_seconds=run_seconds,
        error=f"{name}: {message}",
        failures=[*failures, _failure_entry(attempt, exc, now)][-MAX_FAILURES_KEPT:],
    )
    return due if updated else None


def release(
    *,
    job_id: str,
    crashed: bool = False,
    attempt: int | None = None,
    lease_owner: str | None = None,
) -> int:
    """From running to queued: free a claim so the requeued message runs again (only the
    claim of `attempt` / `lease_owner` when given); returns the job's crash count."""
    fields: dict[str, Any] = {"state": target("release"), "lease_expires_at": None}
    if crashed:
        fields["crashes"] = F("crashes") + 1
    _held(job_id, attempt, "release", lease_owner).update(**fields)
    return Job.objects.filter(id=job_id).values_list("crashes", flat=True).first() or 0


@dataclass(frozen=True)
class Defaults:
    """What a dead letter records for a job with no ledger row (untracked, or never adopted)."""

    task_name: str
    queue: str
    priority: int


@batch.moves_batch(JobState.DEAD)  # in one transaction with its batch's counters
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
        history = (failures or []) + [_failure_entry(attempt, exc, now)]
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
