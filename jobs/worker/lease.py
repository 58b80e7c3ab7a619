"""Keeps running jobs' claims alive, and fences the runs that lost theirs.

A claim is a short lease, renewed from one thread per process. A worker that dies (kill -9, a
lost host, a hard time limit) stops renewing; once the lease lapses the relay puts the job back
in the queue and the next claim may take it. Recovery is bounded by the lease, not by the
job's time limit or Redis' visibility timeout.

Every claim carries a token (Job.lease_owner). The run's writes (progress, finish, release) and
effect_once match it in the same statement or transaction, so a run whose job another run took
over changes nothing. A run also stops itself before its lease can lapse: once LOST_AT of the
lease has passed since the ledger last confirmed its claim (its renewals fail: a database
outage, a row lock, a stopped process, a C call that held the GIL), or a renewal finds the
claim gone, the run is lost: its next progress() or effect_once raises LeaseLost inside the
job, and the renewer interrupts a job that calls neither. In a pool process's main thread
(prefork, and -P solo) it sends the process STOP_SIGNAL at that thread, whose handler raises
LeaseLost there, as Celery's soft time limit raises SoftTimeLimitExceeded: it interrupts
sleeps and blocking system calls, not a C call that never returns to Python. Runs in threads
(-P threads) or greenlets (gevent, eventlet) are not interrupted: a signal reaches only the
main thread, and there it would hit whichever greenlet runs.

Two threads per process serve every job it runs: one keeps the schedule (renewals due, runs
past their deadline), the other does the renewals, so a renewal that blocks (a locked row, a
database that does not answer) never delays a run's stop. Starting threads per job cost more
than the job itself for short jobs (Thread.start waits for the new thread to run).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from django.db import close_old_connections, connections

from jobs import ledger
from jobs.broker.redis import redis_client
from jobs.core.exceptions import LeaseLost
from jobs.worker.deferred import DeferredClaim
from jobs.worker.stopper import Stopper

logger = logging.getLogger(__name__)

# A run counts as lost once this share of its lease has passed since the ledger last confirmed
# its claim: renewals run every third of the lease, so a healthy run is confirmed at 1/3 and
# 2/3 and never gets here; one that missed two renewals stops with a fifth of the lease (6 s
# of the default 30 s) left before another worker may take its job.
LOST_AT = 0.8
# After a failed renewal the next try comes this share of the lease later (not a full third).
RETRY_AFTER = 0.1
# Fenced writes refused and runs lost, by kind (a hash: "refused:<write>" / "lost:<cause>" ->
# count; read by /metrics).
FENCING = "backlot:metrics:fencing"


def count(field: str) -> None:
    """Count a fencing event in FENCING; never raises (Redis may be the thing that is down)."""
    try:
        redis_client().hincrby(FENCING, field, 1)
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a job
        logger.debug("Could not count %s: %s", field, exc)


def refused(write: str, job_id: str, attempt: int | None) -> None:
    """A write of a run that no longer holds its claim was refused: log it (ids only) and
    count it. `attempt` None: the worker's main process wrote for a run whose attempt it
    does not know."""
    run = "a run" if attempt is None else f"run of attempt {attempt}"
    logger.warning("Job %s: %s lost its claim; its %s was refused", job_id, run, write)
    count(f"refused:{write}")


@dataclass(eq=False)
class Hold:
    """One run's claim on a job, as its process sees it."""

    job_id: str
    attempt: int
    lease_owner: str | None
    lease_seconds: float
    confirmed: float  # time.monotonic() just before the claim or renewal the ledger last took
    lost: str = ""  # why the run lost its claim; empty while it holds it
    released: bool = False  # the run ended (its finish is its own business)
    failures: int = 0  # renewals failed in a row
    last_try: float = 0.0
    on_renew: Callable[[], None] | None = None  # renews what the run holds with it (a slot)
    told: bool = False  # LeaseLost was raised in the run (by a check or by the renewer's stop)
    renewing: bool = False  # a renewal of it is under way (the renewals thread has it)
    # DEFER_CLAIM: the claim this run has not written yet (jobs.ledger.deferred); None once
    # written (or the finish wrote in its place), or never deferred. Taken under `claiming`:
    # the run's finish and the renewer race for it.
    write_claim: DeferredClaim | None = None
    claiming: threading.Lock = field(default_factory=threading.Lock, repr=False)
    finished_unclaimed: bool = False  # its success was its one write (DEFER_CLAIM)

    @property
    def deadline(self) -> float:
        """When the run counts as lost unless a renewal confirms it first (monotonic)."""
        return self.confirmed + self.lease_seconds * LOST_AT

    def check(self, now: float | None = None) -> None:
        """Raise LeaseLost if the run lost its claim (or renewals stopped confirming it)."""
        if not self.lost and (time.monotonic() if now is None else now) >= self.deadline:
            self.lose("renewals failed")
        if self.lost:
            self.told = True
            raise LeaseLost(self.job_id, self.lost)

    def lose(self, cause: str, then: Callable[[Hold], object] | None = None) -> bool:
        """The run no longer holds its claim: `then(self)` (the renewer stops the run), then
        it is logged and counted, once (True that time)."""
        if self.lost or self.released:
            return False
        self.lost = cause
        if then is not None:
            then(self)  # before the log and the count: Redis may be slow or down
        logger.warning(
            "Job %s: run of attempt %s lost its claim (%s); it stops",
            self.job_id,
            self.attempt,
            cause,
        )
        count(f"lost:{cause.replace(' ', '_')}")
        return True

    def take_deferred(self, write: Callable[[DeferredClaim], bool]) -> bool | None:
        """Hand the deferred claim (once) to `write`, which writes it, or the run's finish in
        its place: its answer, or None when there is none left (written already, or never
        deferred). A write that raises leaves it to the next try."""
        with self.claiming:
            deferred = self.write_claim
            if deferred is None:
                return None
            started = time.monotonic()
            written = write(deferred)
            self.write_claim = None
            if written:
                self.confirmed = started
            return written

    def claim_now(self) -> None:
        """Write the deferred claim before a write that needs the claim row (progress, an
        effect, a step, a child, the outcome of a failed run); LeaseLost if the row changed
        since the delivery read it (cancelled, finished, taken by another run)."""
        if self.write_claim is None:
            return
        if self.take_deferred(DeferredClaim.write) is False:
            self.lose("taken over")
            self.told = True
            raise LeaseLost(self.job_id, self.lost or "taken over")

    def fence(self) -> None:
        """Confirm, inside the caller's transaction, that this run still holds its claim (the
        row stays locked until that transaction ends); LeaseLost if it does not."""
        self.check()
        if not ledger.renew(
            job_id=self.job_id,
            attempt=self.attempt,
            lease_seconds=self.lease_seconds,
            lease_owner=self.lease_owner,
        ):
            self.lose("taken over")
            self.told = True
            raise LeaseLost(self.job_id, self.lost or "taken over")


_current: ContextVar[Hold | None] = ContextVar("backlot_current_hold", default=None)


_stopper = Stopper()


@contextmanager
def holding(hold: Hold | None) -> Iterator[None]:
    """Inside a run: effect_once and progress find the run's claim here, and the renewer
    stops the run (raises LeaseLost in it) once the claim is lost."""
    token = _current.set(hold)
    armed = hold is not None and _stopper.arm(hold)
    try:
        yield
    finally:
        try:
            if armed and hold is not None:
                _stopper.disarm(hold)
        finally:  # a stop landing right here still leaves the run's context clean
            _current.reset(token)


class LeaseRenewer:
    """Renews each registered lease every third of its length, until it is released."""

    def __init__(self) -> None:
        self._leases: dict[str, Hold] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewals: threading.Thread | None = None
        self._due: queue.SimpleQueue[Hold] = queue.SimpleQueue()
        self._pid = 0
        self._nap = 5.0  # the renewer's current sleep between rounds

    def hold(
        self,
        *,
        job_id: str,
        attempt: int,
        lease_seconds: float,
        lease_owner: str | None = None,
        since: float | None = None,
        on_renew: Callable[[], None] | None = None,
    ) -> Hold:
        """Start renewing the lease of a run that has just been claimed (`since`: the monotonic
        time taken before the claim, whose lease runs from then); `on_renew()` runs after each
        renewal (a concurrency slot lasts as long as the lease: jobs.broker.slots)."""
        hold = Hold(
            job_id,
            attempt,
            lease_owner,
            lease_seconds,
            time.monotonic() if since is None else since,
            on_renew=on_renew,
        )
        with self._lock:
            self._leases[job_id] = hold
            self._ensure_thread()
            wake = lease_seconds / 3 < self._nap
        if wake:  # a shorter lease than those held must not wait out the current nap
            self._wake.set()
        return hold

    def release(self, job_id: str) -> None:
        with self._lock:
            hold = self._leases.pop(job_id, None)
        if hold is not None:
            hold.released = True

    def held(self, job_id: str) -> Hold | None:
        """The claim this process holds on `job_id` (the current run's), or None."""
        hold = _current.get()
        if hold is not None and hold.job_id == str(job_id):
            return hold
        with self._lock:
            return self._leases.get(str(job_id))

    def _ensure_thread(self) -> None:
        # A forked pool process inherits the object but not the threads: start its own.
        alive = (
            self._thread is not None
            and self._renewals is not None
            and self._thread.is_alive()
            and self._renewals.is_alive()
        )
        if self._pid != os.getpid() or not alive:
            self._pid = os.getpid()
            self._due = queue.SimpleQueue()  # a fresh one: an inherited one's lock may be held
            self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
            self._renewals = threading.Thread(
                target=self._renew_all, args=(self._due,), name="lease-renewals", daemon=True
            )
            self._thread.start()
            self._renewals.start()

    def _run(self) -> None:
        """The schedule: hands due renewals to the renewals thread, and stops the runs whose
        claim was not confirmed in time. Never blocks on the database."""
        while True:
            self._wake.clear()  # before the round: a wake-up during it is not lost
            now = time.monotonic()
            with self._lock:
                # Not confirmed in time: the run is lost, and stopped.
                expired = [hold for hold in self._leases.values() if now >= hold.deadline]
                for hold in expired:
                    del self._leases[hold.job_id]
                due = [
                    hold
                    for hold in self._leases.values()
                    if not hold.renewing and self._next(hold) <= now
                ]
                for hold in due:
                    hold.renewing = True
                wakes = [
                    hold.deadline if hold.renewing else min(self._next(hold), hold.deadline)
                    for hold in self._leases.values()
                ]
                nap = min(wakes, default=now + 5) - now
                self._nap = max(0.02, min(nap, 5.0))
            for hold in expired:
                self._lose(hold, "renewals failed")
            for hold in due:
                self._due.put(hold)
            self._wake.wait(self._nap)

    def _renew_all(self, due: queue.SimpleQueue[Hold]) -> None:
        while True:
            hold = due.get()
            try:
                self._renew(hold)
            except Exception:  # this thread must live on for the other runs
                logger.exception("Renewal of job %s failed", hold.job_id)
            finally:
                hold.renewing = False
                self._wake.set()  # the schedule counts from this renewal

    @staticmethod
    def _lose(hold: Hold, cause: str) -> None:
        """The run lost its claim: stop it (if its code runs in this process's main thread;
        otherwise its next progress call or effect raises)."""
        if not hold.lose(cause, then=_stopper.stop) and hold.lost and not hold.told:
            _stopper.stop(hold)  # lost elsewhere (a progress write's timer), not yet told

    @staticmethod
    def _next(hold: Hold) -> float:
        """When `hold` is next renewed: a third of the lease after it was last confirmed, and
        sooner again after a failure."""
        if hold.failures:
            return hold.last_try + hold.lease_seconds * RETRY_AFTER
        return hold.confirmed + hold.lease_seconds / 3

    def _renew(self, hold: Hold) -> None:
        started = hold.last_try = time.monotonic()
        try:
            close_old_connections()  # this thread's own connection, dropped if it broke
            # a deferred claim is written at the first renewal (the run outlived a third of
            # its lease); once written, renewals extend it
            held = None if hold.released else hold.take_deferred(DeferredClaim.write)
            if held is None:
                held = ledger.renew(
                    job_id=hold.job_id,
                    attempt=hold.attempt,
                    lease_seconds=hold.lease_seconds,
                    lease_owner=hold.lease_owner,
                )
        except Exception as exc:  # noqa: BLE001 - the next renewal may succeed before the deadline
            hold.failures += 1
            logger.warning(
                "Could not renew the lease of job %s (%s in a row): %s",
                hold.job_id,
                hold.failures,
                type(exc).__name__,
            )
            connections.close_all()
            return
        with self._lock:
            if hold.job_id not in self._leases or self._leases[hold.job_id] is not hold:
                return  # the run ended meanwhile
            if held:
                hold.confirmed, hold.failures = started, 0
            else:
                self._leases.pop(hold.job_id, None)  # another run took the job over
        if not held:
            self._lose(hold, "taken over")
        elif hold.on_renew is not None:
            try:
                hold.on_renew()
            except Exception as exc:  # noqa: BLE001 - the next round renews it again
                logger.warning("Could not renew the slot of job %s: %s", hold.job_id, exc)


renewer = LeaseRenewer()


def current() -> Hold | None:
    """The claim of the run this code runs in (set by jobs.worker.execution), or None."""
    return _current.get()
