"""Re-sending a job's message under the same id: for a retry that the broker holds as a
countdown (a job waiting for a rate or concurrency slot waits in jobs.broker.slots' gates instead).
Also the Runnable protocol the worker's run needs of its task, and what its delivery says."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Protocol

from jobs.core import tracing
from jobs.enqueue.publish import Enqueueable, publish_job
from jobs.models import Job

logger = logging.getLogger(__name__)

# Message options a re-sent job does not inherit from the delivery it replaces. Its time limits,
# expiry and custom headers it does inherit, as a Celery retry does: a per-call time_limit holds
# for every attempt, an expired job never runs, apply_async(headers=...) reach every run.
NOT_CARRIED = frozenset({"task_id", "retries"})
# Headers the platform writes per message (a rate-limit slot, the trace context): never carried.
_OWN_HEADER_PREFIXES = ("backlot_", "traceparent", "tracestate", "baggage")


def _carried_headers(headers: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        key: value
        for key, value in (headers or {}).items()
        if not key.startswith(_OWN_HEADER_PREFIXES)
    }


class Runnable(Enqueueable, Protocol):
    """What a run needs of its task (PlatformTask has it)."""

    cluster_rate_limit: str | Mapping[str, str] | None
    on_dead: Callable[[BaseException, tuple, dict], None] | None
    on_cancelled: Callable[[tuple, dict], None] | None

    @property
    def request(self) -> Any: ...

    def run(self, *args: Any, **kwargs: Any) -> Any: ...

    def rate_bucket(self, args: tuple, kwargs: dict) -> tuple[str, str | None]: ...

    concurrency_limit: int | Mapping[str, int] | None

    def concurrency_slot(self, args: tuple, kwargs: dict) -> tuple[str, int | None]: ...


def request_priority(task: Runnable) -> int:
    """The delivery's priority on Backlot's 0-9 scale (PlatformRequest puts it there, in
    ``request.delivery_info['priority']``, where a Celery task reads its own), else the task's."""
    priority = (task.request.delivery_info or {}).get("priority")
    return max(0, min(9, priority)) if isinstance(priority, int) else task.default_priority


def request_queue(task: Runnable) -> str:
    return (task.request.delivery_info or {}).get("routing_key") or task.queue_name


def resend(
    task: Runnable,
    args: tuple,
    kwargs: dict,
    due: datetime | None,
    options: dict[str, Any],
    mark_published: bool = True,
    attempt: int = 0,
) -> bool:
    """Publish this job's message again (same id) for `due`; the relay covers a failure.
    `attempt`: the runs the row has now (its mark after the publish is fenced by it).

    Canvas links (chain, chord, group, callbacks) ride along, so a retried chord member still
    counts toward its chord.
    """
    carried = {
        key: value
        for key, value in task.request.as_execution_options().items()
        if value is not None and key not in NOT_CARRIED
    }
    options = dict(options)
    headers = {
        **_carried_headers(carried.pop("headers", None)),
        **(options.pop("headers", None) or {}),
    }
    if headers:
        options["headers"] = headers
    # self.retry(priority=..., queue=...): Backlot's 0-9 priority and a queue for the next run.
    priority = options.pop("priority", None)
    queue = options.pop("queue", None)
    job = Job(
        id=task.request.id,
        args=list(args),
        kwargs=dict(kwargs),
        queue=queue or request_queue(task),
        priority=request_priority(task) if priority is None else int(priority),
        scheduled_for=due,
        attempts=attempt,
        trace_context=tracing.message_context(task.request),  # each attempt in the same trace
    )
    return publish_job(
        job=job, task=task, options={**carried, **options}, mark_published=mark_published
    )
