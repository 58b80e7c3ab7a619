"""A job's run on the worker: rate slot → claim → run → decide with the policy → persist →
publish → events, all before Celery acknowledges the message.

PlatformTask.__call__ hands a delivery to ``run``; PlatformRequest (the worker's main process)
calls ``attempt_failed`` for a hard time limit. How a run ends in the ledger (succeeded, dead,
cancelled, lost, worker lost) is jobs.worker.outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded
from celery.exceptions import Ignore, Reject, Retry
from django.db import DatabaseError
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from jobs import ledger
from jobs.broker import broker, counters, reservations, running, slots
from jobs.core import context, events, tracing
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import BrokerUnavailable, JobCancelled, LeaseLost
from jobs.core.policies import RetryDecision, RetryRequested, TimeLimitHit
from jobs.ledger import batch_finish
from jobs.models import Job
from jobs.worker import outcomes, parking, watchdog
from jobs.worker.deferred import DeferredClaim
from jobs.worker.lease import holding, refused, renewer
from jobs.worker.redelivery import Runnable, request_priority, request_queue, resend

logger = logging.getLogger(__name__)


@tracing.traced_run
def run(task: Runnable, args: tuple, kwargs: dict) -> Any:
    """One delivery of a job (in its consumer span): pass its gate (a rate or concurrency
    slot), claim, run, record; the slot is freed once the outcome is in the ledger."""
    held = slots.Slots()
    if reservations.carries_counts():  # this process acks the message: the ack writes the counts
        counters.carry()
    try:
        return _run(task, args, kwargs, held)
    finally:
        held.release()
        if getattr(task.request, "_backlot_unclaimed", False):  # DEFER_CLAIM's record
            task.request._backlot_unclaimed = False
            hold = getattr(task.request, "_backlot_hold", None)
            # a success in its one write leaves its record to its ack (reservations.ran)
            if hold is None or not hold.finished_unclaimed:
                with contextlib.suppress(RedisError):  # it lapses; the next delivery reads the row
                    running.end(str(task.request.id), getattr(task.request, outcomes.CLAIM_TOKEN))


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
        deferred = deferred_delivery(task, request, lease_seconds) if task.track else None
        if isinstance(deferred, ledger.Dropped):
            outcomes.count_delivery(deferred.reason)
            raise Ignore()
        if deferred is not None:
            claim = deferred.claim
            outcomes.count_delivery("deferred")
        elif task.track:
            claimed = ledger.claim_delivery(
                job_id=request.id,
                lease_seconds=lease_seconds,
                # the delivery's token (PlatformRequest's): the main process fences with it too
                lease_owner=getattr(request, outcomes.CLAIM_TOKEN, None),
                adopt=lambda: Job(
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
                outcomes.count_delivery(claimed.reason)
                raise Ignore()
            claim = claimed
            outcomes.count_delivery("claimed")
    except (DatabaseError, RedisError, KombuError, OSError) as exc:
        # The ledger or Redis is unreachable: hand the message back rather than ack it.
        logger.warning("Job %s could not be claimed (%s); message requeued", request.id, exc)
        outcomes.count_delivery("requeued")
        raise Reject(str(exc), requeue=True) from exc
    except (Ignore, Reject):
        raise
    except Exception as exc:  # e.g. a broken rate_key: the job cannot start, record why
        outcomes.give_up(task, exc, args=args, kwargs=kwargs, attempt=0, failures=[], fenced=False)
        raise
    attempt = claim.attempt if claim else (request.retries or 0) + 1
    failures = claim.failures if claim else []
    held.started = True
    tracing.set_attempt(attempt)
    outcomes.send_event(events.job_started, task, attempt)
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
        if deferred is not None:
            hold.write_claim = DeferredClaim(
                str(request.id),
                deferred.attempts,
                str(claim.lease_owner),
                timezone.now(),
                lease_seconds,
                assumed=deferred.assumed,
            )
    # Kept on Celery's per-request Context: the run's writes match its claim's token.
    request._backlot_hold = hold
    # A rate-limited run's code begins at most `limit` (+ 10 %) a second, whatever its claim took.
    held.pace()
    started = time.monotonic()

    def failed(exc: BaseException) -> None:
        attempt_failed(
            task,
            exc,
            args=args,
            kwargs=kwargs,
            attempt=attempt,
            failures=failures,
            run_seconds=time.monotonic() - started,
        )

    try:
        try:
            owner_id = claim.owner_id if claim else None
            with (
                context.running(
                    str(request.id), owner_id, hold.claim_now if hold is not None else None
                ),
                holding(hold),
                watchdog.limited(
                    task,
                    job_id=request.id,
                    attempt=attempt,
                    lease_owner=claim.lease_owner if claim else None,
                ),
            ):
                result = task.run(*args, **kwargs)
        except Ignore:
            raise  # a success (or a replacement, which wrote its claim)
        except BaseException as exc:
            # the failed run's outcome is a claimed run's (LeaseLost if not); an ending process
            # leaves it to the main process (jobs.worker.deferred.settle_ended)
            if hold is not None and not _ends_process(task, exc):
                hold.claim_now()
            raise
        finally:
            if hold is not None:  # the finish below is fenced; renewals stop first
                renewer.release(request.id)
    except Retry:
        raise
    except LeaseLost:
        outcomes.released_lost_run(task, attempt)
    except JobCancelled:
        outcomes.stopped_on_request(task, args, kwargs, attempt, time.monotonic() - started)
        raise Ignore() from None
    except parking.Parked as sleep:  # a durable sleep (jobs.worker.steps): no attempt spent
        parking.parked(task, args, kwargs, attempt, sleep, time.monotonic() - started)
        raise Ignore() from None
    except Ignore:  # the job decided it has nothing (more) to do
        if not getattr(request, "backlot_replaced", False):  # Task.replace() wrote its row
            outcomes.succeeded(task, attempt, time.monotonic() - started, None)
        raise
    except Reject as exc:
        # celery-types omits Reject's requeue/reason, which Reject.__init__ sets.
        if exc.requeue and task.track:  # type: ignore[attr-defined]
            owner = outcomes.lease_owner(task)
            ledger.release(job_id=request.id, attempt=attempt, lease_owner=owner)
            raise
        # Rejected for good: the job gives up with the Reject itself, as Celery stores it.
        request.backlot_give_up = True
        failed(exc)
        raise
    except Exception as exc:
        failed(exc)
        raise  # gave up: Celery records the failure and acknowledges after the dead letter
    except (SystemExit, KeyboardInterrupt) as exc:
        if _ends_process(task, exc):
            raise  # Celery's way: the pool process ends, the delivery is a lost worker's
        # A task of Django's Tasks API (jobs.flow.backends): as Django's backends do, one run,
        # FAILED with the exception's own class and traceback; the pool process lives on.
        request.backlot_give_up = True
        failed(exc)
        raise Ignore() from None  # recorded; Celery acknowledges the message
    finally:
        throttle = getattr(request, "_backlot_progress", None)
        if throttle is not None:
            throttle.close()
    outcomes.succeeded(task, attempt, time.monotonic() - started, result)
    return result


def _ends_process(task: Runnable, exc: BaseException) -> bool:
    """SystemExit or KeyboardInterrupt ends the run's process, unless exit_is_failure."""
    return isinstance(exc, (SystemExit, KeyboardInterrupt)) and not getattr(
        task, "exit_is_failure", False
    )


def deferred_delivery(
    task: Runnable, request: Any, lease_seconds: float
) -> ledger.Peeked | ledger.Dropped | None:
    """DEFER_CLAIM: this delivery's run recorded in Redis and its row read, when it may run
    without writing its claim first (jobs.ledger.deferred); Dropped when another run holds the
    job; None when it claims as before (a job the setting does not cover, a row that is not
    plainly waiting, a run that vanished before this delivery: the claim counts its crash)."""
    token = getattr(request, outcomes.CLAIM_TOKEN, None)
    job_id = str(request.id)
    # the record the fetch took with a stamped message (jobs.broker.fetch), else taken now
    started = getattr(request, outcomes.RUN_TAKEN, None)
    if token is None or not _defers(task):
        if token is not None and started in ("ok", "lapsed", "claimed"):
            running.end(job_id, token)  # taken for a run that claims: the ledger decides
        return None
    if started is None:
        started = running.start(job_id, token, lease_seconds)
    if started == "busy":
        logger.info("Job %s runs unclaimed elsewhere; duplicate delivery dropped", job_id)
        return ledger.Dropped("duplicate")
    request._backlot_unclaimed = True  # its record is dropped when the delivery ends
    if started == "lapsed":
        # a run of this job started unclaimed and vanished (its worker died): recorded as a
        # claim under a lapsed lease, which the claim path takes over, counting the crash
        ledger.run_lost(job_id=job_id, lease_owner=str(uuid.uuid4()))
        return None
    if started != "ok":
        return None  # a run wrote its claim row: the ledger's claim decides
    fresh = running.fresh(request)
    if fresh is not None:  # a young first message: its row waits unrun (jobs.broker.running)
        peeked: ledger.Peeked | None = ledger.unread(
            job_id=job_id,
            token=token,
            max_attempts=task.policy.max_attempts,
            owner_id=fresh.owner_id,
        )
    else:
        peeked = ledger.peek(job_id=job_id, token=token)
    if peeked is None:
        return None
    batch_finish.claimed(job_id=job_id, batch_id=None)  # peek took only rows of no batch
    return peeked


def _defers(task: Runnable) -> bool:
    """Whether this delivery may defer its claim: the setting, a Redis broker (whose restore
    and reconcile give back what a vanished run held), no gate (a slot's lease is the claim's),
    no terminating cancel (it finds the job by its running row). Prefork's pool processes too:
    the main process settles a run ended outside its code (jobs.worker.deferred)."""
    return (
        backlot_settings().DEFER_CLAIM
        and broker.lists_held_messages()
        and not task.cluster_rate_limit
        and not task.concurrency_limit
        and getattr(task, "cancel_mode", None) != "terminate"
    )


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
    when a retry was scheduled, Ignore when this run lost its claim; returns after giving up."""
    reason = (
        TimeLimitHit(str(exc) or "soft time limit")
        if isinstance(exc, SoftTimeLimitExceeded)
        else exc
    )
    # self.retry(): the ledger and the caller see the task's exception, not the request for it.
    requested = exc if isinstance(exc, RetryRequested) else None
    if requested is not None:
        reason = requested.reason
    if ledger.database_busy(reason):
        outcomes.busy_database(task, attempt)  # a wait, not a failed attempt: never a dead letter
    if task.track and outcomes.cancel_requested(outcomes.job_id_of(task)):
        # asked to stop, and it failed on the way out: cancelled, not retried or dead
        outcomes.stopped_on_request(task, args, kwargs, attempt, run_seconds)
        raise Ignore()
    if getattr(task.request, "backlot_give_up", False):
        # self.retry() past max_retries, or Reject(requeue=False): no retry, whatever the policy
        decision = RetryDecision(retry=False, delay=0.0)
    else:
        decision = task.policy.decide(requested or reason, attempt)
    if not decision.retry:
        outcomes.give_up(
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
    outcomes.send_event(
        events.job_retrying,
        task,
        attempt,
        duration=run_seconds,
        exception=reason,
        delay=decision.delay,
    )
    # celery-types wants an Exception and a numbers.Real; Celery takes any exception and a float.
    raise Retry(exc=reason, when=decision.delay)  # type: ignore[arg-type]


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
    job_id = outcomes.job_id_of(task)
    options: dict[str, Any] = {}
    if requested is not None:
        args = tuple(requested.args_override) if requested.args_override is not None else args
        kwargs = requested.kwargs_override if requested.kwargs_override is not None else kwargs
        options = requested.options
    due: datetime | None = timezone.now() + timedelta(seconds=delay)
    # A long wait stays in the ledger; the relay publishes it when due.
    held_by_broker = broker.takes_countdown(delay)
    # the row reads published (the relay sends no copy) where the relay can see a lost message
    marked = held_by_broker and broker.lists_held_messages()
    if task.track:
        due = ledger.retry_later(
            job_id=job_id,
            attempt=attempt,
            failures=failures,
            exc=exc,
            delay=delay,
            run_seconds=run_seconds or 0.0,
            lease_owner=outcomes.lease_owner(task),
            args=None if requested is None else list(args),
            kwargs=None if requested is None else dict(kwargs),
            publishing=marked,
            worker=outcomes.worker_name(task),
        )
        if due is None:
            refused("retry", job_id, attempt)
            return False
        if not held_by_broker:
            return True
    options = {**options, "retries": attempt}
    if resend(
        task, args, kwargs, due, options, mark_published=task.track and not marked, attempt=attempt
    ):
        return True
    if not task.track:
        raise BrokerUnavailable(f"Retry of untracked job {job_id} could not be published")
    ledger.unpublish(job_id)  # the broker is away: the relay publishes it when due
    return True
