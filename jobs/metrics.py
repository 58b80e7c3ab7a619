"""Prometheus collector: numbers read at scrape time from Redis and the ledger."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db.models import Count
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from . import telemetry
from .models import DeadLetter
from .monitoring import queue_stats
from .pausing import paused_queues


class BacklotCollector(Collector):
    def collect(self) -> Iterator[Any]:
        depth = GaugeMetricFamily(
            "backlot_queue_depth", "Messages waiting in the broker per queue.", labels=["queue"]
        )
        scheduled = GaugeMetricFamily(
            "backlot_queue_scheduled", "Jobs waiting for their time per queue.", labels=["queue"]
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
            running.add_metric([q.name], q.running)
            oldest.add_metric([q.name], q.oldest_wait_seconds)
        yield from (depth, scheduled, running, oldest, paused)
        dead = GaugeMetricFamily(
            "backlot_dead_letters", "Dead letters by task and status.", labels=["task", "status"]
        )
        for row in DeadLetter.objects.values("task_name", "status").annotate(n=Count("id")):
            dead.add_metric([row["task_name"], row["status"]], row["n"])
        yield dead
        yield from telemetry.collect()
