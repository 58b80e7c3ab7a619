"""Stopping a run whose claim is lost, wherever its code is (jobs.worker.lease's renewer
calls it): in a pool process's main thread a signal at that thread raises LeaseLost there, as
Celery's soft time limit raises SoftTimeLimitExceeded. Runs in other threads or greenlets are
not interrupted (a signal reaches only the main thread)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Protocol

from jobs.core.exceptions import LeaseLost

# The signal the renewer stops a lost run with (at the process's main thread). Not SIGUSR1:
# billiard's soft time limit uses it, and two pending SIGUSR1s would be delivered as one.
STOP_SIGNAL = signal.SIGUSR2


class Stoppable(Protocol):
    """What the stopper reads and marks of a run's claim (jobs.worker.lease.Hold)."""

    job_id: str
    lost: str
    released: bool
    told: bool


def _green() -> bool:
    """Whether gevent or eventlet patched threading (jobs run in greenlets of one thread)."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return True
    eventlet = sys.modules.get("eventlet.patcher")
    return eventlet is not None and bool(eventlet.is_monkey_patched("thread"))


class Stopper:
    """Raises LeaseLost in the run of this process's main thread once its claim is lost,
    wherever the run is (a sleep, a blocking call): the renewer's threads send STOP_SIGNAL
    at that thread and the handler raises there. Armed only while the run's own code runs.
    A STOP_SIGNAL the renewer did not send goes to the handler that was there before."""

    def __init__(self) -> None:
        self.armed: Stoppable | None = None  # the run whose code the main thread runs now
        self.pending: Stoppable | None = None  # the run a stop was sent for
        self.pid = 0  # the process the handler is installed in
        self.previous: Any = signal.SIG_DFL

    def arm(self, hold: Stoppable) -> bool:
        """The main thread starts running `hold`'s code; False where runs are not stopped
        (another thread, a greenlet, a platform without the signal)."""
        if threading.current_thread() is not threading.main_thread() or _green():
            return False
        if self.pid != os.getpid():
            try:
                previous = signal.signal(STOP_SIGNAL, self._handle)
            except (ValueError, OSError):
                return False
            if previous != self._handle:  # a forked child inherits its parent's handler
                self.previous = previous
            self.pid = os.getpid()
        self.armed = hold
        return True

    def disarm(self, hold: Stoppable) -> None:
        if self.armed is hold:
            self.armed = None

    def stop(self, hold: Stoppable) -> bool:
        """From the renewer's threads: interrupt `hold`'s run if the main thread runs it."""
        if self.armed is not hold or hold.told or self.pid != os.getpid():
            return False
        self.pending = hold
        ident = threading.main_thread().ident
        if ident is None:
            return False
        signal.pthread_kill(ident, STOP_SIGNAL)
        return True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        pending, self.pending = self.pending, None
        if pending is None:  # not the renewer's: whatever handled the signal before
            self._chain(signum, frame)
            return
        hold = self.armed
        if hold is pending and hold.lost and not hold.released and not hold.told:
            hold.told = True
            raise LeaseLost(hold.job_id, hold.lost)
        # the run ended (or was told) before the signal landed: nothing to stop

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # the default action (terminate), as without us
            signal.signal(signum, signal.SIG_DFL)
            self.pid = 0
            os.kill(os.getpid(), signum)
