"""DEFER_CLAIM on the worker (jobs.ledger.deferred, jobs.broker.running): the claim a delivery
read but did not write, which its run writes when it needs it (jobs.worker.lease.Hold.claim_now,
the renewer's first round) or replaces with its one write at a short success. Which deliveries
defer their claim is jobs.worker.execution's call (deferred_delivery).

A prefork worker's pool process that ends outside its run's code (killed: a crash, a hard time
limit, a terminating revoke, a cancel at shutdown) writes nothing; the worker's main process
settles its run (`settle_ended`) before it records the end as for a claimed run. One that stops
or sticks (SIGSTOP, C code holding the GIL) and so never writes its claim at its first renewal
is found by the main process once its record's lease lapsed (`PoolRuns`): its claim is written
under that lapsed lease, and the relay's sweep takes the job over as it takes a claimed run's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, close_old_connections
from django.utils import timezone
from redis.exceptions import RedisError

from jobs import ledger
from jobs.broker import broker, running
from jobs.core.conf import backlot_settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeferredClaim:
    """The claim a run read but did not write (DEFER_CLAIM; jobs.ledger.deferred): the row's
    attempt count its writes match, its token, when it started."""

    job_id: str
    attempts: int
    lease_owner: str
    started: datetime
    lease_seconds: float
    assumed: bool = False  # not read: a fresh first message's (jobs.ledger.deferred.unread)

    def write(self) -> bool:
        """Write it (the run needs its claim row); False if the row changed since the read."""
        written = ledger.claim_deferred(
            job_id=self.job_id,
            attempts=self.attempts,
            lease_owner=self.lease_owner,
            started=self.started,
            lease_seconds=self.lease_seconds,
        )
        if written:
            try:  # later deliveries take the claim path; the ledger decides either way
                running.claimed(self.job_id, self.lease_owner)
            except Exception as exc:  # noqa: BLE001 - Redis away: its record lapses
                logger.debug("Job %s: run record not marked claimed (%s)", self.job_id, exc)
        return written

    def succeed(self, run_seconds: float, result: Any) -> bool:
        """The run's success in the one write of an unclaimed run. A row that was not read
        and refuses it is read now: still waiting (with attempts this run could not know: an
        earlier run of it left no record here, a worker without DEFER_CLAIM), it takes the
        success; changed (cancelled, finished, claimed), it does not."""
        written = self._succeed(self.attempts, run_seconds, result)
        if written or not self.assumed:
            return written
        peeked = ledger.peek(job_id=self.job_id, token=self.lease_owner)
        if peeked is None or peeked.attempts == self.attempts:
            return False
        logger.info("Job %s: its row had %s attempts, not none", self.job_id, peeked.attempts)
        return self._succeed(peeked.attempts, run_seconds, result)

    def _succeed(self, attempts: int, run_seconds: float, result: Any) -> bool:
        return ledger.succeed_unclaimed(
            job_id=self.job_id,
            attempts=attempts,
            lease_owner=self.lease_owner,
            started=self.started,
            run_seconds=run_seconds,
            result=result,
        )


def settle_ended(job_id: str, token: str | None) -> bool:
    """A run whose pool process ended outside its code, in the worker's main process: if it
    had not written its claim (DEFER_CLAIM), its Redis record is marked claimed (the next
    delivery reads the row) and its claim is written now as the run would have written it (its
    start from the record), so that what follows (the crash count, the hard time limit, the
    release at shutdown) is recorded against it as against a claimed run, and the run's own
    claim, should its process outlive this, is refused (the attempt count moved on). True when
    a claim was written. Redis or the database away: logged; the record lapses with its lease
    and the next delivery counts the crash."""
    settings = backlot_settings()
    if token is None or not settings.DEFER_CLAIM or not broker.lists_held_messages():
        return False
    try:
        started = running.settle(job_id, token, settings.LEASE_SECONDS)
        if started is None:
            return False
        peeked = ledger.peek(job_id=job_id, token=token)
        if peeked is None:
            return False  # finished, cancelled, claimed since: the ledger decides
        return ledger.claim_deferred(
            job_id=job_id,
            attempts=peeked.attempts,
            lease_owner=token,
            started=datetime.fromtimestamp(started, UTC) if started > 0 else timezone.now(),
            lease_seconds=settings.LEASE_SECONDS,
        )
    except (RedisError, DatabaseError) as exc:
        logger.warning("Job %s: its unclaimed run not settled (%r)", job_id, exc)
        return False


# A pool process's run, as the worker's main process sees it: job id, claim token, its start
# (a UNIX time, when the pool process took it).
PoolRun = tuple[str, str, float]


class PoolRuns:
    """The worker's main process watching its pool processes' unclaimed runs (a prefork
    worker with DEFER_CLAIM): a run older than its lease whose record lapsed unclaimed is
    written as the claim it would have written, under that lapsed lease (ledger.run_lost);
    the relay's sweep then sends the job again and its next claim counts the crash, and the
    stopped run, if it resumes, finds its claim taken over and stops."""

    def __init__(self, active: Callable[[], Iterable[PoolRun]], lease_seconds: float) -> None:
        self.active, self.lease_seconds = active, lease_seconds
        self.done: set[tuple[str, str]] = set()  # runs that wrote their claim or ended

    def check(self) -> list[str]:
        """One round: the ids of the runs whose lapsed claim it wrote."""
        runs = [run for run in self.active() if time.time() - run[2] >= self.lease_seconds]
        self.done &= {(job_id, token) for job_id, token, _ in runs}
        written = []
        for job_id, token, _ in runs:
            if (job_id, token) in self.done:
                continue
            try:
                reply = running.lapsed(job_id, token)
                if reply == "done":
                    self.done.add((job_id, token))
                if reply != "lapsed":
                    continue
                if ledger.run_lost(job_id=job_id, lease_owner=token):
                    logger.warning(
                        "Job %s: its pool process ran it past its lease without writing its "
                        "claim; written under the lapsed lease, for the relay to send again",
                        job_id,
                    )
                    written.append(job_id)
                running.claimed(job_id, token)
                self.done.add((job_id, token))
            except (RedisError, DatabaseError) as exc:  # the next round tries again
                logger.warning("Job %s: its lapsed unclaimed run not written (%r)", job_id, exc)
        return written

    def run(self, stop: threading.Event) -> None:
        interval = min(max(self.lease_seconds / 6, 0.5), 5.0)
        while not stop.wait(interval):
            try:
                close_old_connections()  # this thread holds its connection for days
                self.check()
            except Exception:  # the watch goes on
                logger.exception("The pool's unclaimed runs were not checked")

    def start(self) -> threading.Event:
        """Watch from a daemon thread; set the event returned to stop it."""
        stop = threading.Event()
        threading.Thread(
            target=self.run, args=(stop,), name="backlot-pool-runs", daemon=True
        ).start()
        return stop
