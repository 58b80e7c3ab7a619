"""Queue depth, oldest wait, workers online and the health verdict, read cheaply enough to poll."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from celery import current_app
from django.db import connection
from django.db.models import Count, Min
from django.utils import timezone

from . import broker
from .conf import backlot_settings
from .models import DeadLetter, Job, JobState
from .pausing import paused_queues
from .redis import redis_client

logger = logging.getLogger(__name__)

# Worker pings are broadcast over the broker and cost up to a second; share one answer.
WORKERS_CACHE_SECONDS = 10
WORKERS_CACHE_KEY = "backlot:monitor:workers"


@dataclass
class QueueStats:
    name: str
    waiting: int  # messages in Redis, not yet taken by a worker
    scheduled: int  # ledger rows waiting for their time (delay, eta, retry)
    running: int
    oldest_wait_seconds: float  # age of the oldest queued job (0 when none)


def queue_stats() -> list[QueueStats]:
    queues = backlot_settings().QUEUES
    depths = broker.queue_depths(queues)
    counts: dict[tuple[str, str], int] = {
        (row["queue"], row["state"]): row["n"]
        for row in Job.objects.active().values("queue", "state").annotate(n=Count("id"))
    }
    oldest = dict(
        Job.objects.filter(state=JobState.QUEUED)
        .values("queue")
        .annotate(first=Min("enqueued_at"))
        .values_list("queue", "first")
    )
    now = timezone.now()
    stats = []
    for queue in queues:
        first = oldest.get(queue)
        stats.append(
            QueueStats(
                name=queue,
                waiting=depths[queue],
                scheduled=counts.get((queue, JobState.SCHEDULED), 0)
                + counts.get((queue, JobState.RETRYING), 0),
                running=counts.get((queue, JobState.RUNNING), 0),
                oldest_wait_seconds=(now - first).total_seconds() if first else 0.0,
            )
        )
    return stats


def workers_detail() -> dict[str, dict[str, Any]]:
    """Worker hostname -> {"queues": [...], "concurrency": n}; cached briefly in Redis.

    A pause or resume since the answer was cached makes it stale: workers act on it at once,
    and a queue just resumed must not read as "no worker consumes it" for the cache's life."""
    client = redis_client()
    paused = sorted(paused_queues())
    cached = client.get(WORKERS_CACHE_KEY)
    if cached is not None:
        entry = json.loads(cached)
        if entry.get("paused") == paused:
            return entry["workers"]
    inspect = current_app.control.inspect(timeout=1.0)
    queues = inspect.active_queues() or {}
    stats: dict[str, Any] = inspect.stats() or {} if queues else {}
    workers = {
        host: {
            "queues": sorted(q["name"] for q in host_queues),
            "concurrency": (stats.get(host) or {}).get("pool", {}).get("max-concurrency"),
        }
        for host, host_queues in queues.items()
    }
    client.set(
        WORKERS_CACHE_KEY,
        json.dumps({"paused": paused, "workers": workers}),
        ex=WORKERS_CACHE_SECONDS,
    )
    return workers


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
    checks["dead_letters"] = {
        "unresolved": DeadLetter.objects.unresolved().count(),
        "last_hour": DeadLetter.objects.filter(
            last_failed_at__gte=timezone.now() - timedelta(hours=1)
        ).count(),
    }
    checks["problems"] = problems
    return ("degraded" if problems else "healthy"), {"checks": checks}
