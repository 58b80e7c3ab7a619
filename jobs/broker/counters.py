"""Metric counters of the per-job path kept in Redis hashes (HINCRBY / HINCRBYFLOAT), added up
in the process and written together by `flush()`, in one script call (`write()`).

A pool process running a ledger job sent its counters in two Redis round trips: the claimed
delivery at the claim, the finished attempt and its run time (by task and by queue) at the
end, ~0.1 ms each of the ~2.4 ms of Python work a no-op ledger job costs there (measured,
issue 16). The claim's count is now added here and written with the finish's
(jobs.worker.telemetry.record_outcome flushes): one round trip per job at most, and none in a
pool process that holds its counts (below). What a process holds when it exits is written then
(atexit; Celery's pool processes, which skip atexit, at worker_process_shutdown:
jobs.worker.signals); a failed write keeps the counts for the next one; a forked child starts empty
(its parent writes what it held). A run killed before its finish loses its claim's count.

A prefork pool process holds its counts instead (`hold()`, at worker_process_init): a run's
finish no longer writes them, a timer writes what the process holds at most
METRICS_HOLD_SECONDS (1 s) after the first count it took. That flush was the one Redis round
trip of a ledger-off job's pool process, and the second of a ledger-on one's (py-spy of a
`-c 2` worker draining ledger-off no-ops: ~40 % of the worker's samples, its pool processes
waiting on it while the main process waited for them). A busy process now writes once a second;
a pool process killed (the hard time limit's SIGKILL, the OOM killer) loses the counts of its
last second, not only its run's.

A key counted for a bounded time (a per-minute bucket of jobs.worker.telemetry) is given its
expiry by `expire()`: an EXPIRE written in the same script call, after the counts.

A `-P solo` worker runs its jobs in the process that acknowledges their messages: there a run
marks its counts `carry()`, the finish's flush leaves them, and they go with the message's
acknowledgement (jobs.broker.reservations, when the broker's Redis is the platform's), which
rides with the worker's next fetch: the fetch script writes them (WRITE_FUNCTION) before it
pops the next message; an acknowledgement no fetch takes within RIDE_WAIT writes them in its
own MULTI/EXEC. No round trip of their own, ~0.1-0.3 ms of a ~1.5 ms ledger job
(benchmarks/README.md). The counts then reach Redis with the message's acknowledgement, a
moment after the job's outcome; a worker killed between the two loses that run's counts (as
one killed before its finish did).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from typing import Any

from jobs.broker.redis import redis_client

logger = logging.getLogger(__name__)

_ints: dict[tuple[str, str], int] = {}
_floats: dict[tuple[str, str], float] = {}
_expiries: dict[str, int] = {}  # key -> seconds


class _State:
    lock = threading.Lock()  # the renewer and other threads of a run may count too
    carried = False  # the next acknowledgement in this process writes the counts (carry())
    hold = 0.0  # > 0: a finish leaves the counts to a timer that writes them this long after
    timer: threading.Timer | None = None  # armed while counts are held


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


def carry() -> None:
    """This process's next acknowledgement writes the counts held then (see the module
    docstring): until it, `flush_unless_carried()` leaves them."""
    _State.carried = True


def hold(seconds: float) -> None:
    """From now on this process's finishes leave their counts to a timer, which writes what the
    process holds `seconds` after the first count it took (see the module docstring); 0 writes
    them with each finish again."""
    _State.hold = seconds


def flush_unless_carried() -> None:
    """`flush()`, unless an acknowledgement is to write the counts (`carry()`), or the process
    holds them for its timer (`hold()`)."""
    if _State.carried:
        return
    if _State.hold > 0:
        _flush_later()
    else:
        flush()


def _flush_later() -> None:
    with _State.lock:
        if _State.timer is not None:  # armed: it writes these counts too
            return
        timer = _State.timer = threading.Timer(_State.hold, _timed_flush)
    timer.daemon = True
    timer.start()


def _timed_flush() -> None:
    with _State.lock:
        _State.timer = None  # a count taken from now on arms the next one
    flush()


Counts = tuple[dict[tuple[str, str], int], dict[tuple[str, str], float], dict[str, int]]


def take() -> Counts | None:
    """What this process holds, taken out to be written in the caller's pipeline (`write()`);
    None when it holds nothing. Ends a `carry()`."""
    with _State.lock:
        _State.carried = False
        if not _ints and not _floats and not _expiries:
            return None
        counts = (dict(_ints), dict(_floats), dict(_expiries))
        _ints.clear()
        _floats.clear()
        _expiries.clear()
    return counts


def write(pipe: Any, counts: Counts) -> Any:
    """Add `counts` to a pipeline of the platform's Redis: one EVAL (`_WRITE`), whose reply is
    how many of them Redis refused (a key of another type)."""
    return pipe.eval(_WRITE, 0, encoded(counts))


# A job's counts are ~11 HINCRBYs and an EXPIRE: as commands, their packing and replies cost
# redis-py ~0.1 ms of a ~1.5 ms ledger job; as one script, one command and one reply. pcall:
# a key of another type loses its own count, not the others'. WRITE_FUNCTION is the Lua function
# other scripts embed too (jobs.broker.fetch: a solo worker's counts ride with its next fetch).
WRITE_FUNCTION = """
local function write_counts(encoded)
  local counts = cjson.decode(encoded)
  local refused = 0
  local function count(reply)
    if type(reply) == 'table' and reply.err then refused = refused + 1 end
  end
  for _, c in ipairs(counts[1]) do count(redis.pcall('HINCRBY', c[1], c[2], c[3])) end
  for _, c in ipairs(counts[2]) do count(redis.pcall('HINCRBYFLOAT', c[1], c[2], c[3])) end
  for _, c in ipairs(counts[3]) do count(redis.pcall('EXPIRE', c[1], c[2])) end
  return refused
end
"""
_WRITE = WRITE_FUNCTION + "return write_counts(ARGV[1])\n"


def encoded(counts: Counts) -> str:
    """The script's argument: counts before expiries, every number as text (as Redis reads it;
    a float's repr keeps every digit, which Lua's own number formatting would not)."""
    ints, floats, expiries = counts
    return json.dumps(
        [
            [[key, field, str(count)] for (key, field), count in ints.items()],
            [[key, field, repr(value)] for (key, field), value in floats.items()],
            [[key, str(seconds)] for key, seconds in expiries.items()],
        ],
        separators=(",", ":"),
    )


def refused(reply: Any) -> int:
    """How many counts of a `write()` Redis refused, from its reply."""
    return reply if isinstance(reply, int) else 0


def give_back(counts: Counts) -> None:
    """Counts `take()` took whose write failed: held again for the next flush."""
    ints, floats, expiries = counts
    with _State.lock:
        for item, count in ints.items():
            _ints[item] = _ints.get(item, 0) + count
        for item, value in floats.items():
            _floats[item] = _floats.get(item, 0.0) + value
        for key, seconds in expiries.items():
            _expiries.setdefault(key, seconds)


def flush() -> None:
    """Write what this process holds now, in one script call; never raises (a failed write keeps
    the counts and expiries for the next flush)."""
    counts = take()
    if counts is None:
        return
    try:
        (reply,) = write(redis_client().pipeline(transaction=False), counts).execute()
    except Exception as exc:  # noqa: BLE001 - metrics must never fail a job
        logger.debug("Could not write %s metric counts: %s", len(counts[0]) + len(counts[1]), exc)
        give_back(counts)
    else:
        if refused(reply):
            logger.debug("Redis refused %d metric count(s) (a key of another type)", reply)


def _forked() -> None:
    """In a forked child: no counts of the parent's, a fresh lock."""
    _State.lock = threading.Lock()
    _State.carried = False
    _State.timer = None  # the parent's thread is not in the child
    _ints.clear()
    _floats.clear()
    _expiries.clear()


os.register_at_fork(after_in_child=_forked)
atexit.register(flush)
