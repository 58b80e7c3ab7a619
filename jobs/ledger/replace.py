"""Writes of Celery's Task.replace(): a run hands its job id to the signature that replaces it,
and that signature's task of the same id takes the row over when it is enqueued.

Celery freezes the replacement with the replaced task's id, so the caller's AsyncResult reads
the replacement's outcome; the ledger has one row per id, so the row is handed over rather
than inserted twice. Between the two, the row waits as scheduled for a time that never comes
(the relay never publishes it, a stray copy of the replaced task's message is dropped as
early), marked by REPLACED in its error; cancelling it then stops the replacement there.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from jobs.core.states import JobState, sources, target
from jobs.models import Job

# The error text of a row handed to its replacement (and of one finished by an untracked one).
REPLACED = "replaced"
# A replaced row waits as scheduled this far ahead: never due.
PARKED_FOR = timedelta(days=3650)


def replace(*, job_id: str, attempt: int, lease_owner: str | None = None) -> bool:
    """From running to scheduled (parked, marked replaced), for the run of `attempt` holding
    the claim; False when it no longer does."""
    now = timezone.now()
    rows = Job.objects.filter(id=job_id, state__in=sources("replace"), attempts=attempt)
    if lease_owner is not None:
        rows = rows.filter(lease_owner=lease_owner)
    return bool(
        rows.update(
            state=target("replace"),
            scheduled_for=now + PARKED_FOR,
            published_at=now,
            lease_expires_at=None,
            error=REPLACED,
        )
    )


def replaced_by_untracked(*, job_id: str, attempt: int, lease_owner: str | None = None) -> bool:
    """From running to succeeded, marked replaced: the replacement's task of this id keeps no
    ledger row (track=False, or a plain Celery task such as celery.accumulate), so the
    result backend reads its outcome from Celery's result store instead."""
    rows = Job.objects.filter(id=job_id, state__in=sources("succeed"), attempts=attempt)
    if lease_owner is not None:
        rows = rows.filter(lease_owner=lease_owner)
    return bool(
        rows.update(
            state=target("succeed"),
            finished_at=timezone.now(),
            lease_expires_at=None,
            error=REPLACED,
            result=None,
        )
    )


def take_over(job: Job) -> bool:
    """From scheduled (a replaced row) to queued, or scheduled for the job's own time: the
    row becomes `job` (an unsaved row of the replacement's task with the replaced id), with
    a fresh count of attempts. False when the row is not waiting for a replacement."""
    fields: dict[str, Any] = {
        "task_name": job.task_name,
        "args": job.args,
        "kwargs": job.kwargs,
        "queue": job.queue,
        "priority": job.priority,
        "max_attempts": job.max_attempts,
        "publish_options": job.publish_options,
        "trace_context": job.trace_context,
        "state": JobState.SCHEDULED if job.scheduled_for else target("take_over"),
        "scheduled_for": job.scheduled_for,
        "published_at": job.published_at,  # marked when its enqueue publishes it at once
        "attempts": 0,
        "failures": [],
        "error": "",
    }
    return bool(
        Job.objects.filter(id=job.id, state__in=sources("take_over"), error=REPLACED).update(
            **fields
        )
    )
