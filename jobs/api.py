"""The jobs status API: GET /api/jobs/{job_id}/."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.http import HttpRequest
from ninja import Router, Schema
from ninja.errors import HttpError

from .models import Job, JobState

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

router = Router(tags=["jobs"])


class AuthenticatedRequest(HttpRequest):
    """For type checking only: a request that passed the API's auth, which leaves the user on
    `auth`. A view still receives Django's own request object."""

    auth: AbstractBaseUser


class JobProgressOut(Schema):
    done: int
    total: int | None
    percent: float | None
    message: str


class JobOut(Schema):
    job_id: str
    task: str
    state: str
    queue: str
    priority: int
    progress: JobProgressOut
    result: Any = None
    error: str | None = None
    attempts: int
    max_attempts: int
    enqueued_at: datetime
    scheduled_for: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    queue_wait_seconds: float | None
    run_seconds: float | None


def job_status(job: Job) -> dict[str, Any]:
    """The status document of a job, as the API returns it."""
    result = job.result if job.state == JobState.SUCCEEDED else None
    return {
        "job_id": str(job.id),
        "task": job.task_name,
        "state": job.state,
        "queue": job.queue,
        "priority": job.priority,
        "progress": {
            "done": job.progress_done,
            "total": job.progress_total,
            "percent": job.progress_percent,
            "message": job.progress_message,
        },
        "result": result,
        "error": job.error or None,
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "enqueued_at": job.enqueued_at,
        "scheduled_for": job.scheduled_for,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "queue_wait_seconds": None if job.queue_wait is None else round(job.queue_wait, 3),
        "run_seconds": None if job.run_seconds is None else round(job.run_seconds, 3),
    }


@router.get("/{job_id}/", response=JobOut, url_name="job_status")
def job_detail(request: AuthenticatedRequest, job_id: str) -> dict[str, Any]:
    """A job's state, progress, result or error. Unknown ids and other users' jobs are 404."""
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        raise HttpError(404, "No such job") from None
    job = Job.objects.visible_to(request.auth).filter(id=key).first()
    if job is None:
        raise HttpError(404, "No such job")
    return job_status(job)
