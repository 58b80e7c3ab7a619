"""A `-P solo` worker's short successes, written together (DEFER_CLAIM; SUCCESS_BATCH).

A short job that ran without writing its claim (jobs.ledger.deferred) ends in one UPDATE, and
a solo worker running such jobs one after another spent about half its time on it (py-spy,
benchmarks/README.md, stop 44). Here the success waits, and so does its message's
acknowledgement (jobs.broker.reservations.HeldAcks); the successes of several runs are written
in one statement (jobs.ledger.succeed_unclaimed_many):

- as soon as SUCCESS_BATCH of them wait, by the run that made them so many;
- SUCCESS_BATCH_SECONDS after the first of them ended, by a thread of this module's (the event
  loop's thread may be busy with a longer job by then);
- before the channel gives back what it holds (a warm shutdown: HeldAcks.before_restore).

Only then are their messages acknowledged. A worker that dies with successes unwritten leaves
their messages unacknowledged: they go back to their queue and their jobs run again, as a run
that died before its end does (at least once; effect_once keeps effects once). Until its
success is written a job reads running (its run record, jobs.broker.running), as while it ran.
A write the database refuses is retried (the messages wait, held); a row that changed since
its delivery read it (cancelled, claimed by another run) is not written, and counted refused.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.db import InterfaceError, OperationalError, close_old_connections
from django.utils import timezone

from jobs import ledger
from jobs.broker.reservations import held_acks
from jobs.worker.deferred import DeferredClaim
from jobs.worker.lease import refused

logger = logging.getLogger(__name__)

# A write the database refused (it is away) is tried again this long (s) after.
RETRY_SECONDS = 1.0
# The request's field with its message's delivery tag (jobs.worker.request), while on.
TAG = "backlot_tag"


@dataclass(frozen=True)
class _Waiting:
    deferred: DeferredClaim
    success: ledger.Success
    attempt: int
    tag: str


class Finishes:
    """The successes waiting to be written in one worker process, and the thread that writes
    them when no run did within `wait` seconds."""

    def __init__(self, size: int, wait: float) -> None:
        self.size, self.wait = size, wait
        self.lock = threading.Condition()
        self.waiting: list[_Waiting] = []
        self.deadline: float | None = None  # when the thread writes (None: not due)
        self.thread: threading.Thread | None = None
        self.writing = threading.Lock()  # one write at a time, in whichever thread

    def add(
        self, deferred: DeferredClaim, run_seconds: float, result: Any, attempt: int, tag: str
    ) -> bool:
        """A run's success, to be written with others; its message's ack waits for it."""
        held_acks.hold(tag)
        success = ledger.Success(
            deferred.job_id,
            deferred.attempts,
            deferred.lease_owner,
            deferred.started,
            timezone.now(),
            run_seconds,
            result,
        )
        with self.lock:
            self.waiting.append(_Waiting(deferred, success, attempt, tag))
            full = len(self.waiting) >= self.size
            if not full and self.deadline is None:
                self._due(time.monotonic() + self.wait)
        if full:
            self.write()
        return True

    def write(self) -> None:
        """Write every waiting success, then let their messages be acknowledged."""
        with self.writing:
            with self.lock:
                batch, self.waiting = self.waiting, []
                self.deadline = None  # all of them are written now: the thread waits for more
            if not batch:
                return
            try:
                written, together = ledger.succeed_unclaimed_many([w.success for w in batch]), True
            except (OperationalError, InterfaceError) as exc:  # away: they wait, held
                logger.warning(
                    "%d job success(es) not written (%s); trying again in %s s",
                    len(batch),
                    exc,
                    RETRY_SECONDS,
                )
                with self.lock:
                    self.waiting[:0] = batch
                    self._due(time.monotonic() + RETRY_SECONDS)
                return
            except Exception:  # a row the statement could not take: each is written alone
                logger.exception("%d job successes not written together", len(batch))
                written, together = set(), False
            released = []
            for waiting in batch:
                job_id = waiting.success.job_id
                alone = None if job_id in written else _written_alone(waiting, tried=together)
                if alone is False:
                    refused("succeed", job_id, waiting.attempt)
                if job_id in written or alone is not None:
                    released.append(waiting.tag)
            held_acks.release(released)

    def _due(self, when: float) -> None:
        """The thread writes at `when` (or earlier, if it was due earlier); under the lock."""
        if self.deadline is not None and self.deadline <= when:
            return
        self.deadline = when
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._loop, name="backlot-finishes", daemon=True)
            self.thread.start()
        else:
            self.lock.notify()

    def _loop(self) -> None:
        while True:
            with self.lock:
                if self.deadline is None:
                    self.lock.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.lock.wait(left)
                    continue
                self.deadline = None
            close_old_connections()  # this thread's own connection: a broken one is replaced
            try:
                self.write()
            except Exception:  # this thread must live on for the next successes
                logger.exception("Writing the waiting job successes failed")


def _written_alone(waiting: _Waiting, *, tried: bool) -> bool | None:
    """A success the statement did not write, tried alone: each, after a statement that
    failed; after one that refused it (`tried`), a row that was not read (a fresh first
    message's) only, which may hold attempts its run could not know (jobs.worker.deferred).
    None when the write raised: its message stays held (it goes back to its queue with this
    holder's)."""
    if tried and not waiting.deferred.assumed:
        return False
    try:
        return waiting.deferred.succeed(waiting.success.run_seconds, waiting.success.result)
    except Exception:
        logger.exception("Job %s: its success could not be written", waiting.success.job_id)
        return None


_finishes: dict[str, Finishes] = {}


def install(*, size: int, wait: float) -> None:
    """In a `-P solo` worker's main process (worker_init): its short successes are written
    together, up to `size` at a time and `wait` seconds after the first; off for `size` 1."""
    _finishes.pop("on", None)
    if size > 1:
        finishes = _finishes["on"] = Finishes(size, wait)
        held_acks.before_restore.append(finishes.write)


def on() -> bool:
    return "on" in _finishes


def succeed(
    deferred: DeferredClaim, run_seconds: float, result: Any, attempt: int, tag: str | None
) -> bool:
    """A deferred run's success: to be written with others where this worker writes them so
    (its message's `tag` known), else written now. False when its row refused it."""
    finishes = _finishes.get("on")
    if finishes is None or tag is None:
        return deferred.succeed(run_seconds, result)
    return finishes.add(deferred, run_seconds, result, attempt, tag)
