"""The result backend: django-celery-results, with tracked jobs' results read from the ledger.

A tracked job stores its return value in its Job row (the UPDATE that finishes the run), not
in a second django-celery-results row; this backend lets `AsyncResult(id).get()` and Flower
still see it, as Celery would report it: SUCCESS with the return value (None for a call that
asked ignore_result), STARTED while it runs only for a task that tracks it (Celery's
track_started; else PENDING; with DEFER_CLAIM also before a short run wrote its row, from its
Redis record), RETRY with the exception of the attempt that asked for it,
FAILURE with the exception the job gave up with (its class and arguments, as raised: the
ledger keeps them with each failure), REVOKED for a cancelled or expired job
(TaskRevokedError).
Chord and group members, and untracked jobs, are stored by the stock backend.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import states
from django_celery_results.backends import DatabaseBackend

from jobs.broker import running
from jobs.ledger import REPLACED

# Job states (jobs.models.JobState values) as Celery states.
_CELERY_STATE = {
    "queued": states.PENDING,
    "scheduled": states.PENDING,
    "running": states.STARTED,
    "retrying": states.RETRY,
    "succeeded": states.SUCCESS,
    "dead": states.FAILURE,
    "cancelled": states.REVOKED,
}


def _exception_meta(name: str, message: str, arguments: list[Any] | None) -> dict[str, Any]:
    """An exception as Celery's JSON result meta holds it (exception_to_python reads it)."""
    module, _, exc_type = name.rpartition(".")
    return {
        "exc_type": exc_type,
        "exc_message": arguments if arguments is not None else [message],
        "exc_module": module or "builtins",
    }


def _last_failure(job: Any) -> dict[str, Any] | None:
    return job.failures[-1] if job.failures else None


def _failure_meta(job: Any) -> dict[str, Any]:
    """The exception the job gave up with; its arguments when the ledger kept them for it."""
    name, _, message = (job.error or "RuntimeError: gave up").partition(": ")
    last = _last_failure(job)
    arguments = last.get("args") if last and last.get("exception") == name else None
    return _exception_meta(name, message, arguments)


def _retry_meta(job: Any) -> dict[str, Any] | None:
    last = _last_failure(job)
    if last is None:
        return None
    return _exception_meta(last["exception"], last.get("message", ""), last.get("args"))


def _revoked_meta(job: Any) -> dict[str, Any]:
    return {
        "exc_type": "TaskRevokedError",
        "exc_message": [job.error or "revoked"],
        "exc_module": "celery.exceptions",
    }


def _outcome_in_ledger(app: Any, request: Any) -> bool:
    """A tracked job whose own outcome Backlot keeps in its ledger row instead of here
    (PlatformRequest asks Celery to ignore its result), not one whose caller asked that."""
    from jobs.worker.task import PlatformTask  # the backend is built before Django's apps are ready

    if request is None or not getattr(request, "ignore_result", False):
        return False
    if getattr(request, "backlot_discard_result", False):
        return False  # the call's own ignore_result: Celery's semantics, nothing stored
    task = app.tasks.get(getattr(request, "task", None) or "")
    return isinstance(task, PlatformTask) and task.track


class LedgerResultBackend(DatabaseBackend):
    def mark_as_failure(
        self,
        task_id: str,
        exc: Any,
        traceback: Any = None,
        request: Any = None,
        store_result: bool = True,
        call_errbacks: bool = True,
        state: str = states.FAILURE,
    ) -> None:
        """As Celery's, for a tracked job whose failure is in its ledger row: the tasks chained
        after it are failed with it all the same (their results are stored here, and a chord a
        later one belongs to is told), as Celery does for a task that stores its errors; else
        a chord waiting on the chain's end would wait for ever."""
        if store_result or not _outcome_in_ledger(self.app, request):
            return super().mark_as_failure(
                task_id,
                exc,
                traceback,
                request,
                store_result=store_result,
                call_errbacks=call_errbacks,
                state=state,
            )
        if request.chord:
            self.on_chord_part_return(request, state, exc)
        self._fail_chain(
            getattr(request, "chain", None), exc, traceback, store_result=True, state=state
        )
        if call_errbacks and request.errbacks:
            self._call_task_errbacks(request, exc, traceback)
        return None

    def _get_task_meta_for(self, task_id: str) -> dict[str, Any]:
        meta: dict[str, Any] = super()._get_task_meta_for(task_id)
        if meta.get("status") != states.PENDING:
            return meta
        from jobs.models import Job  # the backend is built before Django's apps are ready

        try:
            key = uuid.UUID(str(task_id))
        except ValueError:
            return meta
        job = (
            Job.objects.filter(id=key)
            .only("state", "result", "error", "failures", "finished_at", "task_name")
            .first()
        )
        if job is None or (job.error == REPLACED and job.state == "succeeded"):
            # Task.replace() by an untracked task: its outcome is in Celery's store, not here
            return meta
        status = _CELERY_STATE[job.state]
        if status == states.PENDING and running.unclaimed([job]):
            status = states.STARTED  # DEFER_CLAIM: its run started; the row is written at its end
        if status == states.STARTED and not getattr(
            self.app.tasks.get(job.task_name), "track_started", False
        ):
            # As Celery: STARTED only for a task that tracks it (task_track_started)
            status = states.PENDING
        result: Any = None
        if status == states.SUCCESS:
            result = job.result
        elif status == states.FAILURE:
            result = _failure_meta(job)
        elif status == states.RETRY:
            result = _retry_meta(job)
        elif status == states.REVOKED:
            result = _revoked_meta(job)
        # The stock backend decodes exceptions on the way out (meta_from_decoded): so do we.
        return self.meta_from_decoded(
            {
                **meta,
                "status": status,
                "result": result,
                "date_done": job.finished_at,
                "task_name": job.task_name,
            }
        )
