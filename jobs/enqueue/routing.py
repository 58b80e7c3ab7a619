"""Which queue a job goes to: the caller's ``queue=``, else the queue its task declares, else the
project's ``CELERY_TASK_ROUTES`` (Celery's ``task_routes``), else the task's default queue.

That is Celery's order (``apply_async(queue=)``, then the task's ``queue`` attribute, then
``task_routes``: ``celery.app.routes.Router.route`` lets the call's options win over a route),
with Celery's own router reading the routes, so every form Celery takes works: a dict of names
or globs (``"reports.*"``), a regex, a list of those, a router function ``(name, args, kwargs,
options, task=None, **kw)`` or its dotted path. The ledger row records the queue chosen and the
message goes there, on every path (``.delay()``, ``.apply_async()``, ``enqueue()``, canvas,
beat); a replay or retry keeps the row's queue. Of a route, only the queue is used (Backlot's
exchange is the queue's, and its priority is the call's or the task's); ``manage.py check``
reports a route to a queue outside ``BACKLOT["QUEUES"]`` (jobs.worker.conflicts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def job_queue(
    task: Any, args: Sequence[Any], kwargs: Mapping[str, Any], queue: str | None = None
) -> str:
    """The queue of a call of `task` whose caller asked for `queue` (None: not asked)."""
    if queue:
        return queue
    # A task without the attribute (not a PlatformTask) keeps its queue_name, as before routes.
    if getattr(task, "queue_declared", True):
        return str(task.queue_name)
    return routed_queue(task, args, kwargs) or str(task.queue_name)


def routed_queue(task: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """The queue CELERY_TASK_ROUTES gives this call, None when no route names one."""
    router = task.app.amqp.router
    if not router.routes:
        return None
    route = router.lookup_route(task.name, list(args), dict(kwargs), {}, task)
    if isinstance(route, str):  # a router function may answer with a queue's name
        return route or None
    queue = route.get("queue") if isinstance(route, Mapping) else None
    name = getattr(queue, "name", queue)  # a kombu Queue, or its name
    return str(name) if name else None
