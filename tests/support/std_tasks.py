"""Tasks written against Django's standard Tasks API; Backlot's workers run them.

The tasks use the Tasks API only (tests/support/tasks_api.py: django.tasks on Django 6, the
django_tasks backport on 5.2), as an app written for `django.tasks` would (the Redis marks
and flags are the test suite's plumbing). Workers import this module by path when a task runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

from jobs.broker.redis import redis_client
from tests.support.tasks import mark, wait_for_flag
from tests.support.tasks_api import TaskContext, task


@task()
def add(a: int, b: int) -> int:
    return a + b


@task()
def record(key: str, label: str = "") -> str:
    mark(key, label)
    return label


@task()
def wait_then_answer(key: str) -> dict[str, Any]:
    """Runs until the test sets the flag `key`, so the test can watch it running."""
    mark(key, "started")
    if not wait_for_flag(key):
        raise TimeoutError(f"flag {key} was never set")
    return {"answer": 42, "key": key}


@task()
def upstream_down(key: str) -> None:
    """A transient failure on every run: retried per the platform's policy, then dead."""
    mark(key)
    raise ConnectionError(f"upstream unreachable ({key})")


@task()
def rejects_input(key: str, value: int) -> None:
    """A permanent failure: a ValueError is not retried."""
    mark(key)
    raise ValueError(f"value {value} is out of range")


@task()
def returns_a_set() -> Any:
    return {1, 2, 3}


@task(takes_context=True)
def describe_context(context: TaskContext, key: str) -> dict[str, Any]:
    result = context.task_result
    return {
        "key": key,
        "attempt": context.attempt,
        "id": result.id,
        "status": str(result.status),
        "priority": result.task.priority,
        "queue": result.task.queue_name,
    }


@task()
async def double_async(n: int) -> int:
    await asyncio.sleep(0)
    return 2 * n


@task(queue_name="reports")
def on_reports(key: str, label: str) -> None:
    mark(key, label)


@task()
def needs_flag(key: str) -> str:
    """Fails (not retried) until the test sets the flag `key`; then a replay succeeds."""
    mark(key)
    if not redis_client().exists(f"test:flag:{key}"):
        raise ValueError(f"flag {key} is not set")
    return "replayed"


@task()
def exits(key: str) -> None:
    """Raises SystemExit, as a task calling sys.exit() does; counts its runs."""
    mark(key, "run")
    raise SystemExit(3)


@task()
def interrupted(key: str) -> None:
    mark(key, "run")
    raise KeyboardInterrupt("stop")
