"""The relay: publishes what the ledger holds back — the outbox (jobs whose message never
reached Redis), due scheduled and retrying jobs, jobs of workers whose lease lapsed, and jobs
whose message the broker lost. Runs from `manage.py jobs relay` and every few seconds from beat.

Duplicates it may cause are harmless: a worker claims a job once.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.utils import timezone
from redis.exceptions import RedisError

from . import broker, ledger
from .conf import backlot_settings
from .enqueue import publish_job
from .exceptions import UnknownTask
from .models import Job
from .redis import redis_client
from .registry import task_by_name

logger = logging.getLogger(__name__)

# The relay leaves a fresh unpublished row alone this long: its on-commit publish is in flight.
RELAY_GRACE = timedelta(seconds=10)
# A job still waiting this long after it was published (or became due) while its queue is empty
# in Redis has lost its message.
RELAY_LOST_AFTER = timedelta(seconds=30)
# How many running jobs were re-queued because their lease lapsed (a count; read by /metrics).
LEASE_LAPSES = "backlot:metrics:lease_lapses"


def job_relay(*, limit: int = 500) -> int:
    """One sweep; returns how many jobs it published."""
    now = timezone.now()
    conf = backlot_settings()
    lapsed = ledger.lapsed_leases_requeued(now=now)
    if lapsed:
        try:
            redis_client().incrby(LEASE_LAPSES, lapsed)
        except RedisError as exc:  # Redis is away: the sweep goes on, the count misses these
            logger.warning("relay: could not count %d lapsed lease(s): %s", lapsed, exc)
    # Reconcile: a waiting job (queued, or a scheduled/retrying one whose time has come)
    # published longer ago than Redis would take to redeliver it was lost by the broker
    # (restart without AOF, FLUSHDB, a pop without ack, a worker killed holding it): send it
    # again. A retry's message is as mortal as a first one.
    ledger.republish(
        now=now,
        published_before=now - timedelta(seconds=conf.VISIBILITY_TIMEOUT + 60),
        lost_after=RELAY_LOST_AFTER,
    )
    # Sooner where the broker shows it: a queue with no message at all (none waiting, none
    # taken and unacknowledged anywhere) cannot be holding the message of a job that waits on
    # it past its time.
    for queue in broker.idle_queues(conf.QUEUES):
        ledger.republish(
            now=now,
            published_before=now - RELAY_LOST_AFTER,
            lost_after=RELAY_LOST_AFTER,
            queue=queue,
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
        if not publish_job(job=job, task=task):
            break
        sent += 1
    return sent
