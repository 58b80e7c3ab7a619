"""Keeps a running job's claim alive: a short lease, renewed from a thread while it runs.

A worker that dies (kill -9, a lost host, a hard time limit) stops renewing; once the lease
lapses the relay puts the job back in the queue and the next claim may take it. Recovery is
bounded by the lease, not by the job's time limit or Redis' visibility timeout.
"""

from __future__ import annotations

import logging
import threading

from django.db import connections

from . import services

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews the lease of one claimed run every third of its length until stopped."""

    def __init__(self, *, job_id: str, attempt: int, lease_seconds: float) -> None:
        self.job_id, self.attempt, self.lease_seconds = job_id, attempt, lease_seconds
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)

    def start(self) -> LeaseKeeper:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        try:
            while not self.stopped.wait(self.lease_seconds / 3):
                try:
                    if not services.job_renew_lease(
                        job_id=self.job_id, attempt=self.attempt, lease_seconds=self.lease_seconds
                    ):
                        return  # the run finished, or lost its claim
                except Exception as exc:  # the next renewal may succeed; two misses lapse it
                    logger.warning("Could not renew the lease of job %s: %s", self.job_id, exc)
        finally:
            connections.close_all()  # this thread's own connection
