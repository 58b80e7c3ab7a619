"""What a new job's row takes from where it is enqueued: its owner and parent (the acting user,
the running job), the batch open around the call, a cancel at birth under a parent that is
stopping; and when its message goes (after the caller's commit, or now). Shared by one job's
enqueue (jobs.enqueue.submit) and a fan-out's (jobs.enqueue.fanout)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import transaction

from jobs.core import context
from jobs.core.states import JobState
from jobs.enqueue.publish import Enqueueable
from jobs.models import Job


def lineage(owner: Any, detached: bool) -> dict[str, Any]:
    """owner_id and parent_id of a new job (jobs.enqueue.submit.enqueue says how)."""
    running = None if detached else context.running_job()
    if running is not None and running.before_child is not None:
        running.before_child()  # a run whose claim is deferred writes it before its children
    user = owner if getattr(owner, "pk", None) else context.acting_user()
    return {
        "owner_id": user.pk if user is not None else (running.owner_id if running else None),
        "parent_id": running.job_id if running else None,
    }


def born_cancelled(job: Job, now: datetime, parent_stopping: bool | None = None) -> bool:
    """A job enqueued by a job that is cancelled or asked to stop (a chord's callback sent
    after its cancelled member, a child enqueued before the run saw its request) is cancelled
    at birth: written as cancelled, never published. `parent_stopping`: the caller knows it
    (the parent has finished, so it no longer changes), else it is read."""
    if job.parent_id is None:
        return False
    if parent_stopping is None:
        parent_stopping = Job.objects.stopping().filter(id=job.parent_id).exists()
    if not parent_stopping:
        return False
    job.state = JobState.CANCELLED
    job.cancel_requested_at = job.finished_at = now
    job.scheduled_for = None
    return True


def join_batch(job: Job, task: Enqueueable) -> context.JoiningBatch | None:
    """The batch open around this enqueue (``with jobs.batch(...)``), which the job joins; its
    counters take the job when the block ends, in the same transaction."""
    joining = context.joining_batch()
    if joining is None:
        return None
    if not task.track:
        raise ValueError(f"{task.name} has track=False: a batch's members need the job ledger")
    job.batch_id = joining.batch_id
    return joining


def on_commit_or_now(on_commit: bool, send: Callable[[], None]) -> None:
    if on_commit:
        transaction.on_commit(send)
    else:
        send()
