"""Worker hooks: database connections live across jobs the way they live across requests."""

from __future__ import annotations

from typing import Any

from celery.signals import task_prerun
from django.db import close_old_connections


@task_prerun.connect
def recycle_connections(**kwargs: Any) -> None:
    """Before each job: close connections that errored or outlived CONN_MAX_AGE (Django's
    request_started hook, for jobs). With CONN_MAX_AGE=0 (SQLite) that is every job."""
    close_old_connections()
