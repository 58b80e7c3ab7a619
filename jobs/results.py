"""The result backend: django-celery-results, with tracked jobs' results read from the ledger.

A tracked job stores its return value in its Job row (the UPDATE that finishes the run), not
in a second django-celery-results row; this backend lets `AsyncResult(id).get()` and Flower
still see it. Chord and group members, and untracked jobs, are stored by the stock backend.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import states
from django_celery_results.backends import DatabaseBackend

# Job states (jobs.models.JobState values) as Celery states.
_CELERY_STATE = {
    "queued": states.PENDING,
    "scheduled": states.PENDING,
    "running": states.STARTED,
    "retrying": states.RETRY,
    "succeeded": states.SUCCESS,
    "dead": states.FAILURE,
}


class LedgerResultBackend(DatabaseBackend):
    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        meta: dict[str, Any] = super()._get_task_meta_for(task_id)
        if meta.get("status") != states.PENDING:
            return meta
        from .models import Job  # the backend is built before Django's apps are ready

        try:
            key = uuid.UUID(str(task_id))
        except ValueError:
            return meta
        job = (
            Job.objects.filter(id=key)
            .only("state", "result", "error", "finished_at", "task_name")
            .first()
        )
        if job is None:
            return meta
        status = _CELERY_STATE[job.state]
        result: Any = job.result
        if status == states.FAILURE:
            name, _, message = (job.error or "RuntimeError: gave up").partition(": ")
            module, _, exc_type = name.rpartition(".")
            result = {
                "exc_type": exc_type,
                "exc_message": [message],
                "exc_module": module or "builtins",
            }
        elif status != states.SUCCESS:
            result = None
        return {
            **meta,
            "status": status,
            "result": result,
            "date_done": job.finished_at,
            "task_name": job.task_name,
        }
