"""Who a job is for, carried along every path that enqueues one.

Two context variables: the job running in this process (set by jobs.execution for the length of
a run) and the user the code acts for (``acting_as(user)``, which jobs.middleware sets for every
request). enqueue() gives a new job the owner passed to it, else the user acted for, else the
owner of the running job that enqueues it (a fan-out, a canvas member or callback); and it
records the running job as the new job's parent, so a cancel reaches what a job fanned out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    owner_id: int | None


_running: ContextVar[RunningJob | None] = ContextVar("backlot_running_job", default=None)
_acting_for: ContextVar[Any] = ContextVar("backlot_acting_for", default=None)


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
def running(job_id: str, owner_id: int | None) -> Iterator[None]:
    """Inside a job's run (jobs.execution)."""
    token = _running.set(RunningJob(job_id, owner_id))
    try:
        yield
    finally:
        _running.reset(token)


def running_job() -> RunningJob | None:
    return _running.get()


def acting_user() -> Any:
    """The authenticated user the code acts for, or None."""
    who = _acting_for.get()
    user = getattr(who, "user", who) if who is not None and not hasattr(who, "pk") else who
    return user if getattr(user, "is_authenticated", False) and getattr(user, "pk", None) else None
