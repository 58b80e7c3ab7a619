"""Throttled progress writes: a tight loop of 100,000 steps costs a few UPDATEs, not 100,000.

Fenced by the run's claim (jobs.worker.lease): a run that lost it gets LeaseLost from its next
progress call, and its progress writes, which match the claim's token, change nothing."""

from __future__ import annotations

import logging
import threading
import time

from django.db import Error, connection, connections

from jobs import ledger
from jobs.core.exceptions import LeaseLost
from jobs.worker.lease import Hold, refused, renewer

logger = logging.getLogger(__name__)


class ProgressThrottle:
    """Writes at most once per `interval`; a skipped report is written when the interval ends."""

    def __init__(self, job_id: str, interval: float) -> None:
        self.job_id = job_id
        self.interval = interval
        self.hold: Hold | None = renewer.held(job_id)  # the run's claim, when it has one
        self.last_write = 0.0
        self.pending: tuple[int, int | None, str] | None = None
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()
        # The run's cancel check, kept here so that progress() reads it without touching
        # Celery's request (PlatformTask.progress sets both).
        self.next_cancel_check = 0.0
        self.cancel_seen = False

    def report(
        self, done: int, total: int | None, message: str, *, now: float | None = None
    ) -> None:
        if now is None:
            now = time.monotonic()
        final = total is not None and done >= total
        hold = self.hold
        if hold is not None and (hold.lost or now >= hold.deadline):
            self._lost(hold)
        if hold is not None and hold.write_claim is not None:
            try:
                hold.claim_now()  # a deferred claim is written before the run's first progress
            except LeaseLost:
                refused("progress", hold.job_id, hold.attempt)
                raise
        with self.lock:
            if final or now - self.last_write >= self.interval:
                self._cancel_timer()
                self.pending = None
                self.last_write = now
                write = True
            else:
                self.pending = (done, total, message)
                if self.timer is None:
                    self.timer = threading.Timer(
                        self.interval - (now - self.last_write), self._flush
                    )
                    self.timer.daemon = True
                    self.timer.start()
                write = False
        if write:
            self._write(done, total, message, in_run=True)

    def _flush(self) -> None:
        with self.lock:
            pending, self.pending, self.timer = self.pending, None, None
            self.last_write = time.monotonic()
        try:
            if pending is not None:
                self._write(*pending, in_run=False)
        finally:
            connections.close_all()  # this thread's own connection, opened by the write

    def _write(self, done: int, total: int | None, message: str, *, in_run: bool) -> None:
        """One progress UPDATE, matching the run's claim. A refused one loses the run (raised
        in the run's own thread, seen at its next call from the timer's); a database error is
        logged, not raised: progress is for watching, and the lease decides when to stop."""
        hold = self.hold
        try:
            written = ledger.progress(
                job_id=self.job_id,
                done=done,
                total=total,
                message=message,
                attempt=hold.attempt if hold else None,
                lease_owner=hold.lease_owner if hold else None,
            )
        except Error as exc:
            logger.warning("Job %s: progress not recorded (%s)", self.job_id, type(exc).__name__)
            if in_run and not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()  # reconnect at the next write
            return
        if hold is not None and not written and not hold.released:
            hold.lose("taken over")
            if in_run:
                self._lost(hold)

    def _lost(self, hold: Hold) -> None:
        refused("progress", hold.job_id, hold.attempt)
        hold.check()  # raises LeaseLost
        raise LeaseLost(hold.job_id, hold.lost)

    def close(self) -> None:
        """The run ended: drop the timer (the ledger's final state supersedes pending steps)."""
        with self.lock:
            self._cancel_timer()
            self.pending = None

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
