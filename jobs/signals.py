"""Worker and publisher hooks: database connections live across jobs the way they live
across requests, and Backlot's messages carry no field twice."""

from __future__ import annotations

from typing import Any

from celery import current_app
from celery.signals import before_task_publish, task_prerun
from django.db import close_old_connections

# Headers Celery writes even when empty; the worker reads each with a default (Context's class
# attributes), so an absent header means the same as its empty value.
_EMPTY_HEADERS = {
    "shadow": None,
    "eta": None,
    "expires": None,
    "group": None,
    "group_index": None,
    "parent_id": None,
    "stamped_headers": None,
    "replaced_task_nesting": 0,
    "retries": 0,
    "ignore_result": False,  # the task's own setting applies (PlatformRequest decides)
    "kwargsrepr": "{}",
    "lang": "py",  # read only to convert protocol-1 messages
}


@task_prerun.connect
def recycle_connections(**kwargs: Any) -> None:
    """Before each job: close connections that errored or outlived CONN_MAX_AGE (Django's
    request_started hook, for jobs). With CONN_MAX_AGE=0 (SQLite) that is every job."""
    close_old_connections()


def slim_message(headers: dict[str, Any], properties: dict[str, Any]) -> None:
    """Drop what a Backlot message carries for nothing: headers at their default value, the
    root id and correlation id when they repeat the job id, the reply queue (no rpc://
    results), and the second copy of argsrepr/kwargsrepr that apply_async leaves in the
    properties (the headers have them). Redis holds every queued message."""
    for key, empty in _EMPTY_HEADERS.items():
        if key in headers and headers[key] == empty:
            del headers[key]
    if headers.get("stamps") == {} and "stamped_headers" not in headers:
        del headers["stamps"]
    # A job that is its own root: the worker reads a missing root_id as the job's own id.
    if headers.get("root_id") is not None and headers.get("root_id") == headers.get("id"):
        del headers["root_id"]
    for key in ("argsrepr", "kwargsrepr", "reply_to"):
        properties.pop(key, None)
    if properties.get("correlation_id") == headers.get("id"):
        del properties["correlation_id"]  # only rpc:// result replies use it


@before_task_publish.connect
def slim_platform_messages(
    sender: str | None = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    from .base import PlatformTask

    if headers is None or properties is None:
        return
    if isinstance(current_app.tasks.get(sender or ""), PlatformTask):
        slim_message(headers, properties)
