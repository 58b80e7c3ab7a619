"""Writes that cancel jobs: a waiting job at once, a running one by request (its run then stops
at its next progress call, or is terminated) and finally when its run has stopped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from jobs.core.states import JobState, sources, target
from jobs.ledger import batch_finish
from jobs.models import Job


@batch_finish.cancels_members  # in one transaction with their batches' counters
def cancel_waiting(job_ids: Iterable[Any]) -> int:
    """From waiting (queued, scheduled, retrying) to cancelled: it never runs; a message of it
    that arrives later is dropped at claim."""
    now = timezone.now()
    return Job.objects.filter(id__in=list(job_ids), state__in=sources("cancel")).update(
        state=target("cancel"),
        cancel_requested_at=now,
        finished_at=now,
        lease_expires_at=None,
        scheduled_for=None,
    )


def cancel_discarded(job_id: Any, *, reason: str) -> bool:
    """From waiting to cancelled, as cancel_waiting, for a message the worker discarded
    unrun (Celery's expires, a revoke by stamped header); `reason` ("expired", "revoked") is
    kept as its error. False when the job was not waiting (already cancelled, or running)."""
    with transaction.atomic():
        if not cancel_waiting([job_id]):
            return False
        Job.objects.filter(id=job_id, state=target("cancel")).update(error=reason)
    return True


def request_cancel(job_ids: Iterable[Any]) -> int:
    """Running stays running, with a cancellation request its run sees (self.cancelled())."""
    return Job.objects.filter(
        id__in=list(job_ids), state__in=sources("request_cancel"), cancel_requested_at__isnull=True
    ).update(cancel_requested_at=timezone.now())


def children_cancelled(job_id: Any) -> bool:
    """Succeeded stays succeeded, marked: the work it fanned out was cancelled before it ended
    (cancel() on a job waiting on its children). The status API reads it as cancelled."""
    rows = Job.objects.filter(id=job_id, state=JobState.SUCCEEDED)
    # after its finish (Job.children_cancelled): a request made while it ran is overwritten
    return bool(rows.update(cancel_requested_at=timezone.now()))


@batch_finish.moves_batch(JobState.CANCELLED)  # in one transaction with its batch's counters
def run_cancelled(
    *,
    job_id: str,
    run_seconds: float | None = None,
    attempt: int | None = None,
    lease_owner: str | None = None,
) -> bool:
    """From running to cancelled: the run stopped on its cancellation request (or was
    terminated by a revoke). No retry, no dead letter. With `attempt` / `lease_owner`, only
    the run holding that claim may do it (False otherwise)."""
    now = timezone.now()
    fields: dict[str, Any] = {
        "state": target("run_cancelled"),
        "finished_at": now,
        "lease_expires_at": None,
        "error": "cancelled",
        "cancel_requested_at": Coalesce(F("cancel_requested_at"), Value(now)),
    }
    if run_seconds is not None:
        fields["run_seconds"] = run_seconds
    rows = Job.objects.filter(id=job_id, state__in=sources("run_cancelled"))
    if attempt is not None:
        rows = rows.filter(attempts=attempt)
    if lease_owner is not None:
        rows = rows.filter(lease_owner=lease_owner)
    return bool(rows.update(**fields))
