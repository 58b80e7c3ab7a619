"""Worker and publisher hooks: database connections live across jobs the way they live
across requests, Backlot's messages carry no field twice, and a worker's main process records
what it takes from Redis, in the same step as it takes it, and keeps a heartbeat
(jobs.broker.reservations, jobs.broker.fetch)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import concurrency, current_app
from celery.concurrency import prefork, solo
from celery.signals import (
    before_task_publish,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from celery.worker import state
from django.db import close_old_connections

from jobs.broker import amqp, counters, fetch, heartbeat, reservations, unanswered
from jobs.broker.broker import BROKER_ERRORS, lists_held_messages, slim_message
from jobs.core.conf import backlot_settings
from jobs.worker import conflicts, deferred, finishes, outcomes, watchdog
from jobs.worker.task import PlatformTask

logger = logging.getLogger(__name__)


@task_prerun.connect
def recycle_connections(**kwargs: Any) -> None:
    """Before each job: close connections that errored or outlived CONN_MAX_AGE (Django's
    request_started hook, for jobs). With CONN_MAX_AGE=0 (SQLite) that is every job."""
    close_old_connections()


@before_task_publish.connect
def slim_platform_messages(
    sender: str | None = None,
    headers: dict[str, Any] | None = None,
    properties: dict[str, Any] | None = None,
    **kwargs: Any,
) -> None:
    if headers is None or properties is None:
        return
    task = current_app.tasks.get(sender or "")
    if isinstance(task, PlatformTask) and getattr(task, "adopted", True):  # not opted out
        slim_message(headers, properties)


@worker_init.connect
def refuse_conflicting_settings(sender: Any = None, **kwargs: Any) -> None:
    """A worker does not start with a Celery setting that contradicts the ledger
    (jobs.worker.conflicts): it exits (status 1) naming each and what to change, before it
    consumes anything. SystemExit, as Celery's signals log and swallow an Exception."""
    if sender is None:
        return
    found = conflicts.conflicts(conflicts.given_in_app(sender.app.conf))
    if found:
        lines = "\n".join(f"  - {conflict}" for conflict in found)
        raise SystemExit(
            f"Backlot: this worker's Celery settings contradict the job ledger:\n{lines}"
        )


@worker_init.connect
def record_reservations(sender: Any = None, **kwargs: Any) -> None:
    """Before the worker consumes: each message it takes is recorded as its own, so that
    the relay gives them back to their queue soon after it dies (not after the visibility
    timeout)."""
    if sender is not None:
        reservations.install(node=sender.hostname, app=sender.app)
        # ... and takes each in one step with its record (jobs.broker.fetch); with a stamped
        # message's run record where its run will not write its claim first (DEFER_CLAIM)
        inline, forks = _inline(sender), _pool_is(sender, prefork.TaskPool)
        settings = backlot_settings()
        fetching = fetch.install(
            runs=settings.DEFER_CLAIM and (inline or forks),
            inline=inline,
            free=_process_free(sender) if forks else None,
        )
        # ... and writes its short successes together, acknowledged once written (a prefork
        # pool process hands its back to the main process: hand_back_successes)
        if settings.DEFER_CLAIM and fetching and (inline or forks):
            finishes.install(
                size=settings.SUCCESS_BATCH, wait=settings.SUCCESS_BATCH_SECONDS, inline=inline
            )


def _inline(sender: Any) -> bool:
    """Whether the worker runs each job in its own main thread as it takes it (-P solo): a
    message it fetches starts at once, so its run record may be taken by the fetch (a thread
    pool's prefetched messages wait in its queue, and a record taken then would say running
    and count a crash for a job that never started; a prefork fetch takes it `reserved`, and
    only when a process is free: `_process_free`)."""
    return _pool_is(sender, solo.TaskPool)


def _process_free(sender: Any) -> Callable[[], bool]:
    """Whether the message a prefork worker fetches now goes to a free pool process at once:
    fewer requests reserved (received, not finished; a success whose write waits is finished)
    than the pool's processes."""
    processes = int(sender.concurrency or 1)
    reserved = state.reserved_requests
    return lambda: len(reserved) < processes


def _pool_is(sender: Any, kind: type) -> bool:
    pool = concurrency.get_implementation(sender.pool_cls)
    return isinstance(pool, type) and issubclass(pool, kind)


@worker_init.connect
def enforce_time_limits_in_solo(sender: Any = None, **kwargs: Any) -> None:
    """A `-P solo` worker runs its jobs in its own main thread, where Celery enforces no time
    limit: Backlot does (jobs.worker.watchdog), with the worker's own limits as defaults."""
    if sender is None:
        return
    if _inline(sender):
        watchdog.enable(soft=sender.soft_time_limit, hard=sender.time_limit)


@worker_ready.connect
def watch_pool_runs(sender: Any = None, **kwargs: Any) -> None:
    """A prefork worker deferring claims: its main process finds a pool process's run that
    outlived its lease without writing its claim (stopped, stuck), and writes it under that
    lapsed lease for the relay to take over (jobs.worker.deferred.PoolRuns)."""
    controller = getattr(sender, "controller", None)  # the consumer's worker
    if controller is None or not backlot_settings().DEFER_CLAIM or not lists_held_messages():
        return
    if _pool_is(controller, prefork.TaskPool):
        deferred.PoolRuns(_pool_runs, backlot_settings().LEASE_SECONDS).start()


def _pool_runs() -> list[deferred.PoolRun]:
    """The tracked runs the pool processes have taken: job id, claim token, start."""
    try:
        requests = list(state.active_requests)
    except RuntimeError:  # changed while copied: the next round reads it
        return []
    return [
        (str(request.id), str(token), float(request.time_start))
        for request in requests
        if getattr(request.task, "track", False)
        and request.time_start
        and (token := request._request_dict.get(outcomes.CLAIM_TOKEN))
    ]


@worker_ready.connect
def declare_undeliverable(sender: Any = None, **kwargs: Any) -> None:
    """On RabbitMQ: the queue Backlot's quorum queues give up on messages to, declared before
    any can be given up on (jobs.broker.amqp; the relay empties it)."""
    if not amqp.enabled():
        return
    try:
        amqp.declare_undeliverable()
    except BROKER_ERRORS as exc:  # the relay declares it on its next sweep
        logger.warning("Could not declare %s: %r", amqp.UNDELIVERABLE, exc)


@worker_ready.connect
def keep_worker_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    """Once the pool has started: the worker's heartbeat, refreshed from a thread, with its
    presence (the queues it was started with, its concurrency) that the cockpit reads
    (jobs.broker.heartbeat.workers_present) instead of an inspect broadcast."""
    presence = None
    if sender is not None:
        controller = getattr(sender, "controller", None)
        presence = {
            "queues": sorted(sender.app.amqp.queues.consume_from),
            "concurrency": getattr(controller, "concurrency", None),
        }
    heartbeat.keep_alive(presence)


@worker_shutdown.connect
def leave_presence(**kwargs: Any) -> None:
    """The worker stops: the cockpit stops listing it now, not a heartbeat's TTL later."""
    heartbeat.leave()


@worker_process_init.connect
def hand_back_successes(**kwargs: Any) -> None:
    """A prefork pool process's short successes go back to the main process unwritten, when it
    writes them together (jobs.worker.finishes.hand_back)."""
    finishes.hand_back(current_app.tasks)


@worker_process_init.connect
def hold_counters(**kwargs: Any) -> None:
    """A prefork pool process writes its metric counts on a timer, not with each finish
    (jobs.broker.counters.hold; METRICS_HOLD_SECONDS)."""
    counters.hold(backlot_settings().METRICS_HOLD_SECONDS)


@worker_process_shutdown.connect
@worker_shutdown.connect
def flush_counters(**kwargs: Any) -> None:
    """A pool process (which exits without atexit) or the worker writes its metric counts
    before it ends (jobs.broker.counters), and reads the replies to its jobs' enqueues
    (jobs.broker.unanswered)."""
    counters.flush()
    unanswered.flush()
