"""Backlot's Celery settings, applied to a host project's Celery app in one line.

    app = Celery("host")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    jobs.worker.celery.configure(app)
    app.autodiscover_tasks()

``configure`` only fills in what the project left unset: a setting the project gives itself
(``CELERY_TASK_ACKS_LATE = False`` in its Django settings, or ``app.conf.update(...)`` before
the configuration loads) wins. Two dict-valued settings are merged key by key instead, the
project's keys winning: the broker transport options (Backlot's priority lists need
``priority_steps``, ``queue_order_strategy`` and ``sep`` even where a project sets only its
visibility timeout) and the beat schedule (the platform's periodic tasks run beside the
project's). JSON-only is not overridden but enforced: a project that accepts pickle fails
``manage.py check`` with jobs.E001.

The values are computed when Celery first reads its configuration, not at ``configure()``:
Django's settings are then loaded, and ``BACKLOT = {...}`` (queues, Redis, relay interval) is
read through ``jobs.core.conf.backlot_settings()``.
"""

from __future__ import annotations

import os
from typing import Any

import billiard.common
from celery import Celery
from celery.schedules import crontab
from celery.signals import celeryd_init
from django.conf import settings as django_settings
from kombu import Exchange, Queue

from jobs.broker import amqp, bells
from jobs.broker.redis import broker_transport_options, broker_url
from jobs.core.conf import backlot_settings
from jobs.worker import shutdown

# Adopt mode's task class (jobs.flow.adopt, above this layer: named, not imported).
ADOPTED_TASK_CLASS = "jobs.flow.adopt:AdoptedTask"
# Redis transport: a queue is ten lists, one per priority step, consumed highest first.
# https://docs.celeryq.dev/en/stable/userguide/routing.html#redis-message-priorities
PRIORITY_TRANSPORT_OPTIONS: dict[str, Any] = {
    "queue_order_strategy": "priority",
    "priority_steps": list(range(10)),
    "sep": ":",
    # Bounded waits so an enqueue against a dead or frozen Redis fails fast into the ledger,
    # where the relay publishes it later, instead of hanging the request.
    "socket_timeout": 2,
    "socket_connect_timeout": 2,
    "retry_on_timeout": False,
    "health_check_interval": 25,
}


def configure(app: Celery) -> None:
    """Give ``app`` Backlot's Celery settings wherever the project did not set its own.

    Call it once, after ``config_from_object`` and before the app is used. With
    ``BACKLOT["ADOPT_CELERY_TASKS"]`` the project's plain tasks become platform tasks
    (jobs.flow.adopt). Also makes SIGTERM
    (a deploy) a soft shutdown: running jobs get ``worker_soft_shutdown_timeout`` seconds to
    finish, the rest are requeued (acks_late) to run elsewhere. Celery does that only when
    SIGTERM is remapped to SIGQUIT, which billiard reads from ``REMAP_SIGTERM`` before the
    worker starts; an ``REMAP_SIGTERM`` already in the environment is kept. The worker stops
    as soon as its running jobs end (jobs.worker.shutdown), not after the whole timeout.
    """
    billiard.common.REMAP_SIGTERM = os.environ.setdefault("REMAP_SIGTERM", "SIGQUIT")
    celeryd_init.connect(_soft_shutdown_ends_with_jobs, weak=False, dispatch_uid=__name__)
    _configured.append(app)  # adopt mode is decided once Django's settings are loaded
    bells.ring_bells()  # each task message rings its queue's bell (jobs.broker.bells)
    if app.configured:  # type: ignore[attr-defined]  # celery-types does not declare it
        _apply(app.conf)
    else:
        app.on_after_configure.connect(_on_after_configure, sender=app, weak=False)


# The apps configure() was given, for adopt mode: BACKLOT is read only once Django's apps are
# ready (jobs.apps), never while the settings module may still be importing this one.
_configured: list[Celery] = []


def adopt_if_asked() -> None:
    """With BACKLOT["ADOPT_CELERY_TASKS"], make adopt mode's task class (jobs.flow.adopt) the
    base of each configured app's plain tasks, before the app builds them (it builds them when
    its tasks are first read, after Django's apps are ready). A project's own
    Celery(task_cls=...) is kept, and its tasks are not adopted."""
    if not backlot_settings().ADOPT_CELERY_TASKS:
        return
    for app in _configured:
        if app.finalized or app._custom_task_cls_used:  # type: ignore[attr-defined]
            continue
        app.task_cls = ADOPTED_TASK_CLASS
        app.__dict__.pop("Task", None)  # Celery's cached_property: built from task_cls again


def _soft_shutdown_ends_with_jobs(sender: Any, instance: Any, **kwargs: Any) -> None:
    """Celery's celeryd_init, before a worker of this process starts (jobs.worker.shutdown)."""
    if instance.app in _configured:
        shutdown.install(instance)


def _on_after_configure(sender: Celery, source: Any, **kwargs: Any) -> None:
    _apply(source)


def platform_settings() -> dict[str, Any]:
    """Backlot's value for each Celery setting it relies on (new-style lowercase names)."""
    conf = backlot_settings()
    default_queue = "default" if "default" in conf.QUEUES else conf.QUEUES[0]
    return {
        # REDIS_URL, or kombu's sentinel:// list of BACKLOT['REDIS_SENTINELS'] (jobs.broker.redis),
        # or RabbitMQ's amqp:// BACKLOT['BROKER_URL'] (jobs.broker.amqp).
        "broker_url": conf.BROKER_URL or broker_url(),
        "broker_connection_retry_on_startup": True,
        # Connecting to a frozen Redis gives up after this many seconds (Celery's default is 4):
        # the enqueue falls back to the ledger instead of holding the request.
        "broker_connection_timeout": 2,
        "task_publish_retry_policy": {
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.2,
            "interval_max": 0.5,
        },
        # JSON only: a pickled message is refused by the worker before any code runs.
        "accept_content": ["json"],
        "task_serializer": "json",
        "result_serializer": "json",
        "result_accept_content": ["json"],
        # At-least-once: ack after the job ran; a killed pool process puts its message back.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # One message per process at a time, so a backlog is not hoarded by one worker.
        "worker_prefetch_multiplier": 1,
        # Monitoring events cost a Redis PUBLISH each (a third of a worker's main process on
        # short jobs); Flower turns them on when it connects. Backlot reads its ledger instead.
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        # The ledger records start and finish; the result backend keeps only results.
        "task_track_started": False,
        "result_backend": "jobs.worker.results:LedgerResultBackend",
        "result_extended": False,
        "beat_scheduler": "jobs.flow.beat:LeaderDatabaseScheduler",
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        # SIGTERM: running jobs get this long to finish before they are requeued; the worker
        # stops when they end (jobs.worker.shutdown; Celery's own sleeps the whole timeout).
        # https://docs.celeryq.dev/en/stable/userguide/workers.html#soft-shutdown
        "worker_soft_shutdown_timeout": 30.0,
        # ... and only then: an idle worker stops at once (Celery skips the wait when no
        # request is active; on idle it would sleep the whole timeout for nothing). A worker's
        # prefetched and countdown messages go back to Redis at its cold shutdown either way.
        "worker_enable_soft_shutdown_on_idle": False,
        # Job time limits (the production checklist): jobs that set none stop after 30 min.
        "task_time_limit": 1800,
        "task_soft_time_limit": 1740,
        "timezone": django_settings.TIME_ZONE,
        "task_default_queue": default_queue,
        "task_queues": _queues(conf.QUEUES),
        "task_create_missing_queues": False,
        # Workers keep their database connections between jobs: Celery's Django fixup would
        # close them around every task, and connecting was a quarter of a short job's cost
        # (jobs.worker.signals closes broken or over-age ones before each job, as Django does per
        # request). The fixup reads this old-style name.
        "CELERY_DB_REUSE_MAX": 1_000_000,
        **(_amqp_settings() if amqp.enabled() else {}),
    }


def _amqp_settings() -> dict[str, Any]:
    """On RabbitMQ: no countdowns held broker-side (jobs.worker.consumer)."""
    return {"worker_consumer": "jobs.worker.consumer:Consumer"}


def _queues(names: tuple[str, ...]) -> list[Queue]:
    if amqp.enabled():  # quorum queues, durable (jobs.broker.amqp)
        return [amqp.declared_queue(name) for name in names]
    return [
        Queue(name, Exchange(name), routing_key=name, queue_arguments={"x-max-priority": 9})
        for name in names
    ]


def platform_transport_options() -> dict[str, Any]:
    """Broker transport options Backlot needs; the visibility timeout from jobs.core.conf, and with
    Redis Sentinel the master's name (kombu's Sentinel transport follows it across a failover).
    On RabbitMQ: publisher confirms (jobs.broker.amqp)."""
    if amqp.enabled():
        return amqp.transport_options()
    return {
        **PRIORITY_TRANSPORT_OPTIONS,
        **broker_transport_options(),
        # An unacknowledged message is redelivered after this many seconds; it must outlast
        # the longest countdown Redis may hold (system check jobs.E002).
        "visibility_timeout": backlot_settings().VISIBILITY_TIMEOUT,
    }


def platform_beat_schedule() -> dict[str, dict[str, Any]]:
    """The platform's periodic tasks: the relay, the health watch and the nightly retention."""
    conf = backlot_settings()
    queue = "default" if "default" in conf.QUEUES else conf.QUEUES[0]
    return {
        # Publishes the outbox, due scheduled jobs and jobs of expired leases.
        "backlot-relay": {
            "task": "jobs.relay",
            "schedule": conf.RELAY_INTERVAL,
            "options": {"queue": queue, "expires": 30},
        },
        "backlot-health-watch": {
            "task": "jobs.health_watch",
            "schedule": 30.0,
            "options": {"queue": queue, "expires": 30},
        },
        "backlot-retention": {
            "task": "jobs.retention",
            "schedule": crontab(hour=3, minute=30),
            "options": {"queue": queue},
        },
    }


def _set_by_project(conf: Any, key: str) -> bool:
    """Whether the project gave ``key`` a value: in any layer of the configuration but the
    last, which is Celery's built-in defaults (under it: the project's settings, under the
    namespace prefix, and what was set on the app before)."""
    prefix = conf.prefix or ""
    names = {key, key.upper(), f"{prefix}{key.upper()}"}
    return any(name in layer for layer in conf.maps[:-1] for name in names)


def _apply(conf: Any) -> None:
    for key, value in platform_settings().items():
        if not _set_by_project(conf, key):
            conf[key] = value
    conf["broker_transport_options"] = {
        **platform_transport_options(),
        **(conf.get("broker_transport_options") or {}),
    }
    conf["beat_schedule"] = {**platform_beat_schedule(), **(conf.get("beat_schedule") or {})}
