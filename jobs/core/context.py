"""Who a job is for, carried along every path that enqueues one.

Two context variables: the job running in this process (set by jobs.worker.execution for the length
of
a run) and the user the code acts for (``acting_as(user)``, which jobs.web.middleware sets for every
request). enqueue() gives a new job the owner passed to it, else the user acted for, else the
owner of the running job that enqueues it (a fan-out, a canvas member or callback); and it
records the running job as the new job's parent, so a cancel reaches what a job fanned out.
A third variable names the batch that jobs enqueued inside ``with jobs.batch(...)`` join, and a
fourth the job whose on_dead or on_cancelled hook runs now (``current_job_id()`` reads it: a hook
may run in the relay's or the canceller's process, outside any run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    owner_id: int | None
    # Called before the run enqueues a child (the run's deferred claim is written first).
    before_child: Callable[[], None] | None = None


@dataclass
class JoiningBatch:
    """The batch that jobs enqueued now join (jobs.flow.batches opens it), with what they added:
    the batch's counters take them at the end of its block, in the same transaction."""

    batch_id: str
    added: int = 0  # members written, waiting to run
    born_cancelled: int = 0  # members written cancelled (enqueued by a job asked to stop)


_running: ContextVar[RunningJob | None] = ContextVar("backlot_running_job", default=None)
_joining: ContextVar[JoiningBatch | None] = ContextVar("backlot_joining_batch", default=None)
_acting_for: ContextVar[Any] = ContextVar("backlot_acting_for", default=None)
_hook_of: ContextVar[str | None] = ContextVar("backlot_hook_of", default=None)


@contextmanager
def acting_as(user: Any) -> Iterator[None]:
    """Jobs enqueued inside the block belong to `user` (a user, or a request whose `user` is
    read when a job is enqueued: API authentication sets it after middleware ran)."""
    token = _acting_for.set(user)
    try:
        yield
    finally:
        _acting_for.reset(token)


@contextmanager
def running(
    job_id: str, owner_id: int | None, before_child: Callable[[], None] | None = None
) -> Iterator[None]:
    """Inside a job's run (jobs.worker.execution)."""
    token = _running.set(RunningJob(job_id, owner_id, before_child))
    try:
        yield
    finally:
        _running.reset(token)


def running_job() -> RunningJob | None:
    return _running.get()


@contextmanager
def hook_of(job_id: Any) -> Iterator[None]:
    """Inside the on_dead or on_cancelled hook of job `job_id` (whichever process calls it)."""
    token = _hook_of.set(str(job_id))
    try:
        yield
    finally:
        _hook_of.reset(token)


def current_job_id() -> str | None:
    """The id of the job whose code runs now: inside its run (its steps too) or inside its
    on_dead / on_cancelled hook, in whichever process calls the hook. None elsewhere."""
    hook = _hook_of.get()
    if hook is not None:
        return hook
    running = _running.get()
    return running.job_id if running is not None else None


@contextmanager
def joining(batch: JoiningBatch | None) -> Iterator[JoiningBatch | None]:
    """Jobs enqueued inside the block join `batch` (None: no batch, even inside another's)."""
    token = _joining.set(batch)
    try:
        yield batch
    finally:
        _joining.reset(token)


def joining_batch() -> JoiningBatch | None:
    return _joining.get()


def acting_user() -> Any:
    """The authenticated user the code acts for, or None."""
    who = _acting_for.get()
    user = getattr(who, "user", who) if who is not None and not hasattr(who, "pk") else who
    return user if getattr(user, "is_authenticated", False) and getattr(user, "pk", None) else None
