"""System checks: configuration mistakes fail `manage.py check`, not the first job at 3 a.m."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import redis
from celery import current_app
from django.conf import settings
from django.core.checks import Error, Tags, Warning, register
from django.db import connections

from jobs.broker.ratelimit import parse_rate
from jobs.broker.redis import connect as redis_connect
from jobs.core.conf import REDIS_SCHEMES, backlot_settings, url_scheme
from jobs.core.states import FINISHED_STATES
from jobs.worker import conflicts, telemetry
from jobs.worker.registry import platform_tasks


@register(Tags.compatibility)
def check_celery_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    problems: list[Any] = []
    # Unset, jobs.worker.celery.configure gives the app JSON only; a project's own value is checked.
    accepted = set(getattr(settings, "CELERY_ACCEPT_CONTENT", ["json"])) | set(
        getattr(settings, "CELERY_RESULT_ACCEPT_CONTENT", ["json"])
    )
    if accepted - {"json", "application/json"}:
        problems.append(
            Error(
                f"Celery accepts {sorted(accepted)}; only JSON is allowed (pickle runs code).",
                hint="Set CELERY_ACCEPT_CONTENT = ['json'].",
                id="jobs.E001",
            )
        )
    conf = backlot_settings()
    visibility = conf.VISIBILITY_TIMEOUT
    held = conf.MAX_BROKER_COUNTDOWN + conf.RATE_LIMIT_MAX_RESERVE
    if conf.BROKER_URL and not _redis_given():
        problems.append(
            Error(
                "The broker is RabbitMQ (BACKLOT['BROKER_URL']) and no Redis is set: Backlot "
                "keeps its rate limits, concurrency gates, counters, worker presence and beat's "
                "leader lock in Redis on every broker.",
                hint="Set REDIS_URL (or BACKLOT['REDIS_URL']) to your Redis, "
                "e.g. redis://HOST:6379/0.",
                id="jobs.E012",
            )
        )
    if held >= visibility and not conf.BROKER_URL:  # RabbitMQ redelivers on no timeout
        problems.append(
            Error(
                f"Countdowns up to {held:.0f}s may sit in Redis but the visibility timeout is "
                f"{visibility}s: Redis would deliver those jobs twice.",
                hint="Lower BACKLOT['MAX_BROKER_COUNTDOWN'] or raise visibility_timeout.",
                id="jobs.E002",
            )
        )
    return problems


def _redis_given() -> bool:
    """The project names a Redis (REDIS_URL, BACKLOT['REDIS_URL'], or a Redis broker URL)."""
    given = getattr(settings, "BACKLOT", None) or {}
    celery_broker = str(getattr(settings, "CELERY_BROKER_URL", None) or "")
    return bool(
        getattr(settings, "REDIS_URL", None)
        or given.get("REDIS_URL")
        or given.get("REDIS_SENTINELS")
        or url_scheme(celery_broker) in REDIS_SCHEMES
    )


@register(Tags.compatibility)
def check_conflicting_celery_settings(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """The project's Celery settings that contradict the ledger (jobs.worker.conflicts), each
    an error naming the setting and what to change; pickle in CELERY_ACCEPT_CONTENT is
    jobs.E001's."""
    given = conflicts.given_in_django_settings(settings, os.environ)
    given.pop("accept_content", None)
    problems: list[Any] = [
        Error(conflict.message, hint=conflict.hint, obj=conflict.setting, id="jobs.E010")
        for conflict in conflicts.conflicts(given)
    ]
    for name in conflicts.refused_allowances():
        problems.append(
            Error(
                f"BACKLOT['ALLOW_CELERY_SETTINGS'] names {name!r}, which cannot be allowed.",
                hint="It takes "
                + ", ".join(sorted(set(conflicts.CHECKED.values()) - conflicts.NEVER_ALLOWED))
                + " (JSON only is never let through).",
                id="jobs.E011",
            )
        )
    return problems


@register(Tags.compatibility)
def check_jobs(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    problems: list[Any] = []
    for task in platform_tasks():
        if task.queue_name not in backlot_settings().QUEUES:
            problems.append(
                Error(
                    f"Job {task.name} uses queue {task.queue_name!r}, which is not configured.",
                    hint=f"Use one of {', '.join(backlot_settings().QUEUES)}.",
                    obj=task.name,
                    id="jobs.E003",
                )
            )
        limit = task.cluster_rate_limit
        for rate in limit.values() if isinstance(limit, Mapping) else [limit]:
            if rate is None:
                continue
            try:
                parse_rate(rate)
            except ValueError as exc:
                problems.append(Error(str(exc), obj=task.name, id="jobs.E004"))
        # (an adopted Celery task retries through self.retry() and autoretry_for, as in Celery:
        # no exception is retried on its own, by design; jobs.flow.adopt)
        adopted = getattr(task, "adopted", False) and hasattr(task, "backlot")
        if task.policy.max_attempts > 1 and not task.policy.retry_on and not adopted:
            problems.append(
                Warning(f"Job {task.name} allows retries but retries no exception.", id="jobs.W001")
            )
    return problems


@register(Tags.compatibility)
def check_redis_durability(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """Redis must keep what it holds: persistence on, and no eviction of queued messages."""
    try:
        client = redis_connect(timeout=0.5)  # REDIS_URL, or the Sentinels' primary
        info = client.info("memory") | client.info("persistence")
    except redis.RedisError as exc:
        return [
            Warning(
                f"Redis at REDIS_URL is unreachable ({type(exc).__name__}); "
                "cannot check its durability settings.",
                id="jobs.W002",
            )
        ]
    problems: list[Any] = []
    if info.get("maxmemory_policy") != "noeviction":
        problems.append(
            Warning(
                f"Redis maxmemory-policy is {info.get('maxmemory_policy')!r}: under memory "
                "pressure it may evict queued jobs.",
                hint="Set maxmemory-policy noeviction.",
                id="jobs.W003",
            )
        )
    try:
        snapshots = bool(client.config_get("save").get("save"))
    except redis.RedisError:  # managed Redis may refuse CONFIG: assume its provider persists
        snapshots = True
    if not info.get("aof_enabled") and not snapshots:
        problems.append(
            Warning(
                "Redis persistence is off: a restart loses every queued job not yet in the ledger.",
                hint="Run Redis with appendonly yes.",
                id="jobs.W004",
            )
        )
    return problems


@register(Tags.security)
def check_metrics_token(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """/metrics with DEBUG off answers only the METRICS_TOKEN bearer and staff sessions."""
    if settings.DEBUG or backlot_settings().METRICS_TOKEN:
        return []
    return [
        Warning(
            "METRICS_TOKEN is empty and DEBUG is off: /metrics answers staff sessions only, so "
            "Prometheus scrapes get 401.",
            hint="Set BACKLOT['METRICS_TOKEN'] (the reference project reads METRICS_TOKEN from "
            "the environment) and give Prometheus the same bearer token.",
            id="jobs.W005",
        )
    ]


# SQLite has one write lock for every process of the platform (web, workers, beat, relay): each
# enqueue, claim and finish takes it. Beyond one host or this many jobs an hour, PostgreSQL.
# Measured: 4 worker processes on one WAL file finish 65 trivial jobs/s (234,000 an hour) on
# a loaded 2-core machine; the limit leaves room for the jobs' own writes and the web's.
SQLITE_MAX_JOBS_PER_HOUR = 20_000
MOVE_TO_POSTGRESQL = (
    "Move the ledger to PostgreSQL: set DATABASE_URL=postgres://USER:PASSWORD@HOST:5432/NAME "
    "for every process, run `python manage.py migrate`, then restart web, workers, beat and "
    "the relay (let the queues drain first, or carry the rows over with dumpdata/loaddata). "
    "SQLite suits one host and a small load: `make run`, development, a small site."
)


def _worker_hosts() -> set[str]:
    """The hosts of the workers that answer a ping (half a second; none when Redis is away:
    a broadcast to an unreachable broker would wait for its connection retries first)."""
    try:
        redis_connect(timeout=0.5).ping()
        replies = current_app.control.ping(timeout=0.5) or []
    except Exception:  # noqa: BLE001 - a check never fails on an unreachable broker
        return set()
    return {node.partition("@")[2] or node for reply in replies for node in reply}


@register(Tags.compatibility)
def check_sqlite_scale(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """SQLite is the default for one host; warn where it is run past that."""
    if connections["default"].vendor != "sqlite":
        return []
    reasons = []
    if not settings.DEBUG:
        reasons.append("DEBUG is off (a production deployment)")
    hosts = _worker_hosts()
    if len(hosts) > 1:
        reasons.append(
            f"workers on {len(hosts)} hosts ({', '.join(sorted(hosts))}) answer, and a SQLite "
            "file cannot be shared safely between hosts"
        )
    try:  # Redis's minute buckets: jobs_job keeps no index on finished_at (jobs.worker.telemetry)
        buckets = telemetry.finished_by_minute(60, client=redis_connect(timeout=0.5))
    except redis.RedisError:  # a check never fails on an unreachable Redis
        buckets = []
    hour = sum(n for b in buckets for (_, state), n in b.items() if state in FINISHED_STATES)
    if hour > SQLITE_MAX_JOBS_PER_HOUR:
        reasons.append(
            f"{hour} jobs finished in the last hour (SQLite's single write lock serves about "
            f"{SQLITE_MAX_JOBS_PER_HOUR} an hour)"
        )
    if not reasons:
        return []
    return [
        Warning(
            "The job ledger is on SQLite while " + "; and ".join(reasons) + ".",
            hint=MOVE_TO_POSTGRESQL,
            id="jobs.W006",
        )
    ]
