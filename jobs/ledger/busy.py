"""A busy database is a wait, not a failure: SQLite has one write lock, and a write that waited
past the connection's timeout fails with "database is locked". A ledger write tried again
(``when_free``), and a run whose own write found the database busy goes back to its queue
without spending an attempt (``busy_released``): neither ever ends in a dead letter.

PostgreSQL never says so (its row locks wait), so none of this ever fires there.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.db import OperationalError, connection
from django.db.models import F

from jobs.core.states import sources, target
from jobs.models import Job

logger = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")

# What SQLite says when its lock was held past the busy timeout (SQLITE_BUSY, SQLITE_LOCKED).
BUSY_MESSAGES = ("database is locked", "database table is locked", "database is busy")
# How long a ledger write keeps trying: three of the 20 s busy timeouts config/settings.py sets
# for SQLite. A finish that lands after the run's lease lapsed is still fenced by its attempt.
BUSY_RETRY_SECONDS = 60.0
BUSY_PAUSE = 0.2


def database_busy(exc: BaseException | None) -> bool:
    """Whether `exc` (or what it was raised from) is SQLite's "database is locked"."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        operational = isinstance(exc, OperationalError) or type(exc).__name__ == "OperationalError"
        if operational and any(text in str(exc).lower() for text in BUSY_MESSAGES):
            return True
        exc = exc.__cause__
    return False


def when_free(write: Callable[[], T], *, within: float = BUSY_RETRY_SECONDS) -> T:
    """Run a ledger write; while the database is busy, wait and run it again, for up to
    `within` seconds. Inside a caller's transaction a busy error is raised at once: the
    transaction is broken and only its owner can start it again."""
    deadline = time.monotonic() + within
    tries = 1
    while True:
        try:
            return write()
        except OperationalError as exc:
            if (
                not database_busy(exc)
                or connection.in_atomic_block
                or time.monotonic() + BUSY_PAUSE > deadline
            ):
                raise
            logger.warning("The database is busy (locked); ledger write tried again (%d)", tries)
        tries += 1
        time.sleep(BUSY_PAUSE)


def busy_retried(write: Callable[P, T]) -> Callable[P, T]:
    """A ledger write that waits out a busy database (see when_free)."""

    @functools.wraps(write)
    def retried(*args: P.args, **kwargs: P.kwargs) -> T:
        return when_free(lambda: write(*args, **kwargs))

    return retried


def busy_released(*, job_id: str, attempt: int, lease_owner: str | None = None) -> bool:
    """From running to queued, the attempt not counted: the run's own write found the database
    busy, which says nothing about the job. Only the run holding the claim of `attempt` (and
    of the claim token `lease_owner`, when given) may do it; False when it no longer does."""

    def release() -> int:
        rows = Job.objects.filter(id=job_id, state__in=sources("release"), attempts=attempt)
        if lease_owner is not None:  # attempts repeat once given back: the token does not
            rows = rows.filter(lease_owner=lease_owner)
        return rows.update(
            state=target("release"), lease_expires_at=None, attempts=F("attempts") - 1
        )

    return bool(when_free(release))
