"""How a run ends in the ledger, and the worker-side helpers the run shares: succeeded, dead
(with its dead letter and the on_dead hook), cancelled while running, lost (a write refused
because the run no longer holds its claim), a busy database, a pool process that died.

jobs.worker.execution (the run and its retry decision) and PlatformRequest (the worker's main
process: hard time limit, worker lost, a terminated cancel) both end jobs through here.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from billiard.exceptions import WorkerLostError
from celery.exceptions import Ignore, Reject
from django.db import DatabaseError, InterfaceError, connection

from jobs import ledger
from jobs.broker import counters, slots
from jobs.core import context, events
from jobs.core.conf import backlot_settings
from jobs.models import Job, JobState
from jobs.worker import finishes
from jobs.worker.lease import refused
from jobs.worker.redelivery import Runnable, request_priority, request_queue

logger = logging.getLogger(__name__)

# Deliveries by what the claim made of them (a hash: outcome -> count; read by /metrics):
# "claimed", "deferred" (run without writing its claim: DEFER_CLAIM), "duplicate", "early",
# "missing", "adopted_elsewhere", "requeued" (the ledger could not be reached), "rate_limited"
# (re-sent for its turn).
DELIVERIES = "backlot:metrics:deliveries"


def count_delivery(outcome: str) -> None:
    """Count a delivery by what its claim made of it (jobs.broker.counters): a claimed or deferred
    one (every job's) goes out with its finish's counts, the others at once."""
    counters.add(DELIVERIES, outcome)
    if outcome not in ("claimed", "deferred"):
        counters.flush()


# The request key of a delivery's claim token: PlatformRequest draws it (a UUID) in the
# worker's main process for each message it receives, the request carries it to the pool
# process, whose claim writes it into the row (Job.lease_owner). Both processes then fence
# their writes for the run with it: the pool process's (progress, finish, effects) and the
# main process's (hard time limit, terminated cancel, worker lost, shutdown release).
CLAIM_TOKEN = "backlot_claim_token"
# DEFER_CLAIM: the answer of the run record the fetch took with the message (jobs.broker.fetch)
RUN_TAKEN = "backlot_run_taken"


def lease_owner(task: Runnable) -> str | None:
    """The claim token of this delivery's run: the one its claim wrote (the run's hold, in the
    pool process), else the one PlatformRequest drew for the delivery (the worker's main
    process). None for a run outside a worker (run_job, eager), fenced by the attempt alone."""
    hold = getattr(task.request, "_backlot_hold", None)
    if hold is not None:
        return str(hold.lease_owner) if hold.lease_owner is not None else None
    token = getattr(task.request, CLAIM_TOKEN, None)
    return str(token) if token else None


def lost(task: Runnable, write: str, attempt: int | None) -> NoReturn:
    """This run's `write` was refused (it lost its claim): logged, counted, and the delivery
    ends without an outcome (raises Ignore: Celery acks; the job's current run decides)."""
    refused(write, job_id_of(task), attempt)
    raise Ignore()


def _defaults(task: Runnable) -> ledger.Defaults:
    return ledger.Defaults(task.name, request_queue(task), request_priority(task))


def job_id_of(task: Runnable) -> str:
    job_id = task.request.id
    if job_id is None:
        raise RuntimeError(f"{task.name}: no job id outside a worker run")
    return str(job_id)


def send_event(signal: Any, task: Runnable, attempt: int, **arguments: Any) -> None:
    events.send(
        signal,
        task=task.name,
        job_id=job_id_of(task),
        queue=request_queue(task),
        attempt=attempt,
        **arguments,
    )


def succeeded(task: Runnable, attempt: int, duration: float, result: Any) -> None:
    if task.track:
        # ignore_result (the call's, else the task's): the row keeps no return value (Celery).
        kept = None if getattr(task.request, "backlot_discard_result", False) else result
        backend = getattr(task, "backend", None)
        if backend is not None:  # as Celery stores it: a returned AsyncResult as its id tuple
            kept = backend.prepare_value(kept)
        hold = getattr(task.request, "_backlot_hold", None)
        # DEFER_CLAIM: a run that did not write its claim succeeds in its one write
        tag = getattr(task.request, finishes.TAG, None)  # written with others (-P solo)
        written = (
            hold.take_deferred(
                lambda deferred: finishes.succeed(deferred, duration, kept, attempt, tag)
            )
            if hold is not None
            else None
        )
        if written and hold is not None:
            hold.finished_unclaimed = True
        if written is None:
            written = ledger.succeed(
                job_id=job_id_of(task),
                attempt=attempt,
                run_seconds=duration,
                result=kept,
                lease_owner=lease_owner(task),
            )
        if not written:
            lost(task, "succeed", attempt)
    send_event(events.job_succeeded, task, attempt, duration=duration, result=result)


def released_lost_run(task: Runnable, attempt: int) -> None:
    """The run raised LeaseLost: it lost its claim, or stopped itself before its lease could
    lapse. If this run still holds the claim, it frees it and hands its message back (the job
    runs again soon); otherwise the run that took the job over decides, and the message is
    acknowledged. Raises Reject or Ignore."""
    job_id, owner = job_id_of(task), lease_owner(task)
    freed = False
    if task.track and owner is not None:
        try:
            freed = ledger.release(job_id=job_id, attempt=attempt, lease_owner=owner) is not None
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
    job_id = job_id_of(task)
    if task.track and not ledger.busy_released(
        job_id=job_id, attempt=attempt, lease_owner=lease_owner(task)
    ):
        raise Ignore()  # this run lost its claim meanwhile; the job's current run decides
    logger.warning("Job %s: database busy; attempt %s not counted, requeued", job_id, attempt)
    raise Reject("the database is busy (locked)", requeue=True)


def worker_name(task: Runnable) -> str | None:
    """The worker running this request (Celery's node name), for the job's timeline."""
    hostname = getattr(task.request, "hostname", None)
    return str(hostname) if hostname else None


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
    owner: str | None = None,
) -> None:
    """The job is dead: its ledger row and dead letter (one transaction), the event, and the
    job's on_dead hook. `fenced`: only the run holding the claim of `attempt` may do it;
    `owner` (unfenced): only while the row still carries that claim token (a claim the
    caller has just released)."""
    dead_letter = ledger.give_up(
        job_id=job_id_of(task),
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
        lease_owner=lease_owner(task) if fenced else owner,
        worker=worker_name(task),
    )
    if dead_letter is None and (fenced or owner is not None) and task.track:
        lost(task, "dead", attempt)
    send_event(
        events.job_dead,
        task,
        attempt,
        duration=run_seconds,
        exception=exc,
        dead_letter_id=dead_letter.pk if dead_letter else None,
    )
    call_on_dead(task, job_id_of(task), exc, args, kwargs)


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
    owner = lease_owner(task)
    if (
        task.track
        and not ledger.run_cancelled(
            job_id=job_id_of(task),
            run_seconds=run_seconds,
            attempt=attempt if owner else None,
            lease_owner=owner,
        )
        and owner
    ):
        lost(task, "cancel", attempt)
    if task.concurrency_limit:
        slots.free_job(job_id_of(task))  # a terminated run's process never reaches its release
    send_event(
        events.job_cancelled, task, attempt, while_running=True, by=None, duration=run_seconds
    )
    if task.on_cancelled is not None:
        try:
            with context.hook_of(job_id_of(task)):
                task.on_cancelled(tuple(args), dict(kwargs))
        except Exception:
            logger.exception("on_cancelled hook of %s failed", task.name)


def call_on_dead(task: Runnable, job_id: Any, exc: BaseException, args: Any, kwargs: Any) -> None:
    """Run job `job_id`'s on_dead hook (jobs.current_job_id() names it there); its failure
    is logged, never raised over the original."""
    if task.on_dead is None:
        return
    try:
        with context.hook_of(job_id):
            task.on_dead(exc, tuple(args), dict(kwargs))
    except Exception:
        logger.exception("on_dead hook of %s failed", task.name)


def worker_lost(task: Runnable, exc: BaseException, *, args: Any, kwargs: Any) -> Exception | None:
    """A pool process died running the job: free the claim so the requeued message runs
    again, until it died MAX_WORKER_CRASHES times (a poison pill), when it gives up.
    Returns the reason it gave up with, or None. Fenced by the delivery's claim token: a
    run whose job another run took over (its lease lapsed while its process was stopped)
    changes nothing (raises Ignore, as every refused write)."""
    job_id, owner = job_id_of(task), lease_owner(task)
    crashes = ledger.release(job_id=job_id, crashed=True, lease_owner=owner)
    if crashes is None:
        if (
            owner is not None
            and Job.objects.filter(id=job_id, state=JobState.RUNNING)
            .exclude(lease_owner=owner)
            .exists()
        ):
            lost(task, "worker_lost", None)  # another run holds the job: its slot stays its own
        crashes = 0  # not running (it finished, or never started): nothing to count
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
        owner=owner,
    )
    return reason
