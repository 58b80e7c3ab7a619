"""Prometheus collector: numbers read at scrape time from Redis and the ledger."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import Count
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jobs.broker import reservations
from jobs.broker.pausing import paused_queues
from jobs.broker.redis import redis_client, redis_text
from jobs.core.conf import backlot_settings
from jobs.flow.beat import LAST_TICK_KEY
from jobs.flow.relay import LEASE_LAPSES, MISSING_RESENT, unknown_tasks
from jobs.models import DeadLetter
from jobs.web import throttle
from jobs.web.monitoring import queue_stats, workers_online
from jobs.worker import telemetry
from jobs.worker.lease import FENCING
from jobs.worker.outcomes import DELIVERIES

# When `manage.py jobs relay` last finished a sweep (a Unix time, expiring a minute after the
# relay stops): jobs.management.commands.jobs.RELAY_HEARTBEAT, a layer this one may not import.
RELAY_HEARTBEAT = "backlot:relay:heartbeat"


class BacklotCollector(Collector):
    def collect(self) -> Iterator[Any]:
        depth = GaugeMetricFamily(
            "backlot_queue_depth", "Messages waiting in the broker per queue.", labels=["queue"]
        )
        scheduled = GaugeMetricFamily(
            "backlot_queue_scheduled",
            "Jobs waiting for their time per queue (a delay, an eta, a retry's backoff; parked "
            "jobs are backlot_queue_parked).",
            labels=["queue"],
        )
        parked = GaugeMetricFamily(
            "backlot_queue_parked",
            "Jobs in a durable sleep or a wait_for() whose time has not come, per queue: no "
            "worker held, not backlog.",
            labels=["queue"],
        )
        running = GaugeMetricFamily(
            "backlot_queue_running", "Jobs running per queue.", labels=["queue"]
        )
        oldest = GaugeMetricFamily(
            "backlot_queue_oldest_wait_seconds", "Age of the oldest queued job.", labels=["queue"]
        )
        paused = GaugeMetricFamily(
            "backlot_queue_paused", "1 while the queue is paused, else 0.", labels=["queue"]
        )
        paused_now = paused_queues()
        for q in queue_stats():
            paused.add_metric([q.name], 1 if q.name in paused_now else 0)
            depth.add_metric([q.name], q.waiting)
            scheduled.add_metric([q.name], q.scheduled)
            parked.add_metric([q.name], q.parked)
            running.add_metric([q.name], q.running)
            oldest.add_metric([q.name], q.oldest_wait_seconds)
        yield from (depth, scheduled, parked, running, oldest, paused)
        dead = GaugeMetricFamily(
            "backlot_dead_letters", "Dead letters by task and status.", labels=["task", "status"]
        )
        for row in DeadLetter.objects.values("task_name", "status").annotate(n=Count("id")):
            dead.add_metric([row["task_name"], row["status"]], row["n"])
        yield dead
        yield from telemetry.collect()
        yield from _processes()
        yield from _fencing()
        yield from _signins()


def _signins() -> Iterator[Any]:
    """Failed sign-ins and bearer tokens, and attempts refused while locked out
    (jobs.web.throttle)."""
    failures = CounterMetricFamily(
        "backlot_signin_failures",
        "Failed sign-ins (surface signin: the login page and the admin's) and unknown bearer "
        "tokens (surface token).",
        labels=["surface"],
    )
    refused = CounterMetricFamily(
        "backlot_signin_refused",
        "Sign-in and token attempts refused 429 while their account or address was locked out.",
        labels=["surface", "by"],
    )
    for key, n in sorted(throttle.counts().items()):
        if key[0] == "failed" and len(key) == 2:
            failures.add_metric([key[1]], n)
        elif key[0] == "refused" and len(key) == 3:
            refused.add_metric([key[1], key[2]], n)
    yield failures
    yield refused


def _fencing() -> Iterator[Any]:
    """Deliveries by what the claim made of them, and the fence at work: writes refused
    because their run had lost its claim, and runs that found themselves lost
    (jobs.worker.lease)."""
    client = redis_client()
    deliveries = CounterMetricFamily(
        "backlot_deliveries",
        "Messages workers received, by what the claim made of them (claimed, duplicate, "
        "early, missing, requeued, ...).",
        labels=["outcome"],
    )
    for field, n in sorted(client.hgetall(DELIVERIES).items()):
        deliveries.add_metric([redis_text(field)], int(n))
    yield deliveries
    refused = CounterMetricFamily(
        "backlot_fenced_writes",
        "Writes of runs that had lost their claim, refused (succeed, retry, dead, cancel, "
        "progress, effect, finish; the worker's own: time_limit, cancel, worker_lost).",
        labels=["write"],
    )
    lost = CounterMetricFamily(
        "backlot_runs_lost",
        "Runs that lost their claim: renewals failed (stopped before the lease lapsed) or "
        "taken over by another run.",
        labels=["cause"],
    )
    for field, n in sorted(client.hgetall(FENCING).items()):
        kind, _, name = redis_text(field).partition(":")
        if kind == "refused":
            refused.add_metric([name], int(n))
        elif kind == "lost":
            lost.add_metric([name], int(n))
    yield refused
    yield lost
    yield CounterMetricFamily(
        "backlot_lost_messages_resent",
        "Waiting jobs whose message Redis no longer held (in no list, in no worker's hands), "
        "sent again by the relay.",
        value=int(client.get(MISSING_RESENT) or 0),
    )


def _processes() -> Iterator[Any]:
    """The processes behind the queues: workers per queue, beat's and the relay's last beat,
    leases that lapsed, and Redis memory against its limit (`deploy/prometheus/alerts.yml`)."""
    workers = GaugeMetricFamily(
        "backlot_workers", "Celery workers (nodes) consuming each queue.", labels=["queue"]
    )
    online = workers_online()  # the workers' own presence records: no broadcast
    for queue in backlot_settings().QUEUES:
        workers.add_metric([queue], sum(queue in names for names in online.values()))
    yield workers
    client = redis_client()
    beat, relay = client.mget(LAST_TICK_KEY, RELAY_HEARTBEAT)
    yield GaugeMetricFamily(
        "backlot_beat_last_tick_timestamp_seconds",
        "When the leading beat last finished a tick (Unix time; 0 = never).",
        value=float(beat or 0),
    )
    yield GaugeMetricFamily(
        "backlot_relay_last_sweep_timestamp_seconds",
        "When the relay last finished a sweep (Unix time; 0 = not in the last minute).",
        value=float(relay or 0),
    )
    yield CounterMetricFamily(
        "backlot_lease_lapses",
        "Running jobs re-queued because their worker stopped renewing the lease.",
        value=int(client.get(LEASE_LAPSES) or 0),
    )
    restored, dropped = client.mget(reservations.RESTORED, reservations.DROPPED)
    yield CounterMetricFamily(
        "backlot_reservations_restored",
        "Messages a dead worker had taken (prefetched) given back to their queue by the relay.",
        value=int(restored or 0),
    )
    yield CounterMetricFamily(
        "backlot_reservations_dropped",
        "Messages a dead worker had taken whose job was running or finished, dropped instead.",
        value=int(dropped or 0),
    )
    unknown = GaugeMetricFamily(
        "backlot_jobs_unknown_task",
        "Waiting jobs whose task no installed module defines (the relay leaves them).",
        labels=["task"],
    )
    for name, waiting in sorted(unknown_tasks().items()):
        unknown.add_metric([name], waiting)
    yield unknown
    memory = client.info("memory")
    yield GaugeMetricFamily(
        "backlot_redis_memory_used_bytes", "Memory Redis uses.", value=memory["used_memory"]
    )
    yield GaugeMetricFamily(
        "backlot_redis_memory_max_bytes",
        "Redis's maxmemory (0 = no limit).",
        value=memory.get("maxmemory", 0),
    )
