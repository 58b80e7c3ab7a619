"""The relay: publishes what the ledger holds back — the outbox (jobs whose message never
reached Redis), due scheduled and retrying jobs, jobs of workers whose lease lapsed (counted as
crashes), the messages dead workers had taken (jobs.broker.reservations), and jobs whose message the
broker lost. Runs from `manage.py jobs relay` and every few seconds from beat.

Duplicates it may cause are harmless: a worker claims a job once.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta
from typing import Any

from billiard.exceptions import WorkerLostError
from django.db import DatabaseError
from django.db.models import Count, Q
from django.utils import timezone
from redis.exceptions import RedisError

from jobs import ledger
from jobs.broker import amqp, broker, queues, restore, slots
from jobs.broker.concurrency import Gates
from jobs.broker.redis import redis_client
from jobs.core import events
from jobs.core.conf import backlot_settings
from jobs.core.exceptions import UnknownTask
from jobs.core.options import check_arguments
from jobs.core.states import WAITING_STATES
from jobs.enqueue.publish import publish_job
from jobs.models import Job, JobState
from jobs.worker import outcomes
from jobs.worker.registry import task_by_name

logger = logging.getLogger(__name__)

# The relay leaves a fresh unpublished row alone this long: its on-commit publish is in flight.
RELAY_GRACE = timedelta(seconds=10)
# A job still waiting this long after it was published (or became due) while its queue is empty
# in Redis has lost its message.
RELAY_LOST_AFTER = timedelta(seconds=30)
# How many running jobs were re-queued because their lease lapsed (a count; read by /metrics).
LEASE_LAPSES = "backlot:metrics:lease_lapses"
# Waiting jobs per task name the relay found no job for (a hash, refreshed every sweep that saw
# one and kept 2 minutes after; read by /health/ and /metrics).
UNKNOWN_TASKS = "backlot:relay:unknown_tasks"
UNKNOWN_TASKS_TTL = 120
# Task names this process has no job for. Reported once each; their rows stay in the ledger and
# later sweeps skip them (this process learns no new task before it restarts), so they never
# crowd the outbox's `limit` out.
_unknown_tasks: set[str] = set()


def job_relay(*, limit: int = 500) -> int:
    """One sweep; returns how many jobs it published."""
    now = timezone.now()
    conf = backlot_settings()
    _lapsed_leases(now)
    if amqp.enabled():
        _undeliverable()  # RabbitMQ gives a dead worker's messages back itself
    else:
        _restore_reservations()
    # Reconcile: a waiting job (queued, or a scheduled/retrying one whose time has come)
    # published longer ago than Redis would take to redeliver it was lost by the broker
    # (restart without AOF, FLUSHDB, a pop without ack, a worker killed holding it): send it
    # again. A retry's message is as mortal as a first one.
    ledger.republish(
        now=now,
        published_before=now - timedelta(seconds=conf.VISIBILITY_TIMEOUT + 60),
        lost_after=RELAY_LOST_AFTER,
    )
    # Sooner where the broker shows it: a queue with no message at all (none waiting, none
    # taken and unacknowledged anywhere; dead workers' messages were given back above) cannot
    # be holding the message of a job that waits on it past its time.
    waiting = _gate_queues()
    for queue in queues.idle_queues(conf.QUEUES):
        if queue in waiting:
            continue  # its jobs wait at their gates (jobs.broker.slots), not in the broker's lists
        ledger.republish(
            now=now,
            published_before=now - RELAY_LOST_AFTER,
            lost_after=RELAY_LOST_AFTER,
            queue=queue,
        )
    missing = _resend_missing(now, skip=waiting)
    skipped = sorted(_unknown_tasks)
    # The outbox: rows whose publish failed or whose message was lost, past the grace an
    # enqueue's own publish after commit may take; those just found missing from Redis at once.
    pending = list(
        Job.objects.unpublished()
        .filter(Q(enqueued_at__lt=now - RELAY_GRACE) | Q(id__in=missing))
        .exclude(task_name__in=skipped)
        .order_by("enqueued_at")[:limit]
    ) + list(Job.objects.due(now).exclude(task_name__in=skipped).order_by("scheduled_for")[:limit])
    sent = 0
    for job in pending:
        outcome = _publish_one(job)
        if outcome is False:
            break  # the broker is unavailable: the rest wait for the next sweep
        sent += outcome is True
    _report_unknown_tasks()
    return sent + _sweep_gates()


# Messages found missing from Redis and sent again (a count; read by /metrics).
MISSING_RESENT = "backlot:metrics:missing_resent"
# A waiting job published (and due) this long ago whose message Redis holds nowhere is sent
# again. The check reads what Redis holds, so it needs no long margin: by then a message is in
# its list, in a worker's unacked hash, or its job runs; a copy re-sent in error (one popped
# the instant of the read) is dropped at claim. An enqueue inserts its row marked published
# (jobs.enqueue.submit), so a process that dies between its commit and its publish leaves a
# job only this finds: within MISSING_AFTER + MISSING_EVERY + one RELAY_INTERVAL (4 + 4 + 5 s
# by default) of the crash it is sent again (tests/system/faults/test_commit_publish.py).
MISSING_AFTER = timedelta(seconds=4)
MISSING_SCAN = "backlot:relay:missing-scan:"  # + queue: the throttle of that read
MISSING_EVERY = 4


def _resend_missing(now: datetime, *, skip: set[str]) -> list[str]:
    """Back into the outbox: waiting jobs past their time, published MISSING_AFTER ago,
    whose message is in none of their queue's lists and in no worker's hands. Such a message
    was lost: most often popped by a consumer killed before it recorded the message as taken
    (kombu's BRPOP, then its `unacked` write: two steps), or dropped by a Redis restart without
    AOF or a FLUSHALL. The idle-queue reconcile above cannot see it while any other message is
    unacknowledged anywhere, which on a working cluster is always; the visibility-timeout one
    waits 2 h. Queues of more than queues.MAX_SCANNED messages are left to those. Returns the
    ids put back (the sweep publishes them at once)."""
    resent: list[str] = []
    count = 0
    for queue in backlot_settings().QUEUES:
        if queue in skip:
            continue  # its jobs wait at their gates (jobs.broker.slots), not in the broker's lists
        waiting = ledger.waiting_but_due(
            now, MISSING_AFTER, queue=queue, published_at__lt=now - MISSING_AFTER
        )
        if not waiting.exists():
            continue
        try:  # one read per queue per MISSING_AFTER, cluster-wide: it reads every message
            if not redis_client().set(f"{MISSING_SCAN}{queue}", 1, nx=True, ex=MISSING_EVERY):
                continue
        except RedisError:
            continue
        held = queues.held_job_ids(queue)  # None: too many to read, or Redis cannot tell
        if held is None:
            continue
        suspects = waiting.values_list("id", flat=True)[: queues.MAX_SCANNED]
        missing = [str(job_id) for job_id in suspects if str(job_id) not in held]
        if not missing:
            continue
        count += ledger.republish(
            now=now,
            published_before=now - MISSING_AFTER,
            lost_after=MISSING_AFTER,
            queue=queue,
            job_ids=missing,
        )
        resent += missing  # (those claimed meanwhile stay published: the sweep skips them)
        logger.warning(
            "relay: %d job(s) of queue %s waiting past their time have no message in Redis "
            "(e.g. %s); sending them again",
            len(missing),
            queue,
            missing[0],
        )
    if count:
        with contextlib.suppress(RedisError):
            redis_client().incrby(MISSING_RESENT, count)
    return resent


def _gate_queues() -> set[str]:
    try:
        return Gates().waiting_queues()
    except RedisError:
        return set(backlot_settings().QUEUES)  # unknown: assume every queue has waiters


def _sweep_gates() -> int:
    """Let waiting jobs through the slots nobody finished a job to free: a dead worker's slot
    (its lease lapsed), a rare rate token, a key whose waiters were never woken."""
    try:
        return slots.sweep()
    except RedisError as exc:
        logger.warning("relay: could not sweep the gates: %s", exc)
        return 0


def _publish_one(job: Job) -> bool | None:
    """Publish one row the relay holds back: True once sent, False when the broker is
    unavailable (the row waits), None when the row itself cannot be sent.

    A row cannot be sent when no job of its name is registered (reported once, left in the
    ledger for a deploy that brings it back, or for an operator to cancel), or when publishing
    it fails for a reason of its own: arguments that no longer fit the job's signature (a row
    written before a deploy changed it), options Celery refuses. That row is dead-lettered with
    the reason, and the sweep goes on: one bad row never holds up the outbox.
    """
    try:
        task = task_by_name(job.task_name)
    except UnknownTask:
        if job.task_name not in _unknown_tasks:
            _unknown_tasks.add(job.task_name)
            logger.error(
                "Jobs of unknown task %s (job %s first) are left in the ledger: no installed "
                "module defines it; deploy it, or cancel them (`manage.py jobs cancel`)",
                job.task_name,
                job.id,
            )
        return None
    try:
        check_arguments(task, job.args, job.kwargs)
        return publish_job(job=job, task=task)
    except (DatabaseError, *broker.BROKER_ERRORS):
        raise  # the ledger or Redis is away, not this row: the sweep fails and runs again
    except Exception as exc:  # noqa: BLE001 - this row's own problem: dead-letter it, go on
        logger.error(
            "Job %s (%s) cannot be published (%s): dead-lettered",
            job.id,
            job.task_name,
            type(exc).__name__,
        )
        _dead(job, exc, task)
        return None


def _dead(job: Job, exc: BaseException, task: Any) -> None:
    """A waiting job the relay gives up on: its dead letter, then the announcement."""
    dead_letter = ledger.give_up(
        job_id=str(job.id),
        defaults=ledger.Defaults(job.task_name, job.queue, job.priority),
        args=job.args,
        kwargs=job.kwargs,
        attempt=job.attempts,
        exc=exc,
        failures=list(job.failures or []),
    )
    _announce_dead(job, exc, dead_letter.pk if dead_letter else None, task)


def _announce_dead(job: Job, exc: BaseException, dead_letter_id: int | None, task: Any) -> None:
    """A job the relay dead-lettered: the job_dead event, then its on_dead hook (if its task is
    known here)."""
    events.send(
        events.job_dead,
        task=job.task_name,
        job_id=str(job.id),
        queue=job.queue,
        attempt=job.attempts,
        duration=None,
        exception=exc,
        dead_letter_id=dead_letter_id,
    )
    if task is not None:
        outcomes.call_on_dead(task, job.id, exc, job.args, job.kwargs)


def _report_unknown_tasks() -> None:
    """Publish how many waiting jobs name each unknown task, for /health/ and /metrics."""
    if not _unknown_tasks:
        return
    counts = dict(
        Job.objects.active_where(state__in=WAITING_STATES, task_name__in=sorted(_unknown_tasks))
        .values_list("task_name")
        .annotate(n=Count("id"))
        .order_by()
    )
    try:
        pipe = redis_client().pipeline()
        pipe.delete(UNKNOWN_TASKS)
        if counts:
            pipe.hset(UNKNOWN_TASKS, mapping=counts)
            pipe.expire(UNKNOWN_TASKS, UNKNOWN_TASKS_TTL)
        pipe.execute()
    except RedisError as exc:  # Redis is away: health says so on its own
        logger.warning("relay: could not record jobs of unknown tasks: %s", exc)


def unknown_tasks() -> dict[str, int]:
    """Waiting jobs per task name that no installed module defines, as the relay last saw them
    ({} when none, or when no relay swept in the last UNKNOWN_TASKS_TTL seconds)."""
    raw = redis_client().hgetall(UNKNOWN_TASKS)
    return {
        (name.decode() if isinstance(name, bytes) else name): int(count)
        for name, count in raw.items()
    }


def _lapsed_leases(now: datetime) -> None:
    """Running jobs whose lease lapsed: their worker died, or stopped renewing. A lapse counts
    as a crash of the job, like a pool process dying under it: the job goes back to the queue,
    and the MAX_WORKER_CRASHES-th lapse sends it to the dead letters instead (a job that takes
    its whole worker down would otherwise be re-queued after every lapse, forever)."""
    cap = backlot_settings().MAX_WORKER_CRASHES
    capped = list(
        Job.objects.active_where(
            state=JobState.RUNNING, lease_expires_at__lt=now, crashes__gte=cap - 1
        ).only("id", "task_name", "queue", "attempts", "crashes", "args", "kwargs")[:100]
    )
    dead = 0
    for job in capped:
        exc = WorkerLostError(
            f"worker lost {job.crashes + 1} times running this job (its lease lapsed: the "
            "worker died, or stopped renewing it)"
        )
        dead_letter = ledger.lapsed_lease_dead(job_id=str(job.id), now=now, exc=exc)
        if dead_letter is None:
            continue  # renewed, claimed or finished meanwhile
        dead += 1
        logger.error(
            "Job %s (%s) gave up: its worker was lost %d times running it",
            job.id,
            job.task_name,
            job.crashes + 1,
        )
        task = None  # no task, no hook: the dead letter names it
        with contextlib.suppress(UnknownTask):
            task = task_by_name(job.task_name)
        _announce_dead(job, exc, dead_letter.pk, task)
    lapsed = dead + ledger.lapsed_leases_requeued(now=now, max_crashes=cap)
    if lapsed:
        try:
            redis_client().incrby(LEASE_LAPSES, lapsed)
        except RedisError as exc:  # Redis is away: the sweep goes on, the count misses these
            logger.warning("relay: could not count %d lapsed lease(s): %s", lapsed, exc)


def _undeliverable() -> None:
    """Messages a quorum queue gave up on (delivered AMQP_DELIVERY_LIMIT times: a job whose
    runs never ended, its worker dying or its claim failing each time) become dead letters,
    never a silent broker drop (jobs.broker.amqp)."""
    try:
        amqp.drain_undeliverable(_dead_undeliverable)
    except broker.BROKER_ERRORS as exc:  # RabbitMQ is away: the next sweep tries again
        logger.warning("relay: could not read the undeliverable messages: %s", exc)


def _dead_undeliverable(messages: list[tuple[str, str]]) -> None:
    """An expired message (Celery's `expires`, which RabbitMQ applies as the message's TTL)
    ends its job cancelled, as a worker discards one on Redis; any other reason (the delivery
    limit) makes it a dead letter."""
    expired = [job_id for job_id, reason in messages if reason == "expired"]
    for job_id in expired:
        _expired(job_id)
    given_up = [job_id for job_id, reason in messages if reason != "expired"]
    limit = backlot_settings().AMQP_DELIVERY_LIMIT
    for job in Job.objects.filter(id__in=given_up, state__in=WAITING_STATES):
        exc = WorkerLostError(
            f"RabbitMQ delivered this job's message {limit + 1} times (x-delivery-limit "
            f"{limit}) and no run of it ended"
        )
        logger.error("Job %s (%s) gave up: %s", job.id, job.task_name, exc)
        task = None
        with contextlib.suppress(UnknownTask):
            task = task_by_name(job.task_name)
        _dead(job, exc, task)


def _expired(job_id: str) -> None:
    if not ledger.cancel_discarded(job_id, reason="expired"):
        return  # not waiting any more: cancelled, running or finished
    job = Job.objects.filter(id=job_id).only("task_name", "queue", "attempts").first()
    if job is not None:
        events.send(
            events.job_cancelled,
            task=job.task_name,
            job_id=job_id,
            queue=job.queue,
            attempt=job.attempts,
            while_running=False,
            by=None,
        )


def _restore_reservations() -> None:
    """Messages that dead workers (heartbeat gone) had taken and not acknowledged go back to
    the head of their queues now, not after the visibility timeout (jobs.broker.restore)."""
    try:
        restore.restore_lost(settled=_settled)
    except broker.BROKER_ERRORS as exc:  # Redis is away: the next sweep tries again
        logger.warning("relay: could not restore dead workers' messages: %s", exc)
    except Exception:  # the outbox goes on whatever this step hit
        logger.exception("relay: restoring dead workers' messages failed")


def _settled(job_ids: list[str]) -> set[str]:
    """Of these jobs, those whose message would be a duplicate: running (their lease brings
    them back if their worker died) or finished."""
    return {
        str(job_id)
        for job_id in Job.objects.filter(id__in=job_ids)
        .exclude(state__in=WAITING_STATES)
        .values_list("id", flat=True)
    }
