"""DEFER_CLAIM on the worker (jobs.ledger.deferred, jobs.broker.running): the claim a delivery
read but did not write, which its run writes when it needs it (jobs.worker.lease.Hold.claim_now,
the renewer's first round) or replaces with its one write at a short success. Which deliveries
defer their claim is jobs.worker.execution's call (deferred_delivery)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from jobs import ledger
from jobs.broker import running

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
