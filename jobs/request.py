"""The worker-side request class: handles what happens outside the pool process.

A hard time limit kills the pool process, and so does a crash; neither reaches the task's own
code, so the worker's main process records them here, before the message is acked or requeued.
"""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import WorkerLostError
from celery.worker.request import Request
from django.conf import settings

from . import services
from .models import Job
from .policies import TimeLimitHit

logger = logging.getLogger(__name__)


class PlatformRequest(Request):
    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft:
            self._hard_time_limit(timeout)
        super().on_timeout(soft, timeout)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, WorkerLostError) and getattr(self.task, "track", False):
            self._worker_lost(exc)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _hard_time_limit(self, timeout: float) -> None:
        task = self.task
        exc = TimeLimitHit(f"hard time limit of {timeout}s exceeded; the process was killed")
        try:
            if task.track:
                job = Job.objects.filter(id=self.id).only("attempts", "failures", "state").first()
                if job is None or job.state != "running":
                    return
                attempt, failures = job.attempts, list(job.failures)
            else:
                attempt, failures = (self._context.retries or 0) + 1, []
            with _bound_request(task, self):
                try:
                    task._attempt_failed(exc, args=tuple(self.args), kwargs=dict(self.kwargs),
                                         attempt=attempt, failures=failures, traceback=str(exc))
                except Exception:  # Retry raised: the next attempt is scheduled
                    pass
        except Exception:
            logger.exception("Could not record the time limit of job %s", self.id)

    def _worker_lost(self, exc: BaseException) -> None:
        """Free the claim so the requeued message runs again, until the job is a poison pill."""
        try:
            crashes = services.job_release_after_crash(job_id=self.id)
            if crashes >= settings.BACKLOT["MAX_WORKER_CRASHES"]:
                job = Job.objects.filter(id=self.id).only("attempts", "failures").first()
                services.dead_letter_create(
                    task=self.task, job_id=self.id, args=self.args, kwargs=self.kwargs,
                    attempt=job.attempts if job else crashes, failures=list(job.failures) if job else [],
                    exc=WorkerLostError(f"worker process died {crashes} times running this job: {exc}"),
                    traceback=str(exc),
                )
        except Exception:
            logger.exception("Could not record the worker loss of job %s", self.id)


class _bound_request:
    """Push the request's context on the task so request-reading helpers work in the parent."""

    def __init__(self, task: Any, request: PlatformRequest) -> None:
        self.task, self.request = task, request

    def __enter__(self) -> None:
        self.task.push_request(**vars(self.request._context))

    def __exit__(self, *exc_info: Any) -> None:
        self.task.pop_request()
