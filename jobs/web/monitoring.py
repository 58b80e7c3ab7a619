"""Queue depth, oldest wait, workers online and the health verdict, read cheaply enough to poll."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from django.db import connection
from django.db.models import Count, Min, Q
from django.utils import timezone

from jobs.broker import queues as broker_queues
from jobs.broker.heartbeat import workers_present
from jobs.broker.pausing import paused_queues
from jobs.broker.redis import redis_client
from jobs.core.conf import backlot_settings
from jobs.flow.relay import unknown_tasks
from jobs.models import ActiveJob, DeadLetter, JobState
from jobs.models.job import parked_condition

logger = logging.getLogger(__name__)


@dataclass
class QueueStats:
    """One queue's numbers. Waiting means due and not running, whatever the ledger calls it:
    a queued row, or a scheduled/retrying row whose time has come (published as a countdown a
    worker holds, or waiting for the relay), which keeps its state's name until it is claimed."""

    name: str
    waiting: int  # due and not running: the larger of the ledger's count and Redis' messages
    waiting_due: int  # of those, scheduled/retrying rows whose time has come
    scheduled: int  # rows not due yet (delay, eta, retry backoff), parked ones left out
    parked: int  # in a durable sleep or a wait_for() whose time has not come: not backlog
    running: int
    in_broker: int  # messages in Redis' lists (untracked jobs too; not countdowns a worker holds)
    oldest_wait_seconds: float  # since the oldest waiting job was enqueued or became due (0: none)


def queue_stats() -> list[QueueStats]:
    """Every configured queue's numbers: one GROUP BY over the active rows, one Redis round.

    Redis alone misses countdowns a worker has taken (a retry backlog) and rows the relay has
    yet to publish; the ledger alone misses untracked messages. A due row whose message is in
    a list is in both, so the two are not added: the larger is what waits at least.
    The one query reads jobs_activejob (jobs.models.active: the active jobs' state columns,
    kept by triggers), not jobs_job, which has no index on its state columns so that the
    workers' UPDATEs are HOT; its size is the active jobs', whatever the history's."""
    queues = backlot_settings().QUEUES
    depths = broker_queues.queue_depths(queues)
    now = timezone.now()
    due = Q(scheduled_for__lte=now)
    rows = {
        (row["queue"], row["state"]): row
        for row in ActiveJob.objects.values("queue", "state")
        .annotate(
            n=Count("job_id"),
            due=Count("job_id", filter=due),
            first_enqueued=Min("enqueued_at"),
            first_due=Min("scheduled_for", filter=due),
            parked=Count("job_id", filter=parked_condition(now, id_field="job_id")),
        )
        .order_by()
    }
    stats = []
    for queue in queues:
        queued = rows.get((queue, JobState.QUEUED)) or {}
        later = [rows.get((queue, s)) or {} for s in (JobState.SCHEDULED, JobState.RETRYING)]
        waiting_due = sum(r.get("due", 0) for r in later)
        parked = sum(r.get("parked", 0) for r in later)
        since = [
            first
            for first in (queued.get("first_enqueued"), *(r.get("first_due") for r in later))
            if first is not None
        ]
        stats.append(
            QueueStats(
                name=queue,
                waiting=max(depths[queue], queued.get("n", 0) + waiting_due),
                waiting_due=waiting_due,
                scheduled=sum(r.get("n", 0) - r.get("due", 0) for r in later) - parked,
                parked=parked,
                running=(rows.get((queue, JobState.RUNNING)) or {}).get("n", 0),
                in_broker=depths[queue],
                oldest_wait_seconds=max(0.0, (now - min(since)).total_seconds()) if since else 0.0,
            )
        )
    return stats


def workers_detail() -> dict[str, dict[str, Any]]:
    """Worker hostname -> {"queues": [...], "concurrency": n, "last_beat": unix time}, read
    from the presence each worker keeps with its heartbeat (jobs.broker.heartbeat): two
    Redis commands, never a broadcast to the workers (an inspect waits its whole timeout,
    1 s, for workers that may never answer). A paused queue is left out of a worker's queues:
    workers stop consuming it within the pause's sync interval."""
    paused = paused_queues()
    return {
        node: {
            "queues": [queue for queue in record.get("queues", []) if queue not in paused],
            "concurrency": record.get("concurrency"),
            "last_beat": record.get("beat"),
        }
        for node, record in workers_present().items()
    }


def workers_online() -> dict[str, list[str]]:
    """Worker hostname -> queues it consumes."""
    return {host: detail["queues"] for host, detail in workers_detail().items()}


def _check(fn: Any) -> tuple[bool, Any]:
    try:
        return True, fn()
    except Exception as exc:  # noqa: BLE001 - a health check reports failures, never raises
        logger.warning("Health check %s failed: %s", getattr(fn, "__name__", fn), exc)
        return False, f"unavailable ({type(exc).__name__})"


def _database() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return "ok"


def _redis() -> dict[str, Any]:
    client = redis_client()
    client.ping()
    info = client.info("memory") | client.info("persistence")
    return {
        "maxmemory_policy": info.get("maxmemory_policy"),
        "aof_enabled": bool(info.get("aof_enabled")),
        "used_memory": info.get("used_memory"),
    }


def health_report() -> tuple[str, dict[str, Any]]:
    """("healthy" | "degraded" | "down", details). Down: the database or Redis is unreachable.
    Degraded: a queue too deep or waiting too long (QueueStats.waiting counts due retries
    too), a queue no worker consumes, Redis that may evict, or more dead letters in the last
    hour than HEALTH_MAX_DEAD_PER_HOUR.

    A paused queue is listed under checks["paused"]; its depth, age and missing workers are
    what a pause means, not problems (so alerts stay quiet about it)."""
    limits = backlot_settings()
    db_ok, db = _check(_database)
    redis_ok, redis_info = _check(_redis)
    checks: dict[str, Any] = {"database": db, "redis": redis_info}
    if not (db_ok and redis_ok):
        return "down", {"checks": checks}
    problems: list[str] = []
    paused_ok, paused = _check(paused_queues)
    paused = paused if paused_ok else frozenset()
    checks["paused"] = sorted(paused)
    queues_ok, queues = _check(queue_stats)
    workers_ok, workers = _check(workers_online)
    if queues_ok:
        checks["queues"] = {q.name: asdict(q) for q in queues}
        for q in queues:
            if q.name in paused:
                continue
            if q.waiting > limits.HEALTH_MAX_QUEUE_DEPTH:
                problems.append(
                    f"queue {q.name}: {q.waiting} waiting > {limits.HEALTH_MAX_QUEUE_DEPTH}"
                )
            if q.oldest_wait_seconds > limits.HEALTH_MAX_WAIT_SECONDS:
                problems.append(
                    f"queue {q.name}: oldest job waited {q.oldest_wait_seconds:.0f}s > "
                    f"{limits.HEALTH_MAX_WAIT_SECONDS:.0f}s"
                )
    else:
        problems.append(f"queue stats unavailable: {queues}")
    if workers_ok:
        checks["workers"] = workers
        served = {q for names in workers.values() for q in names}
        for queue in backlot_settings().QUEUES:
            if queue not in served and queue not in paused:
                problems.append(f"no worker consumes queue {queue}")
    else:
        problems.append(f"workers unavailable: {workers}")
    if redis_info.get("maxmemory_policy") != "noeviction":
        problems.append(
            f"redis maxmemory-policy is {redis_info.get('maxmemory_policy')}, not noeviction"
        )
    # Jobs giving up faster than usual (a provider refusing, a bad deploy) degrade health even
    # while the queues keep moving: each is a job that will not run again without an operator.
    dead_last_hour = DeadLetter.objects.filter(
        last_failed_at__gte=timezone.now() - timedelta(hours=1)
    ).count()
    checks["dead_letters"] = {
        "unresolved": DeadLetter.objects.unresolved().count(),
        "last_hour": dead_last_hour,
    }
    if dead_last_hour > limits.HEALTH_MAX_DEAD_PER_HOUR:
        problems.append(
            f"dead letters: {dead_last_hour} in the last hour > {limits.HEALTH_MAX_DEAD_PER_HOUR}"
        )
    # Jobs no installed module defines wait forever (the relay reports them once, then skips
    # them): a deploy that dropped or renamed a job, or a relay that does not load its app.
    unknown_ok, unknown = _check(unknown_tasks)
    checks["unknown_tasks"] = unknown if unknown_ok else {}
    for name, waiting in sorted(checks["unknown_tasks"].items()):
        problems.append(f"{waiting} job(s) wait for unknown task {name}: deploy it, or cancel them")
    checks["problems"] = problems
    return ("degraded" if problems else "healthy"), {"checks": checks}
