"""Plain Celery tasks with Celery's priorities, as adopt mode takes them (the base adopt mode
gives every @shared_task); tests/jobs/flow/test_adopt_priority.py, whose worker imports this
module (-I). On `reports`, which the session worker leaves alone."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from jobs.broker.redis import redis_client
from jobs.flow.adopt import AdoptedTask


def mark(key: str, value: Any) -> None:
    redis_client().rpush(f"test:priority:{key}", str(value))


@shared_task(base=AdoptedTask, name="tests.priority.plain", queue="reports")
def plain(key: str, label: str) -> None:
    mark(key, label)


# Celery on Redis: level 0 is consumed first, 9 last.
@shared_task(base=AdoptedTask, name="tests.priority.urgent", queue="reports", priority=0)
def urgent(key: str, label: str) -> None:
    mark(key, label)


@shared_task(base=AdoptedTask, name="tests.priority.background", queue="reports", priority=8)
def background(key: str, label: str) -> None:
    mark(key, label)


@shared_task(base=AdoptedTask, name="tests.priority.retried", queue="reports", bind=True)
def retried(self: Any, key: str) -> None:
    # the priority each run was sent with, as the task reads it (Backlot's scale)
    mark(key, (self.request.delivery_info or {}).get("priority"))
    if self.request.retries == 0:
        raise self.retry(countdown=0.1, priority=1, exc=ConnectionError("again"))
