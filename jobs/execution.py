"""A job's run on the worker: rate slot → claim → run → decide with the policy → persist →
publish → events, all before Celery acknowledges the message.

PlatformTask.__call__ hands a delivery to ``run``; PlatformRequest (the worker's main process)
calls ``attempt_failed`` for a hard time limit and ``worker_lost`` for a killed pool process.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Any, NoReturn

from billiard.exceptions import SoftTimeLimitExceeded, WorkerLostError
from celery.exceptions import Ignore, Reject, Retry
from django.db import DatabaseError, InterfaceError, connection
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from . import context, events, ledger, slots, tracing
from .conf import backlot_settings
from .exceptions import BrokerUnavailable, JobCancelled, LeaseLost
from .lease import holding, refused, renewer
from .models import Job, JobState
from .policies import RetryDecision, RetryRequested, TimeLimitHit
from .redelivery import (
    Runnable,
    request_priority,
    request_queue,
    resend,
)
from .redis import redis_client

logger = logging.getLogger(__name__)

# Deliveries by what the claim made of them (a hash: outcome -> count; read by /metrics):
# "claimed", "duplicate", "early", "missing", "adopted_elsewhere", "requeued" (the ledger
# could not be reached), "rate_limited" (re-sent for its turn).
DELIVERIES = "backlot:metrics:deliveries"


def count_delivery(outcome: str) -> None:
    try:
        redis_client().hincrby(DELIVERIES, outcome, 1)
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a delivery
        logger.debug("Could not count a %s delivery: %s", outcome, exc)


def _lease_owner(task: Runnable) -> str | None:
    """The claim token of the run in this process (None in the worker's main process, whose
    writes are fenced by the attempt alone)."""
    hold = getattr(task.request, "_backlot_hold", None)
    return hold.lease_owner if hold is not None else None


def lost(task: Runnable, write: str, attempt: int) -> None:
    """This run's `write` was refused (it lost its claim): logged, counted, and the delivery
    ends without an outcome (raises Ignore: Celery acks; the job's current run decides)."""
    refused(write, _job_id(task), attempt)
    raise Ignore()


def _defaults(task: Runnable) -> ledger.Defaults:
    return ledger.Defaults(task.name, request_queue(task), request_priority(task))


def _job_id(task: Runnable) -> str:
    job_id = task.request.id
    if job_id is None:
        raise RuntimeError(f"{task.name}: no job id outside a worker run")
    return str(job_id)


def _event(signal: Any, task: Runnable, attempt: int, **arguments: Any) -> None:
    events.send(
        signal,
        task=task.name,
        job_id=_job_id(task),
        queue=request_queue(task),
        attempt=attempt,
        **arguments,
    )


@tracing.traced_run
def run(task: Runnable, args: tuple, kwargs: dict) -> Any:
    """One delivery of a job (in its consumer span): pass its gate (a rate or concurrency
    slot), claim, run, record; the slot is freed once the outcome is in the ledger."""
    held = slots.Slots()
    try:
        return _run(task, args, kwargs, held)
    finally:
        held.release()


def _run(task: Runnable, args: tuple, kwargs: dict, held: slots.Slots) -> Any:
    request = task.request
    lease_seconds = backlot_settings().LEASE_SECONDS
    try:
        if (task.cluster_rate_limit or task.concurrency_limit) and not slots.admit(
            task, args, kwargs, held
        ):
            raise Ignore()  # it waits at its gate (acknowledged; no attempt spent)
        claim = None
        since = time.monotonic()  # the claim's lease runs from before its UPDATE
        if task.track:
            claimed = ledger.claim_delivery(
                job_id=request.id,
                lease_seconds=lease_seconds,
                adopt=Job(
                    id=request.id,
                    task_name=task.name,
                    args=list(args),
                    kwargs=dict(kwargs),
                    queue=request_queue(task),
                    priority=request_priority(task),
                    max_attempts=task.policy.max_attempts,
                ),
            )
            if isinstance(claimed, ledger.Dropped):
                count_delivery(claimed.reason)
                raise Ignore()
            claim = claimed
            count_delivery("claimed")
    except (DatabaseError, RedisError, KombuError, OSError) as exc:
        # The ledger or Redis is unreachable: hand the message back rather than ack it.
        logger.warning("Job %s could not be claimed (%s); message requeued", request.id, exc)
        count_delivery("requeued")
        raise Reject(str(exc), requeue=True) from exc
    except (Ignore, Reject):
        raise
    except Exception as exc:  # e.g. a broken rate_key: the job cannot start, record why
        give_up(task, exc, args=args, kwargs=kwargs, attempt=0, failures=[], fenced=False)
        raise
    attempt = claim.attempt if claim else (request.retries or 0) + 1
    failures = claim.failures if claim else []
    held.started = True
    tracing.set_attempt(attempt)
    _event(events.job_started, task, attempt)
    hold = None
    if claim:
        hold = renewer.hold(
            job_id=request.id,
            attempt=attempt,
            lease_seconds=lease_seconds,
            lease_owner=claim.lease_owner,
            since=since,
            on_renew=held.renew if held.gate and held.gate.limit else None,
        )
    # Kept on Celery's per-request Context: the run's writes match its claim's token.
    request._backlot_hold = hold
    # A rate-limited run's code begins at most `limit` (+ 10 %) a second, whatever its claim took.
    held.pace()
    started = time.monotonic()
    try:
        try:
            owner_id = claim.owner_id if claim else None
            with context.running(str(request.id), owner_id), holding(hold):
                result = task.run(*args, **kwargs)
        finally:
            if hold is not None:  # the finish below is fenced; renewals stop first
                renewer.release(request.id)
    except Retry:
        raise
    except LeaseLost:
        released_lost_run(task, attempt)
    except JobCancelled:
        stopped_on_request(task, args, kwargs, attempt, time.monotonic() - started)
        raise Ignore() from None
    except Ignore:  # the job decided it has nothing (more) to do
        if not getattr(request, "backlot_replaced", False):  # Task.replace() wrote its row
            _succeeded(task, attempt, time.monotonic() - started, None)
        raise
    except Reject as exc:
        # celery-types omits Reject's requeue/reason, which Reject.__init__ sets.
        if exc.requeue and task.track:  # type: ignore[attr-defined]
            ledger.release(job_id=request.id, attempt=attempt, lease_owner=_lease_owner(task))
            raise
        # Rejected for good: the job gives up with the Reject itself, as Celery stores it.
        request.backlot_give_up = True
        attempt_failed(
            task,
            exc,
            args=args,
            kwargs=kwargs,
            attempt=attempt,
            failures=failures,
            run_seconds=time.monotonic() - started,
        )
        raise
    except Exception as exc:
        attempt_failed(
            task,
            exc,
            args=args,
            kwargs=kwargs,
            attempt=attempt,
            failures=failures,
            run_seconds=time.monotonic() - started,
        )
        raise  # gave up: Celery records the failure and acknowledges after the dead letter
    finally:
        throttle = getattr(request, "_backlot_progress", None)
        if throttle is not None:
            throttle.close()
    _succeeded(task, attempt, time.monotonic() - started, result)
    return result


def _succeeded(task: Runnable, attempt: int, duration: float, result: Any) -> None:
    if task.track:
        # ignore_result (the call's, else the task's): the row keeps no return value (Celery).
        kept = None if getattr(task.request, "backlot_discard_result", False) else result
        backend = getattr(task, "backend", None)
        if backend is not None:  # as Celery stores it: a returned AsyncResult as its id tuple
            kept = backend.prepare_value(kept)
        written = ledger.succeed(
            job_id=_job_id(task),
            attempt=attempt,
            run_seconds=duration,
            result=kept,
            lease_owner=_lease_owner(task),
        )
        if not written:
            lost(task, "succeed", attempt)
    _event(events.job_succeeded, task, attempt, duration=duration, result=result)


def released_lost_run(task: Runnable, attempt: int) -> None:
    """The run raised LeaseLost: it lost its claim, or stopped itself before its lease could
    lapse. If this run still holds the claim, it frees it and hands its message back (the job
    runs again soon); otherwise the run that took the job over decides, and the message is
    acknowledged. Raises Reject or Ignore."""
    job_id, owner = _job_id(task), _lease_owner(task)
    freed = False
    if task.track and owner is not None:
        try:
            ledger.release(job_id=job_id, attempt=attempt, lease_owner=owner)
            freed = Job.objects.filter(
                id=job_id, state=JobState.QUEUED, attempts=attempt, lease_owner=owner
            ).exists()
        except (DatabaseError, InterfaceError) as exc:  # the outage it stopped for: re-queued later
            logger.warning("Job %s: lost run not released (%s)", job_id, type(exc).__name__)
    if freed:
        count_delivery("released_lost")
        raise Reject("this run lost its lease; the job runs again", requeue=True)
    lost(task, "finish", attempt)


def busy_database(task: Runnable, attempt: int) -> NoReturn:
    """The run's own write found the database busy (SQLite's lock held past its timeout): that
    says nothing about the job, so the attempt is not counted. The claim is freed and the
    message goes back to its queue (Reject with requeue), to run again once the lock is free."""
    job_id = _job_id(task)
    if task.track and not ledger.busy_released(
        job_id=job_id, attempt=attempt, lease_owner=_lease_owner(task)
    ):
        raise Ignore()  # this run lost its claim meanwhile; the job's current run decides
    logger.warning("Job %s: database busy; attempt %s not counted, requeued", job_id, attempt)
    raise Reject("the database is busy (locked)", requeue=True)


def attempt_failed(
    task: Runnable,
    exc: BaseException,
    *,
    args: tuple,
    kwargs: dict,
    attempt: int,
    failures: list[dict[str, Any]],
    run_seconds: float | None = None,
    traceback: str = "",
) -> None:
    """Decide with the policy, persist, publish, then send the event: raises Celery's Retry
    when a retry was scheduled, Ignore when this run lost its claim; returns after giving up.
    """
    reason = (
        TimeLimitHit(str(exc) or "soft time limit")
        if isinstance(exc, SoftTimeLimitExceeded)
        else exc
    )
    if ledger.database_busy(reason):
        busy_database(task, attempt)  # a wait, not a failed attempt: never a dead letter
    # self.retry(): the ledger and the caller see the task's exception, not the request for it.
    requested = exc if isinstance(exc, RetryRequested) else None
    if requested is not None:
        reason = requested.reason
    if task.track and cancel_requested(_job_id(task)):
        # asked to stop, and it failed on the way out: cancelled, not retried or dead
        stopped_on_request(task, args, kwargs, attempt, run_seconds)
        raise Ignore()
    if getattr(task.request, "backlot_give_up", False):
        # self.retry() past max_retries, or Reject(requeue=False): no retry, whatever the policy
        decision = RetryDecision(retry=False, delay=0.0)
    else:
        decision = task.policy.decide(requested or reason, attempt)
    if not decision.retry:
        give_up(
            task,
            reason,
            args=args,
            kwargs=kwargs,
            attempt=attempt,
            failures=failures,
            run_seconds=run_seconds,
            traceback=traceback,
            fenced=task.track,
        )
        return
    if not _schedule_retry(
        task, args, kwargs, attempt, failures, reason, decision.delay, run_seconds, requested
    ):
        raise Ignore()  # this run lost its claim; the job's current run decides
    _event(
        events.job_retrying,
        task,
        attempt,
        duration=run_seconds,
        exception=reason,
        delay=decision.delay,
    )
    # celery-types wants an Exception and a numbers.Real; Celery takes any exception and a float.
    raise Retry(exc=reason, when=decision.delay)  # type: ignore[arg-type]


def give_up(
    task: Runnable,
    exc: BaseException,
    *,
    args: tuple | list,
    kwargs: dict,
    attempt: int,
    failures: list[dict[str, Any]],
    run_seconds: float | None = None,
    traceback: str = "",
    fenced: bool = True,
) -> None:
    """The job is dead: its ledger row and dead letter (one transaction), the event, and the
    job's on_dead hook. `fenced`: only the run holding the claim of `attempt` may do it."""
    dead_letter = ledger.give_up(
        job_id=_job_id(task),
        defaults=_defaults(task),
        args=args,
        kwargs=kwargs,
        attempt=attempt,
        exc=exc,
        traceback=traceback,
        failures=failures,
        run_seconds=run_seconds,
        claimed_attempt=attempt if fenced else None,
        tracked=task.track,
        lease_owner=_lease_owner(task) if fenced else None,
    )
    if dead_letter is None and fenced and task.track:
        lost(task, "dead", attempt)
    _event(
        events.job_dead,
        task,
        attempt,
        duration=run_seconds,
        exception=exc,
        dead_letter_id=dead_letter.pk if dead_letter else None,
    )
    call_on_dead(task, exc, args, kwargs)


def cancel_requested(job_id: str) -> bool:
    return Job.objects.filter(id=job_id, cancel_requested_at__isnull=False).exists()


def cancel_seen(job_id: str) -> bool:
    """cancel_requested() for a running job's own checks: False while the ledger cannot be
    read (a database outage must not fail the job; its lease decides when it stops)."""
    try:
        return cancel_requested(job_id)
    except (DatabaseError, InterfaceError) as exc:
        logger.warning("Job %s: cancel check failed (%s)", job_id, type(exc).__name__)
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()  # reconnect at the next check
        return False


def stopped_on_request(
    task: Runnable, args: Any, kwargs: Any, attempt: int, run_seconds: float | None
) -> None:
    """The run stopped because it was cancelled (JobCancelled, or its process terminated):
    the row ends cancelled, the event is sent and the job's on_cancelled hook runs."""
    owner = _lease_owner(task)
    if (
        task.track
        and not ledger.run_cancelled(
            job_id=_job_id(task),
            run_seconds=run_seconds,
            attempt=attempt if owner else None,
            lease_owner=owner,
        )
        and owner
    ):
        lost(task, "cancel", attempt)
    if task.concurrency_limit:
        slots.free_job(_job_id(task))  # a terminated run's process never reaches its release
    _event(events.job_cancelled, task, attempt, while_running=True, by=None, duration=run_seconds)
    if task.on_cancelled is not None:
        try:
            task.on_cancelled(tuple(args), dict(kwargs))
        except Exception:
            logger.exception("on_cancelled hook of %s failed", task.name)


def call_on_dead(task: Runnable, exc: BaseException, args: Any, kwargs: Any) -> None:
    """Run the job's on_dead hook; its failure is logged, never raised over the original."""
    if task.on_dead is None:
        return
    try:
        task.on_dead(exc, tuple(args), dict(kwargs))
    except Exception:
        logger.exception("on_dead hook of %s failed", task.name)


def worker_lost(task: Runnable, exc: BaseException, *, args: Any, kwargs: Any) -> Exception | None:
    """A pool process died running the job: free the claim so the requeued message runs
    again, until it died MAX_WORKER_CRASHES times (a poison pill), when it gives up.
    Returns the reason it gave up with, or None."""
    job_id = _job_id(task)
    crashes = ledger.release(job_id=job_id, crashed=True)
    if task.concurrency_limit:
        slots.free_job(job_id)  # the dead process held its slot: the next waiter goes now
    if crashes < backlot_settings().MAX_WORKER_CRASHES:
        return None
    job = Job.objects.filter(id=job_id).only("attempts", "failures").first()
    reason = WorkerLostError(f"worker process died {crashes} times running this job: {exc}")
    give_up(
        task,
        reason,
        args=args,
        kwargs=kwargs,
        attempt=job.attempts if job else crashes,
        failures=list(job.failures) if job else [],
        traceback=str(exc),
        fenced=False,
    )
    return reason


def _schedule_retry(
    task: Runnable,
    args: tuple,
    kwargs: dict,
    attempt: int,
    failures: list[dict[str, Any]],
    exc: BaseException,
    delay: float,
    run_seconds: float | None,
    requested: RetryRequested | None = None,
) -> bool:
    """Record the failed attempt and publish the next; False if this run lost its claim.

    A self.retry() may give the next run other arguments and message options (priority,
    queue, headers, time limits): the ledger row takes the arguments, the message both."""
    job_id = _job_id(task)
    options: dict[str, Any] = {}
    if requested is not None:
        args = tuple(requested.args_override) if requested.args_override is not None else args
        kwargs = requested.kwargs_override if requested.kwargs_override is not None else kwargs
        options = requested.options
    due: datetime | None = timezone.now() + timedelta(seconds=delay)
    if task.track:
        due = ledger.retry_later(
            job_id=job_id,
            attempt=attempt,
            failures=failures,
            exc=exc,
            delay=delay,
            run_seconds=run_seconds or 0.0,
            lease_owner=_lease_owner(task),
            args=None if requested is None else list(args),
            kwargs=None if requested is None else dict(kwargs),
        )
        if due is None:
            refused("retry", job_id, attempt)
            return False
        if delay > backlot_settings().MAX_BROKER_COUNTDOWN:
            return True  # a long wait stays in the ledger; the relay publishes it when due
    if not resend(task, args, kwargs, due, {**options, "retries": attempt}) and not task.track:
        raise BrokerUnavailable(f"Retry of untracked job {job_id} could not be published")
    return True
