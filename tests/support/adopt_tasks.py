"""Plain Celery tasks, written the way Celery's documentation writes them: no Backlot import.
Adopt mode (BACKLOT_ADOPT_CELERY_TASKS=1 in the worker and the caller) makes them platform
tasks; tests/jobs/flow/test_adopt.py. On the `reports` queue, which the session worker leaves
to tests' own workers."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from jobs.broker.redis import redis_client


def mark(key: str, value: Any) -> None:
    redis_client().rpush(f"test:adopt:{key}", str(value))


@shared_task(queue="reports")
def add(x: int, y: int, key: str = "") -> int:
    if key:
        mark(key, "add")
    return x + y


# celery-types wants int seconds and no unknown option; Celery takes floats and passes any
# other option (backlot=False) to the task class.
@shared_task(bind=True, queue="reports", max_retries=2, default_retry_delay=0.1)  # type: ignore[call-overload]
def retrying(self: Any, key: str) -> str:
    mark(key, self.request.retries)
    if self.request.retries < 2:
        raise self.retry(exc=ConnectionError("not yet"))
    return f"done after {self.request.retries}"


@shared_task(  # type: ignore[call-overload]  # (float seconds, as above)
    bind=True,
    queue="reports",
    autoretry_for=(ConnectionError,),
    retry_backoff=0.2,
    retry_jitter=False,
    max_retries=1,
)
def auto_retrying(self: Any, key: str) -> None:
    mark(key, self.request.retries)
    raise ConnectionError("down")


@shared_task(queue="reports", ignore_result=True)
def ignored(key: str) -> str:
    mark(key, "ignored")
    return "not stored"


@shared_task(queue="reports")
def always_fails(key: str) -> None:
    mark(key, "failed")
    raise ValueError("always fails")


@shared_task(queue="reports", backlot=False)  # type: ignore[call-overload]  # (as above)
def opted_out(key: str) -> int:
    mark(key, "opted_out")
    return 7
