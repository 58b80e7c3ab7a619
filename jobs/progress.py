"""Throttled progress writes: a tight loop of 100,000 steps costs a few UPDATEs, not 100,000."""

from __future__ import annotations

import threading
import time

from django.db import connections

from . import ledger


class ProgressThrottle:
    """Writes at most once per `interval`; a skipped report is written when the interval ends."""

    def __init__(self, job_id: str, interval: float) -> None:
        self.job_id = job_id
        self.interval = interval
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
            ledger.progress(job_id=self.job_id, done=done, total=total, message=message)

    def _flush(self) -> None:
        with self.lock:
            pending, self.pending, self.timer = self.pending, None, None
            self.last_write = time.monotonic()
        try:
            if pending is not None:
                ledger.progress(
                    job_id=self.job_id, done=pending[0], total=pending[1], message=pending[2]
                )
        finally:
            connections.close_all()  # this thread's own connection, opened by the write

    def close(self) -> None:
        """The run ended: drop the timer (the ledger's final state supersedes pending steps)."""
        with self.lock:
            self._cancel_timer()
            self.pending = None

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
