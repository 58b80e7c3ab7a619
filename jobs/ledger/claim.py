"""A worker's claim on a job for one run: the delivery's one UPDATE (or, off the common path,
a locked read that adopts an unknown message, takes over a lapsed lease or tells why the
delivery is dropped). The claim's token fences every later write of the run (jobs.ledger.run)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import DEFAULT_DB_ALIAS, IntegrityError, connections, transaction
from django.db.models import F
from django.utils import timezone

from jobs.core.conf import backlot_settings
from jobs.core.states import JobState, sources, target
from jobs.ledger import batch_finish
from jobs.models import Job

logger = logging.getLogger(__name__)

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
    lease_owner = %s, published_at = COALESCE(published_at, %s),
    crashes = crashes + (CASE WHEN state = %s THEN 1 ELSE 0 END)
WHERE id = %s AND (
    state = %s
    OR (state IN (%s, %s) AND (scheduled_for IS NULL OR scheduled_for <= %s))
    OR (state = %s AND (lease_expires_at IS NULL OR lease_expires_at < %s) AND crashes < %s))
RETURNING attempts, max_attempts, failures, owner_id, batch_id
"""


def claim(
    *,
    job_id: str,
    lease_seconds: float,
    adopt: Job | None = None,
    lease_owner: str | None = None,
) -> Claim | None:
    """From waiting (or running under a lapsed lease) to running, for this delivery; None
    when the message must be dropped (claim_delivery says why)."""
    claimed = claim_delivery(
        job_id=job_id, lease_seconds=lease_seconds, adopt=adopt, lease_owner=lease_owner
    )
    return claimed if isinstance(claimed, Claim) else None


def claim_delivery(
    *,
    job_id: str,
    lease_seconds: float,
    adopt: Job | Callable[[], Job] | None = None,
    lease_owner: str | None = None,
) -> Claim | Dropped:
    """From waiting (or running under a lapsed lease) to running, for this delivery, with a new
    lease owner token; Dropped (with the reason) when the message must be dropped.

    `lease_owner`: the token to claim with, a UUID unique to this delivery (PlatformRequest
    draws one per message it receives, so the worker's main process knows it too and fences
    its own writes for the run with it); a fresh one when None.

    Only a job that waits (queued, scheduled, retrying), or runs under an expired lease, can
    be claimed: a redelivered message of a running or finished job is a duplicate. A message
    with no ledger row (sent by name with send_task, bypassing enqueue) is adopted: `adopt`,
    an unsaved row describing it (or what builds it), is inserted and claimed.
    """
    now = timezone.now()
    token = uuid.uuid4() if lease_owner is None else uuid.UUID(str(lease_owner))
    claimed = _claim_in_one_statement(
        job_id=job_id, now=now, lease_seconds=lease_seconds, token=token
    )
    if claimed is not None:
        return claimed
    # Not claimable as it stands: find out why (missing, duplicate, early) under a row lock.
    if callable(adopt):  # built only for a message that may need it
        adopt = adopt()
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
                "published_at",
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
        job.lease_owner = token
        job.crashes += 1 if expired else 0
        job.published_at = job.published_at or now  # delivered: out of the outbox in any case
        job.save(
            update_fields=[
                "state",
                "attempts",
                "started_at",
                "last_started_at",
                "lease_expires_at",
                "lease_owner",
                "crashes",
                "published_at",
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


def _claim_in_one_statement(
    *, job_id: str, now: datetime, lease_seconds: float, token: uuid.UUID
) -> Claim | None:
    """The common case in one UPDATE … RETURNING (PostgreSQL, SQLite ≥ 3.35): no transaction,
    no SELECT FOR UPDATE, one round trip. None when the job is not claimable as it stands."""
    db = connections[DEFAULT_DB_ALIAS]  # `connection`, resolved once (jobs.ledger.accept)
    fields = {f.name: f for f in Job._meta.fields}

    def at(value: datetime) -> Any:
        return fields["started_at"].get_db_prep_value(value, db)

    params = [
        target("claim"),
        at(now),
        at(now),
        at(now + timedelta(seconds=lease_seconds)),
        fields["lease_owner"].get_db_prep_value(token, db),
        at(now),  # published_at, if the broker's confirm has not marked it yet (RabbitMQ)
        JobState.RUNNING,
        fields["id"].get_db_prep_value(uuid.UUID(str(job_id)), db),
        JobState.QUEUED,
        JobState.SCHEDULED,
        JobState.RETRYING,
        at(now + EARLY_TOLERANCE),
        JobState.RUNNING,
        at(now),
        _last_crash(),
    ]
    with db.cursor() as cursor:
        cursor.execute(_CLAIM_SQL.format(table=db.ops.quote_name(Job._meta.db_table)), params)
        row = cursor.fetchone()
    if row is None:
        return None
    attempts, max_attempts, failures, owner_id, batch_id = row
    batch_finish.claimed(job_id=job_id, batch_id=batch_id)  # its finish skips a batch it is not in
    if isinstance(failures, (str, bytes)):
        failures = json.loads(failures)
    return Claim(str(job_id), attempts, max_attempts, list(failures or []), owner_id, str(token))
