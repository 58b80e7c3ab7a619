"""Worker and publisher hooks: database connections live across jobs the way they live
across requests, and Backlot's messages carry no field twice."""

from __future__ import annotations

from typing import Any

from celery import current_app
from celery.signals import before_task_publish, task_prerun
from django.db import close_old_connections

from .broker import slim_message
from .task import PlatformTask


@task_prerun.connect
def recycle_connections(**kwargs: Any) -> None:
    """Before each job: close connections that errored or outlived CONN_MAX_AGE (Django's
    request_started hook, for jobs). With CONN_MAX_AGE=0 (SQLite) that is every job."""
    close_old_connections()


@before_task_publish.connect
def slim_platform_messages(
    sender: str | None = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    if headers is None or properties is None:
        return
    if isinstance(current_app.tasks.get(sender or ""), PlatformTask):
        slim_message(headers, properties)
