"""Time limits where Celery's pool enforces none: a `-P solo` worker runs each job in its own
main thread, with no process hop (issue 26 item 5: the prefork pool's write of every job to a
child process and read of its reply was ~12 % of a short job's cost), and Celery's solo pool has
no time limits. In such a worker (enable(), at worker_init) a run's limits — its message's
`timelimit`, else the task's `time_limit` / `soft_time_limit`, else the worker's — hold all
the same:

- the soft limit raises SoftTimeLimitExceeded in the run, as billiard does in a prefork child:
  SIGALRM at the main thread (setitimer), whose handler raises there; the run's policy decides
  (jobs.worker.execution: a TimeLimitHit);
- the hard limit ends a run whose code ignored the soft one, or is stuck in a C call that no
  signal interrupts: a watchdog thread ends the run's lease (the relay's next sweep counts a
  worker crash for it, as for any worker that died holding a job: back to its queue, or a dead
  letter at the MAX_WORKER_CRASHES-th) and restarts the worker process in place (os.execv of its
  own command line: the same pid, so honcho, compose or systemd see it running; a new worker
  id, so jobs.broker.restore gives back the messages it had prefetched).

Threads, gevent and eventlet pools get neither (as in Celery); prefork keeps billiard's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from billiard.exceptions import SoftTimeLimitExceeded

from jobs import ledger
from jobs.broker import running
from jobs.worker.lease import renewer

logger = logging.getLogger(__name__)


@dataclass
class _Worker:
    """This process's worker: whether its pool leaves time limits to us, and its defaults."""

    enforcing: bool = False
    soft: float | None = None
    hard: float | None = None


_worker = _Worker()


def enable(*, soft: float | None, hard: float | None) -> None:
    """This process is a worker whose pool enforces no time limit (solo): its runs' limits are
    ours; `soft` and `hard` are the worker's own (--soft-time-limit, --time-limit, settings)."""
    _worker.enforcing = True
    _worker.soft, _worker.hard = soft or None, hard or None


def limits(task: Any) -> tuple[float | None, float | None]:
    """(soft, hard) seconds of the run of `task` now: its message's, its task's, the worker's."""
    hard, soft = getattr(task.request, "timelimit", None) or (None, None)
    soft = soft or getattr(task, "soft_time_limit", None) or _worker.soft
    hard = hard or getattr(task, "time_limit", None) or _worker.hard
    return (float(soft) if soft else None, float(hard) if hard else None)


@dataclass
class _Run:
    job_id: str
    attempt: int
    lease_owner: str | None
    hard: float
    deadline: float
    ended: bool = False


class _Watchdog:
    """One thread per worker process: ends the process's run at its hard limit.

    The thread sleeps until the deadline it last saw and is woken only when a new run's
    deadline comes before it: runs of the same limit one after another (a solo worker's short
    jobs) wake it at most once per limit, not twice per job (measured: two thread wake-ups, and
    the GIL handed over for them, were ~3 % of a short job's CPU)."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.run: _Run | None = None
        self.thread: threading.Thread | None = None
        self.waking: float | None = None  # when the thread wakes on its own (None: never)

    def watch(self, run: _Run) -> None:
        with self.lock:
            self.run = run
            if self.thread is None or not self.thread.is_alive():
                self.waking = run.deadline  # it reads the run before it first waits
                self.thread = threading.Thread(
                    target=self._loop, name="backlot-watchdog", daemon=True
                )
                self.thread.start()
            elif self.waking is None or run.deadline < self.waking:
                self.lock.notify()

    def ended(self, run: _Run) -> None:
        with self.lock:
            run.ended = True  # the thread, at its wake-up, finds it ended or replaced
            if self.run is run:
                self.run = None

    def _loop(self) -> None:
        while True:
            with self.lock:
                run = self.run
                if run is None:
                    self.waking = None
                    self.lock.wait()
                    continue
                left = run.deadline - time.monotonic()
                if left > 0:
                    self.waking = run.deadline
                    self.lock.wait(left)
                    continue
                if run.ended:
                    continue
                self.run = None
            _restart(run)


_watchdog = _Watchdog()


def _restart(run: _Run) -> None:
    """The run outlived its hard limit: its lease ends now (the relay counts the crash), and
    the worker process starts again in its place."""
    logger.error(
        "Job %s ran past its hard time limit (%.0f s) in a solo worker: its lease ends and "
        "this worker process restarts (pid %s); the job counts as a worker crash",
        run.job_id,
        run.hard,
        os.getpid(),
    )
    with contextlib.suppress(Exception):  # a ledger away: the lease lapses on its own
        renewer.release(run.job_id)  # its renewals stop before its lease ends
        ledger.renew(
            job_id=run.job_id, attempt=run.attempt, lease_seconds=-1, lease_owner=run.lease_owner
        )
    with contextlib.suppress(Exception):  # DEFER_CLAIM: an unclaimed run's record lapses too
        if run.lease_owner is not None:
            running.lapse(run.job_id, run.lease_owner)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


class _Soft:
    """The soft limit's alarm: raises in the main thread only while its run's code runs."""

    armed = False

    @classmethod
    def handle(cls, signum: int, frame: Any) -> None:
        if cls.armed:
            cls.armed = False
            raise SoftTimeLimitExceeded()


@contextlib.contextmanager
def limited(task: Any, *, job_id: str, attempt: int, lease_owner: str | None) -> Iterator[None]:
    """Around a run's code: its time limits, where this process's pool enforces none."""
    if not _worker.enforcing or threading.current_thread() is not threading.main_thread():
        yield
        return
    soft, hard = limits(task)
    previous: Any = None
    other = (0.0, 0.0)  # an alarm someone else set (pytest-timeout, a host's): back after the run
    began = time.monotonic()
    if soft:
        other = signal.getitimer(signal.ITIMER_REAL)
        previous = signal.signal(signal.SIGALRM, _Soft.handle)
        _Soft.armed = True
        signal.setitimer(signal.ITIMER_REAL, soft)
    run = None
    if hard:
        run = _Run(job_id, attempt, lease_owner, hard, time.monotonic() + hard)
        _watchdog.watch(run)
    try:
        yield
    finally:
        if soft:
            _Soft.armed = False  # first: an alarm from here on raises nothing
            signal.setitimer(signal.ITIMER_REAL, 0)
            # None: the handler before was not set from Python; the default is what it did
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
            if other[0]:
                left = max(other[0] - (time.monotonic() - began), 0.001)
                signal.setitimer(signal.ITIMER_REAL, left, other[1])
        if run is not None:
            _watchdog.ended(run)
