"""A worker's short successes, written together (DEFER_CLAIM; SUCCESS_BATCH).

A short job that ran without writing its claim (jobs.ledger.deferred) ends in one UPDATE, and
a solo worker running such jobs one after another spent about half its time on it (py-spy,
benchmarks/README.md, stop 44). Here the success waits, and so does its message's
acknowledgement (jobs.broker.reservations.HeldAcks); the successes of several runs are written
in one statement (jobs.ledger.succeed_unclaimed_many). A prefork pool process writes none: it
hands its run's success back to the worker's main process with the run's end (`HandedBack`,
in the return value's repr Celery sends back), which writes them as a solo worker does:

- as soon as SUCCESS_BATCH of them wait, by the run that made them so many (-P solo; in a
  prefork main process, by the thread below, so that its event loop never waits on the write);
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
import os
import threading
import time
from collections.abc import Callable
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

    def __init__(self, size: int, wait: float, *, inline: bool = True) -> None:
        self.size, self.wait = size, wait
        self.inline = inline  # a full batch is written by the run that filled it
        self.pid = os.getpid()  # the worker's main process (a pool process inherits this)
        self.lock = threading.Condition()
        self.waiting: list[_Waiting] = []
        self.deadline: float | None = None  # when the thread writes (None: not due)
        self.thread: threading.Thread | None = None
        self.writing = threading.Lock()  # one write at a time, in whichever thread

    def add(self, deferred: DeferredClaim, success: ledger.Success, attempt: int, tag: str) -> bool:
        """A run's success, to be written with others; its message's ack waits for it."""
        held_acks.hold(tag)
        with self.lock:
            self.waiting.append(_Waiting(deferred, success, attempt, tag))
            full = len(self.waiting) >= self.size
            if full and not self.inline:
                self._due(time.monotonic())
            elif not full and self.deadline is None:
                self._due(time.monotonic() + self.wait)
        if full and self.inline:
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

    def write_at_close(self) -> None:
        """As the channel closes (a warm shutdown), in the event loop's thread: its connection
        may have idled since its last job (a prefork main process's), so a broken one is
        replaced first."""
        close_old_connections()
        self.write()

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


def install(*, size: int, wait: float, inline: bool = True) -> None:
    """In a worker's main process (worker_init), `-P solo` or prefork: its short successes are
    written together, up to `size` at a time and `wait` seconds after the first; off for `size`
    1. `inline`: a full batch is written by the run that filled it (-P solo)."""
    _finishes.pop("on", None)
    if size > 1:
        finishes = _finishes["on"] = Finishes(size, wait, inline=inline)
        held_acks.before_restore.append(finishes.write_at_close)


def on() -> bool:
    return "on" in _finishes


def succeed(
    deferred: DeferredClaim, run_seconds: float, result: Any, attempt: int, tag: str | None
) -> bool:
    """A deferred run's success: to be written with others where this worker writes them so
    (its message's `tag` known), else written now. False when its row refused it. In a prefork
    pool process it is handed back to the main process (`hand_back`), which writes it."""
    finishes = _finishes.get("on")
    if tag is None or (finishes is None and not _hand["on"]):
        return deferred.succeed(run_seconds, result)
    success = ledger.Success(
        deferred.job_id,
        deferred.attempts,
        deferred.lease_owner,
        deferred.started,
        timezone.now(),
        run_seconds,
        result,
    )
    if finishes is None:
        _handing[:] = [(deferred, success, attempt)]
        return True
    return finishes.add(deferred, success, attempt, tag)


# In a prefork pool process (`hand_back`): the success of the run it is in, for its main
# process to write.
_hand = {"on": False}
_handing: list[tuple[DeferredClaim, ledger.Success, int]] = []


class HandedBack(str):
    """The repr of a run's return value, which Celery sends from the pool process to the main
    process (and logs), with the run's success for the main process to write (`handed`)."""

    handed: tuple[DeferredClaim, ledger.Success, int]

    def __new__(cls, text: str, handed: tuple[DeferredClaim, ledger.Success, int]) -> HandedBack:
        self = super().__new__(cls, text)
        self.handed = handed
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (HandedBack, (str(self), self.handed))


Trace = Callable[..., tuple[Any, Any, Any, Any]]


def hand_back(tasks: dict[str, Any]) -> None:
    """In a prefork pool process (worker_process_init): the successes its runs leave unwritten
    (their requests carry the message's tag when the main process writes them together) go
    back with the runs' ends. Celery's tracer returns (result, failure, runtime, repr); the
    repr is what reaches the main process for a success, so it carries the success."""
    mine = _finishes.get("on")
    if mine is not None and mine.pid == os.getpid():
        return  # the worker's main process (-P solo sends worker_process_init too)
    _finishes.pop("on", None)  # the main process's, inherited through fork
    _hand["on"] = True
    for task in tasks.values():
        traced = getattr(task, "__trace__", None)
        if getattr(task, "track", False) and traced is not None:
            task.__trace__ = _handing_back(traced)


def _handing_back(trace: Trace) -> Trace:
    def traced(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        _handing.clear()
        result, failure, runtime, text = trace(*args, **kwargs)
        if _handing:
            handed = _handing.pop()
            if failure is None:
                return result, failure, runtime, HandedBack(text, handed)
            try:  # it failed after its success (a hook or signal raised): written here
                handed[0].succeed(handed[1].run_seconds, handed[1].result)
            except Exception:
                logger.exception("Job %s: its success could not be written", handed[0].job_id)
        return result, failure, runtime, text

    return traced


def handed(retval: Any, tag: str | None) -> Any:
    """In the main process, a pool process's run that ended: its success, if it handed one
    back, waits to be written with others (its message's ack with it). Celery's own repr of
    the return value is what goes on."""
    if not isinstance(retval, HandedBack):
        return retval
    deferred, success, attempt = retval.handed
    finishes = _finishes.get("on")
    if finishes is None or tag is None:  # not written together here: written now
        if not deferred.succeed(success.run_seconds, success.result):
            refused("succeed", deferred.job_id, attempt)
    else:
        finishes.add(deferred, success, attempt, tag)
    return str(retval)
