"""Tasks for tests/jobs/enqueue/test_routing.py (CELERY_TASK_ROUTES); its worker imports this
module (-I). Each answers with the queue its message came from."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from jobs.flow.adopt import AdoptedTask
from jobs.worker.decorators import job


def _delivered_from(task: Any) -> str:
    return str((task.request.delivery_info or {}).get("routing_key"))


@job(name="tests.routing.where", bind=True)
def where(self: Any, key: str) -> str:
    return _delivered_from(self)


@job(name="tests.routing.declared", queue="emails", bind=True)
def declared(self: Any, key: str) -> str:
    return _delivered_from(self)


# A plain Celery task as adopt mode makes it (BACKLOT["ADOPT_CELERY_TASKS"] gives every
# @shared_task this base): no queue= of its own.
@shared_task(base=AdoptedTask, name="tests.routing.adopted", bind=True)
def adopted(self: Any, key: str) -> str:
    return _delivered_from(self)
