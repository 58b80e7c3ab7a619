"""Cancel: a waiting job never runs, a running one stops, and so do the jobs it fanned out.

A waiting job (queued, scheduled, retrying) is cancelled in the ledger at once; its message,
whenever it arrives, is dropped at claim, so the cancellation survives worker and Redis
restarts. A running job gets a request: `self.cancelled()` turns true and its next
`self.progress()` raises JobCancelled; a job declared `@job(cancel="terminate")` has its pool
process killed (a Celery revoke with terminate), and the worker records it cancelled. Either
way: no retry, no dead letter. A revoke sent from Flower or `celery control revoke` becomes
the same ledger cancellation (the worker's revoke command is wrapped below).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import current_app
from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import Panel
from django.db import close_old_connections, transaction
from redis.exceptions import RedisError

from jobs import ledger
from jobs.broker import slots
from jobs.broker.running import hold_back
from jobs.core import context, events
from jobs.core.exceptions import AlreadyFinished, UnknownTask
from jobs.core.states import ACTIVE_STATES, FINISHED_STATES, JobState
from jobs.models import Job
from jobs.worker.registry import task_by_name

logger = logging.getLogger(__name__)

# The signal a terminating cancel kills the pool process with: SIGKILL cannot be caught, so
# the process and (with PR_SET_PDEATHSIG, see media_pipeline.ffmpeg) its children stop at once.
TERMINATE_SIGNAL = "SIGKILL"


@dataclass(frozen=True)
class Cancellation:
    """What cancel() did: `cancelled` jobs will never run; `requested` ones are running and were
    asked to stop (terminated when declared so)."""

    job_id: str
    state: str  # the job's state after the call
    cancelled: list[str] = field(default_factory=list)
    requested: list[str] = field(default_factory=list)


def cancel(job_id: Any, *, by: Any = None) -> Cancellation:
    """Cancel a job and every job it fanned out; raises Job.DoesNotExist for an unknown id and
    AlreadyFinished (with the current state) when its work has ended.

    A job that succeeded after fanning out is waiting on its children (the status API says
    `waiting_children`) until they end: cancelling it cancels what has not finished of the
    work under it, marks it (its status then reads cancelled) and runs its on_cancelled hook.
    """
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(id=job_id).first()
        if job is None:
            raise Job.DoesNotExist(f"No job {job_id}")
        if job.state in FINISHED_STATES:
            return _cancel_children(job, by=by)
        waiting, running = _with_descendants(job)
        # Under the row lock of the root: two cancels of one tree do not both act on it.
        _cancel_waiting([j.id for j in waiting])
        ledger.request_cancel([j.id for j in running])
        transaction.on_commit(lambda: _after_commit(waiting, running, by))
    job.refresh_from_db(fields=["state"])
    return Cancellation(
        job_id=str(job.id),
        state=job.state,
        cancelled=[str(j.id) for j in waiting],
        requested=[str(j.id) for j in running],
    )


def _cancel_children(job: Job, *, by: Any) -> Cancellation:
    """cancel() of a finished job, under its row lock: the active jobs anywhere under it."""
    if job.children_cancelled:
        # cancelled once already: what its children's end still queues (a batch's settling
        # callback) is theirs to finish
        raise AlreadyFinished(str(job.id), JobState.CANCELLED)
    active = active_descendants(job.id) if job.state == JobState.SUCCEEDED else []
    if not active:
        raise AlreadyFinished(str(job.id), job.state)
    waiting = [j for j in active if j.state != JobState.RUNNING]
    running = [j for j in active if j.state == JobState.RUNNING]
    _cancel_waiting([j.id for j in waiting])
    ledger.request_cancel([j.id for j in running])
    ledger.children_cancelled(job.id)

    def after_commit() -> None:
        _after_commit(waiting, running, by)
        _call_on_cancelled(job)

    transaction.on_commit(after_commit)
    return Cancellation(
        job_id=str(job.id),
        state=JobState.CANCELLED,
        cancelled=[str(j.id) for j in waiting],
        requested=[str(j.id) for j in running],
    )


def active_descendants(job_id: Any) -> list[Job]:
    """The jobs not finished anywhere under `job_id` (through finished children too: a
    finished transcode's settling job may still wait)."""
    found: list[Job] = []
    seen = {job_id}
    frontier: deque[Any] = deque([job_id])
    while frontier:
        parents = [frontier.popleft() for _ in range(len(frontier))]
        for child in Job.objects.filter(parent_id__in=parents).only(
            "id", "state", "task_name", "queue", "args", "kwargs", "attempts"
        ):
            if child.id in seen:
                continue
            seen.add(child.id)
            frontier.append(child.id)
            if child.state in ACTIVE_STATES:
                found.append(child)
    return found


def _with_descendants(root: Job) -> tuple[list[Job], list[Job]]:
    """The active jobs of the tree under `root` (root included): (waiting, running)."""
    waiting: list[Job] = []
    running: list[Job] = []
    seen = {root.id}
    frontier: deque[Job] = deque([root])
    while frontier:
        job = frontier.popleft()
        (running if job.state == JobState.RUNNING else waiting).append(job)
        for child in Job.objects.filter(parent_id=job.id, state__in=ACTIVE_STATES).only(
            "id", "state", "task_name", "queue", "args", "kwargs", "attempts"
        ):
            if child.id not in seen:
                seen.add(child.id)
                frontier.append(child)
    return waiting, running


def _after_commit(cancelled: list[Job], requested: list[Job], by: Any) -> None:
    _leave_gates(cancelled)
    for job in cancelled:
        events.send(
            events.job_cancelled,
            task=job.task_name,
            job_id=str(job.id),
            queue=job.queue,
            attempt=job.attempts,
            while_running=False,
            by=by,
        )
        _call_on_cancelled(job)
    terminate = [str(job.id) for job in requested if _terminates(job.task_name)]
    if terminate:
        current_app.control.revoke(terminate, terminate=True, signal=TERMINATE_SIGNAL)


def _leave_gates(cancelled: list[Job]) -> None:
    """Cancelled jobs waiting for a rate or concurrency slot leave their gate (jobs.broker.slots),
    so the slot goes to the next waiter instead."""
    try:
        slots.forget(job.id for job in cancelled if _limited(job.task_name))
    except RedisError as exc:  # their messages are dropped at claim, which frees the slot
        logger.warning(
            "Could not take %d cancelled jobs out of their gates: %s", len(cancelled), exc
        )


def _limited(task_name: str) -> bool:
    try:
        task = task_by_name(task_name)
    except UnknownTask:
        return False
    return bool(task.cluster_rate_limit or task.concurrency_limit)


def _terminates(task_name: str) -> bool:
    try:
        return task_by_name(task_name).cancel_mode == "terminate"
    except UnknownTask:
        return False


def _call_on_cancelled(job: Job) -> None:
    """Run the job's on_cancelled hook (jobs.current_job_id() names the job there); its
    failure is logged, never raised."""
    try:
        hook = task_by_name(job.task_name).on_cancelled
    except UnknownTask:
        return
    if hook is None:
        return
    try:
        with context.hook_of(job.id):
            hook(tuple(job.args), dict(job.kwargs))
    except Exception:
        logger.exception("on_cancelled hook of %s failed", job.task_name)


def _cancel_waiting(job_ids: list[Any]) -> None:
    """Waiting jobs cancelled: never run. Their run records are marked first (DEFER_CLAIM,
    jobs.broker.running.hold_back), so that a fresh message of theirs reads the cancelled row
    rather than run unread; Redis refusing the mark refuses the cancel (RedisError)."""
    hold_back(job_ids)
    ledger.cancel_waiting(job_ids)


def cancel_many(job_ids: Iterable[Any], *, by: Any = None) -> tuple[int, int]:
    """Cancel each job that has not ended; returns (cancelled or asked to stop, already ended)."""
    done = ended = 0
    for job_id in job_ids:
        try:
            cancel(job_id, by=by)
            done += 1
        except (AlreadyFinished, Job.DoesNotExist):
            ended += 1
    return done, ended


# --- a revoke from Flower or `celery control revoke` ----------------------------------------
_celery_revoke = Panel.data["revoke"]


def _revoke(
    state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kw: Any
) -> Any:
    """Celery's revoke command, recorded in the ledger first: a revoke kept only in worker
    memory is forgotten when workers restart (celery#8888)."""
    ids = [str(i) for i in (maybe_list(task_id) or [])]
    try:
        _cancel_waiting(ids)
        ledger.request_cancel(ids)
    except Exception:
        logger.exception("Could not record the revoke of %s jobs in the ledger", len(ids))
    if not terminate:
        return _celery_revoke(state, task_id, terminate=terminate, signal=signal, **kw)
    # Celery kills the pool process; the processes it started (ffmpeg) would outlive it as
    # orphans, so they are killed too, but after it: a job whose child died first could go on
    # (child.wait() returns) and record itself succeeded before its process is killed.
    pools = [
        int(request.worker_pid)
        for request in worker_state.active_requests
        if request.id in ids and request.worker_pid
    ]
    doomed = [child for pid in pools for child in _descendants(pid)]
    try:
        return _celery_revoke(state, task_id, terminate=terminate, signal=signal, **kw)
    finally:
        _wait_gone(pools, timeout=1.0)
        _kill(doomed)


# --- a revoke by stamped headers (app.control.revoke_by_stamped_headers) ----------------------
_celery_revoke_by_stamped_headers = Panel.data["revoke_by_stamped_headers"]


def stamped(headers: Any) -> list[str]:
    """The active jobs whose message carries one of these stamps ({"monitoring_id": [v, ...]}
    or Celery's ["monitoring_id=v"]): the ledger keeps each stamp with its job's options."""
    if isinstance(headers, list):
        headers = dict(header.split("=", 1) for header in headers)
    found: list[str] = []
    for header, values in (headers or {}).items():
        wanted = [str(v) for v in maybe_list(values) or []]
        rows = (
            Job.objects.active()
            .filter(**{f"publish_options__{header}__isnull": False})
            .only("id", "publish_options")
        )
        for job in rows.iterator(chunk_size=1000):
            stamps = job.publish_options.get(header)
            if header in (job.publish_options.get("stamped_headers") or ()) and any(
                str(stamp) in wanted for stamp in maybe_list(stamps) or []
            ):
                found.append(str(job.id))
    return found


def _revoke_by_stamped_headers(
    state: Any, headers: Any, terminate: bool = False, signal: Any = None, **kw: Any
) -> Any:
    """Celery's revoke by stamped headers, recorded in the ledger first, like a revoke by id:
    the jobs carrying a matching stamp that wait never run (their messages are dropped at
    claim, also after a worker restart, which forgets Celery's revoked stamps), running ones
    are asked to stop. A message sent later with the stamp is discarded at delivery by
    Celery and its job cancelled then (PlatformRequest)."""
    try:
        close_old_connections()  # the worker's main process holds its connection for days
        ids = stamped(headers)
        _cancel_waiting(ids)
        ledger.request_cancel(ids)
    except Exception:
        logger.exception("Could not record the revoke by stamped headers in the ledger")
    return _celery_revoke_by_stamped_headers(
        state, headers, terminate=terminate, signal=signal, **kw
    )


def _descendants(pid: int) -> list[int]:
    """Every process descended from `pid` (Linux /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    doomed, frontier = [], list(children.get(pid, []))
    while frontier:
        child = frontier.pop()
        doomed.append(child)
        frontier.extend(children.get(child, []))
    return doomed


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _wait_gone(pids: list[int], timeout: float) -> None:
    """Wait (bounded) until each process has ended: gone, or a zombie not yet reaped."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                break  # gone (or no /proc: nothing to wait on)
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                break
            time.sleep(0.001)


Panel.data["revoke"] = _revoke
Panel.data["revoke_by_stamped_headers"] = _revoke_by_stamped_headers
