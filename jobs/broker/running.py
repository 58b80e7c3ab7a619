"""Runs that have not written their claim yet (DEFER_CLAIM): a record per job in Redis.

With DEFER_CLAIM a short job writes the ledger once, at its finish (jobs.ledger.claim's
deferred claim). Until a run writes its claim row, this record is what says the job runs:

- `backlot:run:<job id>`, a hash {token, until (ms, Redis' clock), claimed}, written by the
  delivery in one script that also tells whether another run holds the job (`busy`: its lease
  has not lapsed), or held it and vanished without finishing (`lapsed`: a crash, which the
  delivery records in the ledger before it claims, so the crash is counted);
- `claimed` is set once the run wrote its claim row (it outlived its first lease interval, or
  called progress(), an effect, a step or enqueued a child): from then on the ledger's lease
  decides, and a later delivery takes the claim path (`claimed`);
- a failed or stopped run's end marks it `claimed` (only its own: the token must match), and
  so does a cancel of a waiting job (`hold_back`): a later delivery within KEEP_MS takes the
  claim path, which reads the row;
- a short success's record (unclaimed: its one write is in the row) goes with its message's
  acknowledgement (`forget`, in the ack's own MULTI/EXEC or the fetch script an ack rides
  with: jobs.broker.reservations.ran); the rest, and a record whose message was never
  acknowledged (a crash), expire KEEP_MS past their lease. Redis then holds no record per
  short job that succeeded.

A message published right after its row was written (enqueue, a fan-out) carries `born`: when
it was sent and the job's owner. Its first delivery that finds no record, while the message is
younger than FRESH_MS, runs without reading the row (`fresh`): the row is then known to wait
with no attempt. Any run of the job, and any cancel, left a record that outlives the message's
first FRESH_MS or the message itself: a record goes early only with its message's ack,
and a copy of a message going back to its queue (jobs.broker.restore's, kombu's requeue) loses
`born` (`unstamp`), while a dead holder's own copy of a job no run took finds a claimed record
(`hold_absent`). An older message, a retry's, a relay's re-send or a delayed one reads the row
first.

The status API, the jobs list and AsyncResult read it (`unclaimed`): a waiting row whose run
started says running.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from jobs.broker import amqp
from jobs.broker.redis import redis_client, redis_text
from jobs.core.conf import backlot_settings
from jobs.core.states import WAITING_STATES

logger = logging.getLogger(__name__)

PREFIX = "backlot:run:"
# A record outlives its lease this long (ms), so that a crash is still seen by the next
# delivery after the restore (seconds) or the relay's reconcile of a lost message (15 s) sent
# the job again; past it, a crash goes uncounted (the job still runs again).
KEEP_MS = 10 * 60 * 1000

# A message at most this old (ms, since its publish) may run without reading its row: a copy
# of it delivered later than a record of any earlier run lives (KEEP_MS) is older than this.
FRESH_MS = KEEP_MS // 2
# The header that says when a message was sent right after its row was written, and for whom.
BORN = "backlot_born"

# A Lua function: start(key, token, lease ms, keep ms, now ms on Redis' clock) takes the record
# `key` for this delivery and returns ok | busy | claimed | lapsed; but for busy the record is
# this delivery's from then on (claimed, past ok: it claims in the ledger), so a record left by
# a vanished run is counted once and then dropped with this one. Shared with the fetch script
# (jobs.broker.fetch), which takes a stamped message's record in the step that takes it.
START_FUNCTION = """
local function start_run(key, token, lease, keep, now)
  local v = redis.call('HMGET', key, 'token', 'until', 'claimed')
  local reply = 'ok'
  if v[1] then
    if v[3] == '1' then reply = 'claimed'
    elseif tonumber(v[2]) > now then return 'busy'
    else reply = 'lapsed' end
  end
  redis.call('HSET', key, 'token', token, 'until', now + tonumber(lease))
  if reply == 'ok' then
    redis.call('HDEL', key, 'claimed')
  else
    redis.call('HSET', key, 'claimed', '1')  -- this delivery takes the claim path
  end
  redis.call('PEXPIRE', key, keep)
  return reply
end
"""

# A Lua function: forget_runs(flat list of record key, token, ...) drops each record that is
# still that run's and unclaimed (a short success's: its one write is in the row): its message
# is acknowledged, and Redis holds no copy of it any more. A claimed record (a failure's end, a
# claim written, a cancel) stays until it expires: the job's next delivery takes the claim path,
# as before. Shared with the fetch script (acknowledgements riding with it) and the
# acknowledgement's MULTI/EXEC (jobs.broker.reservations).
FORGET_FUNCTION = """
local function forget_runs(runs)
  for i = 1, #runs, 2 do
    local v = redis.call('HMGET', runs[i], 'token', 'claimed')
    if v[1] == runs[i + 1] and v[2] ~= '1' then redis.call('DEL', runs[i]) end
  end
end
"""
# ARGV: record key, token, ... (EVAL'd inside a MULTI/EXEC: no EVALSHA to miss there).
FORGET = FORGET_FUNCTION + "forget_runs(ARGV)\nreturn 0\n"

# KEYS[1] the record; ARGV: token, lease ms, keep ms.
_START = (
    START_FUNCTION
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return start_run(KEYS[1], ARGV[1], ARGV[2], ARGV[3], now)
"""
)

# KEYS[1] the record; ARGV[1] token, ARGV[2] keep ms. Marks it claimed if it is this run's.
_END = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'claimed', '1')
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS[1] the record; ARGV[1] token, ARGV[2] keep ms. The run's start (ms, its lease's end less
# ARGV[3] ms) if the record is this run's and unclaimed, marked claimed; else false.
_SETTLE = """
local v = redis.call('HMGET', KEYS[1], 'token', 'until', 'claimed')
if v[1] ~= ARGV[1] or v[3] == '1' then return false end
redis.call('HSET', KEYS[1], 'claimed', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return tonumber(v[2]) - tonumber(ARGV[3])
"""

# KEYS[1] the record; ARGV[1] token. Whether this run's unclaimed record's lease has lapsed:
# lapsed | live | done (claimed, another run's) | none (no record).
_LAPSED = """
local v = redis.call('HMGET', KEYS[1], 'token', 'until', 'claimed')
if not v[1] then return 'none' end
if v[1] ~= ARGV[1] or v[3] == '1' then return 'done' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(v[2]) > now then return 'live' end
return 'lapsed'
"""

# KEYS: records of waiting jobs being cancelled; ARGV[1] keep ms. Each a claimed record (a
# live run's keeps its token: its own marks still apply).
_HOLD_BACK = """
for i, key in ipairs(KEYS) do
  if redis.call('HSETNX', key, 'token', '') == 1 then redis.call('HSET', key, 'until', 0) end
  redis.call('HSET', key, 'claimed', '1')
  redis.call('PEXPIRE', key, ARGV[1])
end
return #KEYS
"""

# KEYS: records of stamped messages going back to their queue from a dead holder
# (jobs.broker.restore); ARGV[1] keep ms. Each one no run took yet, or a prefork fetch took for
# a run no pool process was seen to start (`reserved`), becomes a claimed record, so that the
# holder's own copy, should it wake up and run it, reads the row; a run's record is left as it
# is (its lease decides).
_HOLD_ABSENT = """
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'token', 'reserved', 'claimed')
  if not v[1] or (v[2] == '1' and v[3] ~= '1') then
    redis.call('HSET', key, 'token', '', 'until', 0, 'claimed', '1')
    redis.call('HDEL', key, 'reserved')
    redis.call('PEXPIRE', key, ARGV[1])
  end
end
return #KEYS
"""

# A prefork worker's fetch takes a stamped message's record `reserved` (jobs.broker.fetch): it
# says running, and a copy meeting it is dropped, but it is the message's until Celery takes the
# message for a pool process. ARGV: record key, token, ... STARTED: those messages were handed
# to the pool (sent by the main process without waiting for the reply, before the process can
# run it: jobs.broker.unanswered); the record is a run's from then on. UNRESERVE:
# those messages go back to their queue undelivered (a paused queue's consumer cancelled, the
# channel closing): their records go, so that the copy runs.
STARTED = """
for i = 1, #ARGV, 2 do
  if redis.call('HGET', ARGV[i], 'token') == ARGV[i + 1] then
    redis.call('HDEL', ARGV[i], 'reserved')
  end
end
return 0
"""
UNRESERVE = """
for i = 1, #ARGV, 2 do
  local v = redis.call('HMGET', ARGV[i], 'token', 'reserved', 'claimed')
  if v[1] == ARGV[i + 1] and v[2] == '1' and v[3] ~= '1' then redis.call('DEL', ARGV[i]) end
end
return 0
"""

# KEYS[1] the record; ARGV[1] token, ARGV[2] field, ARGV[3] value: set if it is this run's.
_MARK = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
  return redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
end
return -1
"""

# KEYS: records. Returns the ones whose unclaimed run's lease has not lapsed (1/0 each).
_LIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('HMGET', key, 'until', 'claimed')
  out[i] = (v[1] and v[2] ~= '1' and tonumber(v[1]) > now) and 1 or 0
end
return out
"""


def _key(job_id: object) -> str:
    return f"{PREFIX}{job_id}"


@functools.cache
def _script(source: str) -> Any:
    """The script, sent once and then called by its SHA (EVALSHA; redis-py loads it again
    after a SCRIPT FLUSH or a restart), on the client each call passes."""
    return redis_client().register_script(source)


def start(job_id: str, token: str, lease_seconds: float) -> str:
    """Record this delivery's run of `job_id`: "ok" (recorded), "busy" (another run holds it),
    "lapsed" (a run held it and ended without finishing: a crash) or "claimed" (a run wrote
    its claim row: the ledger decides)."""
    reply = _script(_START)(
        keys=[_key(job_id)],
        args=[token, int(lease_seconds * 1000), KEEP_MS],
        client=redis_client(),
    )
    return redis_text(reply)


def end(job_id: str, token: str) -> None:
    """The run is over (its outcome is in the ledger): its record says so (claimed) until it
    expires, so that a copy of its message delivered meanwhile reads the row."""
    _script(_END)(keys=[_key(job_id)], args=[token, KEEP_MS], client=redis_client())


def settle(job_id: str, token: str, lease_seconds: float) -> float | None:
    """A run that ended outside its own code (its pool process killed: a crash, a hard time
    limit, a cancel at shutdown), recorded by the worker's main process: if it had not written
    its claim, its record is marked claimed (the next delivery reads the row) and its start is
    returned (a UNIX time, from its lease's end on Redis' clock); else None."""
    started = _script(_SETTLE)(
        keys=[_key(job_id)],
        args=[token, KEEP_MS, int(lease_seconds * 1000)],
        client=redis_client(),
    )
    return None if started is None else int(started) / 1000


def lapsed(job_id: str, token: str) -> str:
    """Whether this run, unclaimed, outlived its lease without writing its claim (its process
    stopped or stuck): "lapsed", "live", "done" (it wrote its claim or ended, or another run
    holds the record) or "none" (no record yet)."""
    reply = _script(_LAPSED)(keys=[_key(job_id)], args=[token], client=redis_client())
    return redis_text(reply)


def hold_back(job_ids: Iterable[object]) -> None:
    """Waiting jobs about to be cancelled: a delivery of theirs from now on reads the row
    (which says cancelled), however fresh its message. Written before the cancel, so that a
    cancel Redis did not take is not made (RedisError); none without DEFER_CLAIM or on a
    broker whose messages carry no `born` (RabbitMQ)."""
    ids = [str(job_id) for job_id in job_ids]
    if ids and backlot_settings().DEFER_CLAIM and not amqp.enabled():
        _script(_HOLD_BACK)(
            keys=[_key(job_id) for job_id in ids], args=[KEEP_MS], client=redis_client()
        )


def hold_absent(job_ids: Iterable[object]) -> None:
    """Stamped messages of a dead holder about to go back to their queue (jobs.broker.restore):
    a job none of whose runs started gets a claimed record, so that the holder's own copy,
    should the holder wake up and run it, reads the row (the copy sent back carries no `born`)."""
    ids = [str(job_id) for job_id in job_ids]
    if ids:
        _script(_HOLD_ABSENT)(
            keys=[_key(job_id) for job_id in ids], args=[KEEP_MS], client=redis_client()
        )


def forget_args(runs: Iterable[tuple[str, str]]) -> list[str]:
    """FORGET's arguments for (job id, token) pairs."""
    return [arg for job_id, token in runs for arg in (_key(job_id), token)]


def forget(runs: list[tuple[str, str]]) -> None:
    """Drop the records of these (job id, token) runs that are still theirs and unclaimed:
    their messages are acknowledged (jobs.broker.reservations, where the platform's Redis is
    not the broker's)."""
    if runs:
        redis_client().eval(FORGET, 0, *forget_args(runs))


def born(owner_id: int | None) -> dict[str, Any]:
    """The header of a message published now, right after its row was written waiting with
    no attempt (enqueue, a fan-out): {} without DEFER_CLAIM or on RabbitMQ."""
    if not backlot_settings().DEFER_CLAIM or amqp.enabled():
        return {}
    return {BORN: [int(time.time() * 1000), owner_id]}


def unstamp(payload: Any) -> bool:
    """A copy of a message going back to its queue (a restore, a requeue) loses `born`: the
    run it was stamped for may have ended and dropped its record with the acknowledgement
    (jobs.broker.reservations.ran), so its run reads the row. Whether it was stamped."""
    headers = payload.get("headers") if isinstance(payload, dict) else None
    return isinstance(headers, dict) and headers.pop(BORN, None) is not None


@dataclass(frozen=True)
class Fresh:
    """A first delivery of a message sent right after its row was written, still young."""

    owner_id: int | None


def fresh(request: Any) -> Fresh | None:
    """The delivery's message if it carries `born`, is its job's first (no retries, no eta)
    and is younger than FRESH_MS: a run of it that finds no record may skip reading the row."""
    stamp = getattr(request, BORN, None)
    if not isinstance(stamp, list) or len(stamp) != 2 or not isinstance(stamp[0], int):
        return None
    if getattr(request, "retries", 0) or getattr(request, "eta", None):
        return None
    if time.time() * 1000 - stamp[0] >= FRESH_MS:
        return None
    owner_id = stamp[1]
    return Fresh(owner_id if isinstance(owner_id, int) else None)


def claimed(job_id: str, token: str) -> None:
    """The run wrote its claim row: later deliveries take the ledger's claim path."""
    _script(_MARK)(keys=[_key(job_id)], args=[token, "claimed", "1"], client=redis_client())


def lapse(job_id: str, token: str) -> None:
    """The run's lease ends now (a watchdog's restart): the next delivery counts the crash."""
    _script(_MARK)(keys=[_key(job_id)], args=[token, "until", "0"], client=redis_client())


def live(job_ids: Iterable[object]) -> set[str]:
    """Those of `job_ids` whose run started and has not written its claim row yet (its lease
    not lapsed): they run, though their rows still read waiting."""
    ids = [str(job_id) for job_id in job_ids]
    if not ids:
        return set()
    flags = _script(_LIVE)(keys=[_key(job_id) for job_id in ids], client=redis_client())
    return {job_id for job_id, flag in zip(ids, flags, strict=True) if int(flag)}


def unclaimed(jobs: Iterable[Any]) -> set[str]:
    """The ids of those of `jobs` (ledger rows) whose row waits while a run of theirs started
    without writing its claim (DEFER_CLAIM): a status shows them running. One Redis call for
    them all; none without DEFER_CLAIM or a waiting row. Empty while Redis cannot be read: the
    rows decide."""
    if not backlot_settings().DEFER_CLAIM:
        return set()
    waiting = [job.pk for job in jobs if job.state in WAITING_STATES]
    try:
        return live(waiting)
    except RedisError as exc:
        logger.debug("Run records not read (%s): waiting rows shown as they read", exc)
        return set()
