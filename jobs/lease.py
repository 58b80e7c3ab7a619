"""Keeps running jobs' claims alive: a short lease, renewed from one thread per process.

A worker that dies (kill -9, a lost host, a hard time limit) stops renewing; once the lease
lapses the relay puts the job back in the queue and the next claim may take it. Recovery is
bounded by the lease, not by the job's time limit or Redis' visibility timeout.

One renewer thread per process serves every job it runs: starting a thread per job cost more
than the job itself for short jobs (Thread.start waits for the new thread to run).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from django.db import close_old_connections, connections

from . import ledger

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    job_id: str
    attempt: int
    lease_seconds: float
    renewed: float  # time.monotonic() of the claim or the last renewal


class LeaseRenewer:
    """Renews each registered lease every third of its length, until it is released."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._nap = 5.0  # the renewer's current sleep between rounds

    def hold(self, *, job_id: str, attempt: int, lease_seconds: float) -> None:
        """Start renewing the lease of a run that has just been claimed."""
        with self._lock:
            self._leases[job_id] = _Lease(job_id, attempt, lease_seconds, time.monotonic())
            self._ensure_thread()
            wake = lease_seconds / 3 < self._nap
        if wake:  # a shorter lease than those held must not wait out the current nap
            self._wake.set()

    def release(self, job_id: str) -> None:
        with self._lock:
            self._leases.pop(job_id, None)

    def _ensure_thread(self) -> None:
        # A forked pool process inherits the object but not the thread: start its own.
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                due = [
                    lease
                    for lease in self._leases.values()
                    if time.monotonic() - lease.renewed >= lease.lease_seconds / 3
                ]
                nap = min((lease.lease_seconds / 3 for lease in self._leases.values()), default=5)
                self._nap = max(0.05, min(nap, 5.0))
            for lease in due:
                self._renew(lease)
            self._wake.wait(self._nap)
            self._wake.clear()

    def _renew(self, lease: _Lease) -> None:
        try:
            close_old_connections()  # this thread's own connection, dropped if it broke
            held = ledger.renew(
                job_id=lease.job_id, attempt=lease.attempt, lease_seconds=lease.lease_seconds
            )
        except Exception as exc:  # noqa: BLE001 - the next renewal may succeed; two misses lapse it
            logger.warning("Could not renew the lease of job %s: %s", lease.job_id, exc)
            connections.close_all()
            return
        with self._lock:
            if not held:  # the run finished, or lost its claim
                self._leases.pop(lease.job_id, None)
            elif lease.job_id in self._leases:
                lease.renewed = time.monotonic()


renewer = LeaseRenewer()
