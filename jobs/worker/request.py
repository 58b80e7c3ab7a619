"""The worker-side request class: handles what happens outside the pool process.

A hard time limit kills the pool process, and so does a crash or a cancel at shutdown; none of
them reaches the task's own code, so the worker's main process records them here, before the
message is acked or requeued.

Each message received gets a claim token here (a UUID in the request, outcomes.CLAIM_TOKEN)
that the pool process's claim writes into the job's row: the main process's writes for the
run match it, so a run whose job another run took over (its lease lapsed while its process
was stopped) has its time limit, cancel, crash and release refused like its own writes. A run
that deferred its claim (DEFER_CLAIM) and ended outside its code has it written here first
(jobs.worker.deferred.settle_ended), so that these writes find it as they find a claimed run.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Any, cast

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery.exceptions import Ignore, Retry, Terminated
from celery.worker.request import Request
from celery.worker.state import task_ready
from django.db import close_old_connections

from jobs import ledger
from jobs.broker import fetch, reservations
from jobs.broker.broker import backlot_priority
from jobs.core import context, events
from jobs.core.conf import backlot_settings
from jobs.core.policies import TimeLimitHit
from jobs.models import Job, JobState
from jobs.worker import deferred, execution, finishes, outcomes
from jobs.worker.lease import refused

if TYPE_CHECKING:
    from celery import Task
    from celery.app.task import Context

    from jobs.worker.task import PlatformTask

logger = logging.getLogger(__name__)

# How a pool process's run can end outside its own code (killed, or exiting the process).
_ENDED_OUTSIDE = (TimeLimitExceeded, Terminated, WorkerLostError, SystemExit, KeyboardInterrupt)


class PlatformRequest(Request):
    # Set by celery.worker.request.Request but missing from celery-types' stub.
    _task: Task[Any, Any]
    _request_dict: dict[str, Any]
    _delivery_info: dict[str, Any]
    _context: Context
    _already_cancelled: bool
    _already_revoked: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Celery's worker subclasses the task's Request class for each task
        (celery.worker.request.create_request_cls) with an on_success of its own, which acks
        the message: a success a pool process handed back unwritten waits to be written first
        (jobs.worker.finishes.handed holds its ack), and Celery sees its usual repr."""
        super().__init_subclass__(**kwargs)
        celery_on_success = cls.__dict__.get("on_success")
        if celery_on_success is None:
            return

        def on_success(self: PlatformRequest, failed__retval__runtime: Any, **kw: Any) -> Any:
            failed, retval, runtime = failed__retval__runtime
            if not failed:
                retval = finishes.handed(retval, self._request_dict.get(finishes.TAG))
            return celery_on_success(self, (failed, retval, runtime), **kw)

        cls.on_success = on_success  # type: ignore[method-assign,assignment]

    def __init__(self, message: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(message, *args, **kwargs)
        # The task reads the priority it was sent with on Backlot's 0-9 scale, 9 first, as a
        # Celery task reads the number its caller gave (Redis' levels run the other way).
        if isinstance(level := self._delivery_info.get("priority"), int):
            self._delivery_info["priority"] = backlot_priority(level)
        request = self._request_dict
        tracked = getattr(self._task, "track", False)
        if tracked:  # this delivery's claim token (a redelivered message gets its own)
            taken = (getattr(message, "properties", None) or {}).get(fetch.RUN)
            if taken:  # the fetch took its run record with it, under its token (DEFER_CLAIM)
                request[outcomes.CLAIM_TOKEN], request[outcomes.RUN_TAKEN] = taken
            else:
                request[outcomes.CLAIM_TOKEN] = str(uuid.uuid4())
            if backlot_settings().DEFER_CLAIM and self._task.acks_late:
                # its run record (jobs.broker.running) goes with the message's acknowledgement
                reservations.ran(message, self.id, request[outcomes.CLAIM_TOKEN])
            if finishes.on():  # its success may wait to be written with others' (-P solo)
                request[finishes.TAG] = message.delivery_tag
        # ignore_result asked by the call (the header; Backlot's slimming drops it when False),
        # else the task's own: a tracked job then keeps no return value in its row either.
        asked = request.get("ignore_result")
        if tracked and (asked if asked is not None else self._task.ignore_result):
            request["backlot_discard_result"] = True
        # The worker reads a missing root_id (slimmed away when it repeats the id) as the job's
        # own; the task's request says so too, as Celery's does (request.root_id).
        if not request.get("root_id"):
            request["root_id"] = self.id
        # A tracked job's return value goes into its ledger row (one UPDATE at finish), so the
        # result backend is skipped, unless a chord or group reads its members' results there.
        if tracked and not request.get("chord") and not request.get("group"):
            request["ignore_result"] = True
            self._ignore_result = True

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if getattr(self.task, "track", False) or isinstance(exc, TimeLimitExceeded):
            close_old_connections()  # the main process holds its connection for days
            if getattr(self.task, "track", False) and isinstance(exc, _ENDED_OUTSIDE):
                # a run that had not written its claim (DEFER_CLAIM): written now, for it
                deferred.settle_ended(str(self.id), self._claim_token())
            if isinstance(exc, (Terminated, WorkerLostError)) and self._stopped_on_request():
                pass  # cancelled: recorded, and Celery acks (or requeues a copy dropped at claim)
            elif isinstance(exc, TimeLimitExceeded):
                if self._hard_time_limit(exc):
                    return self._retry_scheduled()
            elif isinstance(exc, WorkerLostError) or (
                isinstance(exc, (SystemExit, KeyboardInterrupt))
                and not (self._already_cancelled or self._already_revoked)
            ):
                self._worker_lost(exc)
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _announce_cancelled(self, emit_retry: bool = True) -> None:
        """Cancelled at shutdown or on a lost broker connection: the message goes back to the
        queue, so free the claim for its redelivery (not a crash: nothing is counted)."""
        if getattr(self.task, "track", False):
            close_old_connections()
            # a run that had not written its claim (DEFER_CLAIM): written for it, then freed
            # below, so that its process, if it outlives the cancel, has its writes refused
            deferred.settle_ended(str(self.id), self._claim_token())
            try:
                ledger.release(job_id=self.id, lease_owner=self._claim_token())
            except Exception:
                logger.exception("Could not release the claim of cancelled job %s", self.id)
        # Request._announce_cancelled exists in Celery but not in celery-types' stub.
        super()._announce_cancelled(emit_retry=emit_retry)  # type: ignore[misc]

    def _announce_revoked(self, reason: str, terminated: bool, signum: Any, expired: bool) -> None:
        """A message discarded before it ran: expired (Celery's expires), or revoked by id or
        by a stamped header (revoke_by_stamped_headers) while waiting. Its job ends cancelled
        in the ledger (the reason as its error; no attempt, no dead letter), so the status API
        and AsyncResult (REVOKED) say so and the relay never sends it again. A terminated run
        is recorded by on_failure."""
        if getattr(self.task, "track", False) and not terminated:
            close_old_connections()
            try:
                self._discarded(reason)
            except Exception:
                logger.exception("Could not record the %s job %s in the ledger", reason, self.id)
        # Request._announce_revoked exists in Celery but not in celery-types' stub.
        super()._announce_revoked(reason, terminated, signum, expired)  # type: ignore[misc]

    def _discarded(self, reason: str) -> None:
        if not ledger.cancel_discarded(self.id, reason=reason):
            return  # already cancelled (a revoke is recorded first), running or finished
        task = cast("PlatformTask", self.task)  # PlatformRequest is PlatformTask's Request
        job = Job.objects.filter(id=self.id).only("queue", "attempts").first()
        events.send(
            events.job_cancelled,
            task=task.name,
            job_id=str(self.id),
            queue=job.queue if job else task.queue_name,
            attempt=job.attempts if job else 0,
            while_running=False,
            by=None,
        )
        if task.on_cancelled is not None:
            try:
                with context.hook_of(self.id):
                    task.on_cancelled(tuple(self.args), dict(self.kwargs))
            except Exception:
                logger.exception("on_cancelled hook of %s failed", task.name)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        if not soft and self._backlot_retrying:
            return self._retry_scheduled()  # not a failure: Celery must not fail the chord
        super().on_timeout(soft, timeout)

    _backlot_retrying = False

    def _retry_scheduled(self) -> None:
        """The platform re-sent this job: finish the request without recording a failure."""
        task_ready(self)
        if self.task.acks_late:
            self.acknowledge()

    def _hard_time_limit(self, killed: BaseException) -> bool:
        """Record the kill as a failed attempt; True when a retry was scheduled."""
        task = cast("PlatformTask", self.task)  # PlatformRequest is PlatformTask's Request
        timeout = getattr(killed, "args", [None])[0] if getattr(killed, "args", None) else "?"
        exc = TimeLimitHit(f"hard time limit of {timeout}s exceeded; the process was killed")
        try:
            if task.track:
                job = Job.objects.filter(id=self.id).only("attempts", "failures", "state").first()
                if job is None or job.state != JobState.RUNNING:
                    return False
                token = self._claim_token()
                if (
                    token is not None
                    and not Job.objects.filter(
                        id=self.id, state=JobState.RUNNING, lease_owner=token
                    ).exists()
                ):
                    refused("time_limit", str(self.id), None)  # another run holds the job
                    return False
                attempt, failures = job.attempts, list(job.failures)
            else:
                attempt, failures = (self._context.retries or 0) + 1, []
            with _bound_request(task, self):
                try:
                    execution.attempt_failed(
                        task,
                        exc,
                        args=tuple(self.args),
                        kwargs=dict(self.kwargs),
                        attempt=attempt,
                        failures=failures,
                        traceback=str(exc),
                    )
                except Retry:
                    self._backlot_retrying = True
                except Ignore:
                    pass
        except Exception:
            logger.exception("Could not record the time limit of job %s", self.id)
        return self._backlot_retrying

    def _stopped_on_request(self) -> bool:
        """A pool process that died (a terminating cancel kills it) under a cancellation
        request: the job ends cancelled. True when it was, or when this run had lost its
        claim (the write was refused: the run that took the job over decides)."""
        task = cast("PlatformTask", self.task)  # PlatformRequest is PlatformTask's Request
        try:
            if not outcomes.cancel_requested(self.id):
                return False
            token = self._claim_token()
            rows = Job.objects.filter(id=self.id)
            job = (rows.filter(lease_owner=token) if token else rows).only("attempts").first()
            if job is None and token is not None:
                refused("cancel", str(self.id), None)  # the row holds another run's claim
                return True
            with _bound_request(task, self):
                outcomes.stopped_on_request(
                    task, tuple(self.args), dict(self.kwargs), job.attempts if job else 0, None
                )
            return True
        except Ignore:
            return True  # refused (logged and counted): not this run's to record
        except Exception:
            logger.exception("Could not record the cancellation of job %s", self.id)
            return False

    def _worker_lost(self, exc: BaseException) -> None:
        """Free the claim so the requeued message runs again, until the job is a poison pill."""
        task = cast("PlatformTask", self.task)  # PlatformRequest is PlatformTask's Request
        try:
            with _bound_request(task, self):
                reason = outcomes.worker_lost(
                    task, exc, args=tuple(self.args), kwargs=dict(self.kwargs)
                )
            if reason is not None:
                # Celery stores no result for a requeued message: fail it so a chord fires.
                self.task.backend.mark_as_failure(self.id, reason, request=self._context)
        except Ignore:
            pass  # refused (logged and counted): another run holds the job
        except Exception:
            logger.exception("Could not record the worker loss of job %s", self.id)

    def _claim_token(self) -> str | None:
        """The claim token this delivery's run claimed (or will claim) the job with."""
        token = self._request_dict.get(outcomes.CLAIM_TOKEN)
        return str(token) if token else None


class _bound_request:
    """Push the request's context on the task so request-reading helpers work in the parent."""

    def __init__(self, task: Any, request: PlatformRequest) -> None:
        self.task, self.request = task, request

    def __enter__(self) -> None:
        self.task.push_request(**vars(self.request._context))

    def __exit__(self, *exc_info: Any) -> None:
        self.task.pop_request()
