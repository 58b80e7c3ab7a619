"""The job ledger's operations: enqueue, publish, claim, finish, fail, dead letters, replay.

Views, admin, commands and the worker-side task class call these; they own every write to
the ledger so that each state change happens in one place.
"""

from __future__ import annotations

import json
import logging
import traceback as traceback_module
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import IntegrityError, transaction
from django.db.models import F, OuterRef, Q, Subquery
from django.urls import reverse
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from .bulk import BULK_BATCH, job_enqueue_many
from .exceptions import BrokerUnavailable, ReplayError, UnknownTask
from .masking import message_repr
from .models import (
    CLAIMABLE_STATES,
    AuditEntry,
    DeadLetter,
    DeadLetterStatus,
    IdempotencyRecord,
    Job,
    JobState,
)
from .payload import payload_check

if TYPE_CHECKING:
    from .base import PlatformTask

logger = logging.getLogger(__name__)

# Failures the ledger keeps per job (the newest); older ones are summarized by the count.
MAX_FAILURES_KEPT = 20
# The relay leaves a fresh unpublished row alone this long: its on-commit publish is in flight.
RELAY_GRACE = timedelta(seconds=10)
# A job still waiting this long after it was published (or became due) while its queue is empty
# in Redis has lost its message.
RELAY_LOST_AFTER = timedelta(seconds=30)
# Message options that tie a job into a canvas; kept on the ledger row so a relayed job keeps them.
CANVAS_OPTIONS = frozenset(
    {"link", "link_error", "chain", "chord", "group_id", "group_index", "root_id", "parent_id"}
)
# A scheduled job's message may arrive this much before its time (clock skew between hosts).
EARLY_TOLERANCE = timedelta(seconds=2)


@dataclass(frozen=True)
class JobHandle:
    """What enqueue returns: the job id, and whether this call created the job."""

    id: str
    task_name: str
    created: bool = True

    @property
    def status_url(self) -> str:
        return reverse("api-1:job_status", kwargs={"job_id": self.id})

    def job(self) -> Job:
        return Job.objects.get(id=self.id)


def broker_priority(priority: int) -> int:
    """Backlot priorities run 0 (lowest) to 9 (highest); Redis consumes level 0 first."""
    return 9 - priority


def _check_priority(priority: int) -> int:
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 9:
        raise ValueError(
            f"priority must be an integer from 0 (lowest) to 9 (highest), got {priority!r}"
        )
    return priority


def _resolve_start(delay: float | None, eta: datetime | None, now: datetime) -> datetime | None:
    if delay is not None and eta is not None:
        raise ValueError("pass either delay or eta, not both")
    if delay is not None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {delay!r}")
        return now + timedelta(seconds=delay) if delay > 0 else None
    if eta is not None:
        if timezone.is_naive(eta):
            raise ValueError("eta must be timezone-aware")
        return eta if eta > now else None
    return None


def job_enqueue(
    *,
    task: PlatformTask,
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
) -> JobHandle:
    """Accept a job: check its payload, write its ledger row, publish after commit.

    With an idempotency key, a second enqueue while the first job is active (or succeeded
    within BACKLOT['IDEMPOTENCY_TTL']) writes and sends nothing and returns the first job.
    """
    args, kwargs = list(args), dict(kwargs or {})
    if not on_commit and transaction.get_connection().in_atomic_block:
        raise ValueError(
            "on_commit=False inside a transaction would publish a job whose ledger row the "
            "worker cannot see yet; enqueue after the transaction, or keep on_commit=True"
        )
    queue = queue or task.queue_name
    if queue not in settings.BACKLOT_QUEUES:
        raise ValueError(
            f"Unknown queue {queue!r}; configured: {', '.join(settings.BACKLOT_QUEUES)}"
        )
    payload_check(
        task_name=task.name,
        args=args,
        kwargs=kwargs,
        max_bytes=settings.BACKLOT["MAX_PAYLOAD_BYTES"],
    )
    priority = _check_priority(task.default_priority if priority is None else priority)
    now = timezone.now()
    start_at = _resolve_start(delay, eta, now)
    job = Job(
        id=uuid.UUID(task_id) if task_id else uuid.uuid4(),
        task_name=task.name,
        args=args,
        kwargs=kwargs,
        queue=queue,
        priority=priority,
        owner=owner if getattr(owner, "pk", None) else None,
        idempotency_key=idempotency_key or "",
        state=JobState.SCHEDULED if start_at else JobState.QUEUED,
        max_attempts=task.policy.max_attempts,
        enqueued_at=now,
        scheduled_for=start_at,
        publish_options=_storable(publish_options),
    )
    if not task.track:
        if idempotency_key:
            raise ValueError(f"{task.name} has track=False: idempotency keys need the job ledger")
        _on_commit_or_now(
            on_commit, lambda: _publish_untracked(job=job, task=task, options=publish_options)
        )
        return JobHandle(id=str(job.id), task_name=task.name)

    if idempotency_key:
        with transaction.atomic():
            holder = _take_idempotency_key(job=job, key=idempotency_key, now=now)
        if holder is not None:
            return JobHandle(id=str(holder.id), task_name=task.name, created=False)
    else:
        job.save(force_insert=True)  # one INSERT is atomic on its own: no BEGIN/COMMIT trip
    if _publishes_now(job, now):
        _on_commit_or_now(
            on_commit, lambda: job_publish(job=job, task=task, options=publish_options)
        )
    return JobHandle(id=str(job.id), task_name=task.name)


def _storable(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Message options worth keeping in the ledger for the relay (canvas links), as JSON."""
    kept = {k: v for k, v in (options or {}).items() if k in CANVAS_OPTIONS and v is not None}
    try:
        return json.loads(json.dumps(kept))
    except (TypeError, ValueError):
        logger.warning(
            "Canvas options of a job are not JSON; the relay would re-send it without them"
        )
        return {}


def _publish_untracked(*, job: Job, task: PlatformTask, options: Mapping[str, Any] | None) -> None:
    """An untracked job has no ledger row to wait in: a broker outage is the caller's error."""
    if not job_publish(job=job, task=task, options=options):
        raise BrokerUnavailable(f"Broker unavailable: untracked job {task.name} was not sent")


def _on_commit_or_now(on_commit: bool, send: Any) -> None:
    if on_commit:
        transaction.on_commit(send)
    else:
        send()


def _publishes_now(job: Job, now: datetime) -> bool:
    """Whether the broker holds the job now; long delays wait in the ledger for the relay."""
    if job.scheduled_for is None:
        return True
    horizon = settings.BACKLOT["MAX_BROKER_COUNTDOWN"]
    return (job.scheduled_for - now).total_seconds() <= horizon


def _take_idempotency_key(*, job: Job, key: str, now: datetime) -> Job | None:
    """Save `job` holding `key`, or return the job that already holds it."""
    scoped = f"{job.task_name}:{key}"
    try:
        with transaction.atomic():
            job.save(force_insert=True)
            IdempotencyRecord.objects.create(key=scoped, job=job, created_at=now)
            return None
    except IntegrityError:
        pass
    # Lock the record alone: a join would let PostgreSQL drop the row when another enqueue
    # re-points it to a new job while we wait for the lock.
    record = IdempotencyRecord.objects.select_for_update(of=("self",)).get(key=scoped)
    ttl = timedelta(seconds=settings.BACKLOT["IDEMPOTENCY_TTL"])
    if record.holds(ttl, now):
        return record.job
    # The holder is dead or its success has expired: this enqueue takes the key over.
    job.save(force_insert=True)
    record.job = job
    record.created_at = now
    record.save(update_fields=["job", "created_at"])
    return None


def job_publish(
    *,
    job: Job,
    task: PlatformTask,
    options: Mapping[str, Any] | None = None,
    mark_published: bool = True,
) -> bool:
    """Hand a job's message to the broker and mark the ledger row published.

    A broker that is down or frozen fails fast (bounded timeouts); the row then stays
    unpublished and the relay sends it later. Returns whether the broker took the message.
    """
    now = timezone.now()
    eta = job.scheduled_for if job.scheduled_for and job.scheduled_for > now else None
    try:
        task.apply_async(
            job.args,
            job.kwargs,
            task_id=str(job.id),
            queue=job.queue,
            priority=broker_priority(job.priority),
            eta=eta,
            argsrepr=message_repr(job.args),
            kwargsrepr=message_repr(job.kwargs),
            _backlot_internal=True,
            **{**(job.publish_options or {}), **dict(options or {})},
        )
    except (KombuError, RedisError, OSError) as exc:
        logger.warning("Broker unavailable, job %s stays in the outbox: %s", job.id, exc)
        return False
    if task.track and mark_published:
        Job.objects.filter(id=job.id).update(published_at=now)
    return True


def _waiting_but_due(now: datetime) -> Any:
    """Jobs that wait for a worker and may run now: queued, or scheduled/retrying and due."""
    return Job.objects.filter(
        Q(state=JobState.QUEUED)
        | Q(
            state__in=(JobState.SCHEDULED, JobState.RETRYING),
            scheduled_for__lt=now - RELAY_LOST_AFTER,
        )
    )


def _idle_queues() -> list[str]:
    """Backlot's queues that hold no message in Redis, when nothing is unacknowledged either."""
    from .monitoring import broker_queue_keys
    from .ratelimit import redis_client

    try:
        client = redis_client()
        if client.hlen("unacked"):
            return []
        keys = {queue: broker_queue_keys(queue) for queue in settings.BACKLOT_QUEUES}
        pipe = client.pipeline(transaction=False)
        for queue_keys in keys.values():
            for key in queue_keys:
                pipe.llen(key)
        lengths = pipe.execute()
        idle, start = [], 0
        for queue, queue_keys in keys.items():
            if not any(lengths[start : start + len(queue_keys)]):
                idle.append(queue)
            start += len(queue_keys)
        return idle
    except (RedisError, OSError):
        return []


def job_relay(*, limit: int = 500) -> int:
    """Publish what the ledger holds back: the outbox, due scheduled jobs, and expired leases.

    Duplicates this may cause are harmless: a worker claims a job once.
    """
    from .registry import task_by_name

    now = timezone.now()
    Job.objects.filter(state=JobState.RUNNING, lease_expires_at__lt=now).update(
        state=JobState.QUEUED, lease_expires_at=None, published_at=None
    )
    # Reconcile: a waiting job (queued, or a scheduled/retrying one whose time has come)
    # published longer ago than Redis would take to redeliver it was lost by the broker
    # (restart without AOF, FLUSHDB, a pop without ack, a worker killed holding it): send it
    # again. A retry's message is as mortal as a first one.
    visibility = settings.CELERY_BROKER_TRANSPORT_OPTIONS.get("visibility_timeout", 3600)
    _waiting_but_due(now).filter(published_at__lt=now - timedelta(seconds=visibility + 60)).update(
        published_at=None
    )
    # Sooner where the broker shows it: a queue with no message at all (none waiting, none
    # taken and unacknowledged anywhere) cannot be holding the message of a job that waits on
    # it past its time.
    for queue in _idle_queues():
        _waiting_but_due(now).filter(queue=queue, published_at__lt=now - RELAY_LOST_AFTER).update(
            published_at=None
        )
    pending = list(
        Job.objects.unpublished()
        .filter(enqueued_at__lt=now - RELAY_GRACE)
        .order_by("enqueued_at")[:limit]
    ) + list(Job.objects.due(now).order_by("scheduled_for")[:limit])
    sent = 0
    for job in pending:
        try:
            task = task_by_name(job.task_name)
        except UnknownTask:
            logger.error("Job %s names unknown task %s; left in the ledger", job.id, job.task_name)
            continue
        if not job_publish(job=job, task=task):
            break
        sent += 1
    return sent


@dataclass(frozen=True)
class Claim:
    """A worker's hold on a job for one run."""

    job_id: str
    attempt: int
    max_attempts: int
    failures: list[dict[str, Any]]


def job_claim(*, job_id: str, lease_seconds: float, adopt: Job | None = None) -> Claim | None:
    """Move a job to running for this delivery, or None when the message must be dropped.

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
            )
            .filter(id=job_id)
            .first()
        )
        if job is None:
            if adopt is None:
                logger.warning("Job %s has no ledger row; message dropped", job_id)
                return None
            try:
                with transaction.atomic():
                    adopt.published_at = adopt.enqueued_at = now
                    adopt.save(force_insert=True)
            except IntegrityError:  # a concurrent delivery adopted it first
                logger.info("Job %s adopted by another delivery; dropped", job_id)
                return None
            job = adopt
        expired = job.state == JobState.RUNNING and (
            job.lease_expires_at is None or job.lease_expires_at < now
        )
        if job.state not in CLAIMABLE_STATES and not expired:
            logger.info("Job %s is %s; duplicate delivery dropped", job_id, job.state)
            Job.objects.filter(id=job_id).update(deliveries=F("deliveries") + 1)
            return None
        if (
            job.state in (JobState.SCHEDULED, JobState.RETRYING)
            and job.scheduled_for is not None
            and job.scheduled_for > now + EARLY_TOLERANCE
        ):
            # A stray copy arrived before the job's time (a requeue, a relay duplicate): drop it
            # and let the relay publish the job when it is due.
            logger.info(
                "Job %s is not due until %s; early delivery dropped", job_id, job.scheduled_for
            )
            Job.objects.filter(id=job_id).update(deliveries=F("deliveries") + 1, published_at=None)
            return None
        job.state = JobState.RUNNING
        job.attempts += 1
        job.started_at = job.started_at or now
        job.last_started_at = now
        job.lease_expires_at = now + timedelta(seconds=lease_seconds)
        job.save(
            update_fields=["state", "attempts", "started_at", "last_started_at", "lease_expires_at"]
        )
        Job.objects.filter(id=job_id).update(deliveries=F("deliveries") + 1)
    return Claim(str(job_id), job.attempts, job.max_attempts, list(job.failures))


_CLAIM_SQL = """
UPDATE {table} SET state = %s, attempts = attempts + 1, deliveries = deliveries + 1,
    started_at = COALESCE(started_at, %s), last_started_at = %s, lease_expires_at = %s
WHERE id = %s AND (
    state = %s
    OR (state IN (%s, %s) AND (scheduled_for IS NULL OR scheduled_for <= %s))
    OR (state = %s AND (lease_expires_at IS NULL OR lease_expires_at < %s)))
RETURNING attempts, max_attempts, failures
"""


def _claim_in_one_statement(*, job_id: str, now: datetime, lease_seconds: float) -> Claim | None:
    """The common case in one UPDATE … RETURNING (PostgreSQL, SQLite ≥ 3.35): no transaction,
    no SELECT FOR UPDATE, one round trip. None when the job is not claimable as it stands."""
    connection = transaction.get_connection()
    fields = {f.name: f for f in Job._meta.fields}

    def at(value: datetime) -> Any:
        return fields["started_at"].get_db_prep_value(value, connection)

    params = [
        JobState.RUNNING,
        at(now),
        at(now),
        at(now + timedelta(seconds=lease_seconds)),
        fields["id"].get_db_prep_value(uuid.UUID(str(job_id)), connection),
        JobState.QUEUED,
        JobState.SCHEDULED,
        JobState.RETRYING,
        at(now + EARLY_TOLERANCE),
        JobState.RUNNING,
        at(now),
    ]
    with connection.cursor() as cursor:
        cursor.execute(
            _CLAIM_SQL.format(table=connection.ops.quote_name(Job._meta.db_table)), params
        )
        row = cursor.fetchone()
    if row is None:
        return None
    attempts, max_attempts, failures = row
    if isinstance(failures, (str, bytes)):
        failures = json.loads(failures)
    return Claim(str(job_id), attempts, max_attempts, list(failures or []))


def job_renew_lease(*, job_id: str, attempt: int, lease_seconds: float) -> bool:
    """Extend the lease of the run holding the claim; False once it no longer does."""
    return bool(
        Job.objects.filter(id=job_id, state=JobState.RUNNING, attempts=attempt).update(
            lease_expires_at=timezone.now() + timedelta(seconds=lease_seconds)
        )
    )


def job_succeeded(*, job_id: str, attempt: int, run_seconds: float, result: Any = None) -> bool:
    """Finish the run that holds the claim (`attempt`) and store its return value, in one
    UPDATE; a run that lost its claim changes nothing."""
    try:
        json.dumps(result, cls=DjangoJSONEncoder)
    except (TypeError, ValueError):
        logger.warning("Job %s returned a value that is not JSON; its result is not stored", job_id)
        result = None
    return bool(
        Job.objects.filter(id=job_id, state=JobState.RUNNING, attempts=attempt).update(
            state=JobState.SUCCEEDED,
            finished_at=timezone.now(),
            lease_expires_at=None,
            run_seconds=run_seconds,
            error="",
            result=result,
        )
    )


def job_progress(*, job_id: str, done: int, total: int | None, message: str) -> None:
    Job.objects.filter(id=job_id).update(
        progress_done=max(0, int(done)),
        progress_total=None if total is None else max(0, int(total)),
        progress_message=message[:255],
    )


def describe_exception(exc: BaseException) -> tuple[str, str]:
    cls = type(exc)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    return name, str(exc)


def _failure_entry(attempt: int, exc: BaseException, when: datetime) -> dict[str, Any]:
    name, message = describe_exception(exc)
    return {
        "attempt": attempt,
        "at": when.isoformat(),
        "exception": name,
        "message": message[:1000],
    }


def job_retry_later(
    *,
    job_id: str,
    attempt: int,
    failures: list[dict[str, Any]],
    exc: BaseException,
    delay: float,
    run_seconds: float,
) -> datetime | None:
    """Record a failed attempt and schedule the next; returns when it is due, or None when this
    run no longer holds the claim (nothing is written then).

    The row is left unpublished: the caller publishes it (and marks it) when the broker should
    hold it, otherwise the relay does once it is due.
    """
    now = timezone.now()
    due = now + timedelta(seconds=delay)
    name, message = describe_exception(exc)
    updated = Job.objects.filter(id=job_id, state=JobState.RUNNING, attempts=attempt).update(
        state=JobState.RETRYING,
        scheduled_for=due,
        published_at=None,
        lease_expires_at=None,
        failed_at=now,
        run_seconds=run_seconds,
        error=f"{name}: {message}",
        failures=[*failures, _failure_entry(attempt, exc, now)][-MAX_FAILURES_KEPT:],
    )
    return due if updated else None


def dead_letter_create(
    *,
    task: PlatformTask,
    job_id: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    attempt: int,
    exc: BaseException,
    traceback: str = "",
    failures: list[dict[str, Any]] | None = None,
    run_seconds: float | None = None,
    priority: int | None = None,
    queue: str | None = None,
    claimed_attempt: int | None = None,
) -> DeadLetter | None:
    """The job gives up: mark its ledger row dead and keep a dead letter, in one transaction.

    With `claimed_attempt`, only the run holding that claim may do it (None otherwise).
    """
    now = timezone.now()
    name, message = describe_exception(exc)
    tb = traceback or "".join(traceback_module.format_exception(exc))
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).first() if task.track else None
        if (
            job is not None
            and claimed_attempt is not None
            and (job.state != JobState.RUNNING or job.attempts != claimed_attempt)
        ):
            logger.warning(
                "Job %s: run %s lost its claim; not writing a dead letter", job_id, claimed_attempt
            )
            return None
        history = (failures or []) + [_failure_entry(attempt, exc, now)]
        if job is not None:
            job.state = JobState.DEAD
            job.finished_at = now
            job.failed_at = now
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
        first_failed = datetime.fromisoformat(history[0]["at"]) if history else now
        dead_letter, _ = DeadLetter.objects.update_or_create(
            job_id_value=job_id,
            status=DeadLetterStatus.DEAD,
            defaults={
                "job": job,
                "task_name": task.name,
                "args": list(args),
                "kwargs": dict(kwargs),
                "queue": job.queue if job else (queue or task.queue_name),
                "priority": job.priority
                if job
                else (priority if priority is not None else task.default_priority),
                "owner_id": job.owner_id if job else None,
                "attempts": attempt,
                "exception_class": name,
                "exception_message": message,
                "traceback": tb,
                "first_failed_at": first_failed,
                "last_failed_at": now,
            },
        )
    return dead_letter


def job_release(*, job_id: str, crashed: bool = False) -> int:
    """Free a running job's claim so its requeued message runs again; returns its crash count."""
    fields: dict[str, Any] = {"state": JobState.QUEUED, "lease_expires_at": None}
    if crashed:
        fields["crashes"] = F("crashes") + 1
    Job.objects.filter(id=job_id, state=JobState.RUNNING).update(**fields)
    return Job.objects.filter(id=job_id).values_list("crashes", flat=True).first() or 0


def dead_letter_replay(
    *,
    dead_letter: DeadLetter,
    by: Any = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> JobHandle:
    """Send a dead letter's job again as a new job, linked to it; the row is marked replayed.

    The row is locked first: two operators replaying at once make one new job.
    """
    from .registry import task_by_name

    with transaction.atomic():
        row = DeadLetter.objects.select_for_update().get(pk=dead_letter.pk)
        if row.status != DeadLetterStatus.DEAD:
            raise ReplayError(
                f"Dead letter {row.pk} is already {row.status}; it cannot be replayed"
            )
        task = task_by_name(row.task_name)
        handle = job_enqueue(
            task=task,
            args=row.args if args is None else args,
            kwargs=row.kwargs if kwargs is None else kwargs,
            priority=row.priority,
            owner=row.owner,
        )
        job = Job.objects.get(id=handle.id) if task.track else None
        if job is not None:
            Job.objects.filter(id=job.id).update(replay_of=row)
        row.mark_replayed(job=job, by=by)
    dead_letter.refresh_from_db()
    return handle


@dataclass
class BulkOutcome:
    """What a bulk replay or discard did."""

    done: int = 0
    skipped: int = 0  # already replayed/discarded, or locked by a concurrent operator
    errors: list[str] | None = None


def dead_letter_replay_many(
    *, queryset: Any, by: Any = None, progress: Any = None, limit: int | None = None
) -> BulkOutcome:
    """Replay every unresolved dead letter in `queryset`, 1,000 per transaction.

    Each chunk locks its rows (skipping ones another operator holds), enqueues the new jobs
    in bulk (one INSERT, one broker connection) and marks the rows replayed: 10,000 rows take
    a few seconds, not 10,000 round trips.
    """
    from .registry import task_by_name

    errors: list[str] = []
    outcome = BulkOutcome(errors=errors)
    ids = list(
        queryset.filter(status=DeadLetterStatus.DEAD)
        .order_by("pk")
        .values_list("pk", flat=True)[:limit]
    )
    user = by if getattr(by, "pk", None) else None
    for start in range(0, len(ids), BULK_BATCH):
        with transaction.atomic():
            rows = list(
                DeadLetter.objects.select_for_update(skip_locked=True).filter(
                    pk__in=ids[start : start + BULK_BATCH], status=DeadLetterStatus.DEAD
                )
            )
            outcome.skipped += len(ids[start : start + BULK_BATCH]) - len(rows)
            groups: dict[tuple[str, int], list[DeadLetter]] = {}
            for row in rows:
                groups.setdefault((row.task_name, row.priority), []).append(row)
            replayed: list[int] = []
            for (task_name, priority), group in groups.items():
                try:
                    task = task_by_name(task_name)
                except UnknownTask as exc:
                    errors.append(str(exc))
                    outcome.skipped += len(group)
                    continue
                job_enqueue_many(
                    task=task,
                    calls=[(row.args, row.kwargs) for row in group],
                    priority=priority,
                    replay_of=[row.pk for row in group],
                )
                replayed += [row.pk for row in group]
            # One UPDATE for the chunk; each row's new job is found through Job.replay_of.
            DeadLetter.objects.filter(pk__in=replayed).update(
                status=DeadLetterStatus.REPLAYED,
                replayed_job_id=Subquery(
                    Job.objects.filter(replay_of_id=OuterRef("pk"))
                    .order_by("-enqueued_at")
                    .values("id")[:1]
                ),
                resolved_at=timezone.now(),
                resolved_by=user,
            )
            outcome.done += len(replayed)
        if progress:
            progress(min(start + BULK_BATCH, len(ids)), len(ids), f"{outcome.done} replayed")
    return outcome


def dead_letter_discard_many(*, queryset: Any, by: Any = None) -> int:
    return queryset.filter(status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.DISCARDED,
        resolved_at=timezone.now(),
        resolved_by=by if getattr(by, "pk", None) else None,
    )


def audit(*, user: Any, action: str, count: int, **detail: Any) -> None:
    """Record an operator action (who, what, how many)."""
    AuditEntry.objects.create(
        user=user if getattr(user, "pk", None) else None, action=action, count=count, detail=detail
    )
    logger.info(
        "Operator action %s on %s row(s) by user %s", action, count, getattr(user, "pk", None)
    )


def dead_letter_discard(*, dead_letter: DeadLetter, by: Any = None) -> bool:
    updated = DeadLetter.objects.filter(pk=dead_letter.pk, status=DeadLetterStatus.DEAD).update(
        status=DeadLetterStatus.DISCARDED,
        resolved_at=timezone.now(),
        resolved_by=by if getattr(by, "pk", None) else None,
    )
    return bool(updated)
