"""Metric counters of the per-job path kept in Redis hashes (HINCRBY / HINCRBYFLOAT), added up
in the process and written together in one pipeline by `flush()`.

A pool process running a ledger job sent its counters in two Redis round trips: the claimed
delivery at the claim, the finished attempt and its run time (by task and by queue) at the
end, ~0.1 ms each of the ~2.4 ms of Python work a no-op ledger job costs there (measured,
issue 16). The claim's count is now added here and written with the finish's
(jobs.worker.telemetry.record_outcome flushes): one round trip per job, and the counts are in Redis
when the job's outcome is, as before. What a process holds when it exits is written then
(atexit; Celery's pool processes, which skip atexit, at worker_process_shutdown:
jobs.worker.signals); a failed write keeps the counts for the next one; a forked child starts empty
(its parent writes what it held). A run killed before its finish loses its claim's count.

A key counted for a bounded time (a per-minute bucket of jobs.worker.telemetry) is given its
expiry by `expire()`: an EXPIRE written in the same pipeline, after the counts.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

from jobs.broker.redis import redis_client

logger = logging.getLogger(__name__)

_ints: dict[tuple[str, str], int] = {}
_floats: dict[tuple[str, str], float] = {}
_expiries: dict[str, int] = {}  # key -> seconds


class _State:
    lock = threading.Lock()  # the renewer and other threads of a run may count too


def add(key: str, field: str, amount: int = 1) -> None:
    """HINCRBY `key` `field` `amount`, at the next flush."""
    with _State.lock:
        _ints[(key, field)] = _ints.get((key, field), 0) + amount


def add_float(key: str, field: str, amount: float) -> None:
    """HINCRBYFLOAT `key` `field` `amount`, at the next flush."""
    with _State.lock:
        _floats[(key, field)] = _floats.get((key, field), 0.0) + amount


def expire(key: str, seconds: int) -> None:
    """EXPIRE `key` `seconds` at the next flush, after its counts: each flush that writes to a
    bounded-time key sets its expiry again, so it lasts `seconds` after its last count."""
    with _State.lock:
        _expiries[key] = seconds


def flush() -> None:
    """Write what this process holds now, in one pipeline; never raises (a failed write keeps
    the counts and expiries for the next flush)."""
    with _State.lock:
        ints, floats, expiries = dict(_ints), dict(_floats), dict(_expiries)
        _ints.clear()
        _floats.clear()
        _expiries.clear()
    if not ints and not floats and not expiries:
        return
    try:
        pipe = redis_client().pipeline(transaction=False)
        for (key, field), count in ints.items():
            pipe.hincrby(key, field, count)
        for (key, field), value in floats.items():
            pipe.hincrbyfloat(key, field, value)
        for key, seconds in expiries.items():
            pipe.expire(key, seconds)
        pipe.execute()
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a job
        logger.debug("Could not write %s metric counts: %s", len(ints) + len(floats), exc)
        with _State.lock:
            for item, count in ints.items():
                _ints[item] = _ints.get(item, 0) + count
            for item, value in floats.items():
                _floats[item] = _floats.get(item, 0.0) + value
            for key, seconds in expiries.items():
                _expiries.setdefault(key, seconds)


def _forked() -> None:
    """In a forked child: no counts of the parent's, a fresh lock."""
    _State.lock = threading.Lock()
    _ints.clear()
    _floats.clear()
    _expiries.clear()


os.register_at_fork(after_in_child=_forked)
atexit.register(flush)
