"""Waiting rooms in Redis for jobs that need a slot: a concurrency slot of their key (at most N
running at once, cluster-wide) and/or a rate-limit token (the GCRA bucket of jobs.ratelimit).

One mechanism for both. A job that finds no slot is *parked*: its message is kept in its gate's
waiting list (a sorted set, oldest first) and the worker acknowledges the delivery, so it holds
no pool process and spends no attempt. Parked jobs leave only when the granting side lets them:
a finishing job's release, a park, a start, or the relay's sweep call ``dispatch``, which hands
the oldest waiters the slots that are free (a concurrency slot, held for them) and the rate
tokens of the next ``horizon`` seconds (each granted its own slot time), and returns their
messages for re-publishing. So at most `limit` jobs per second reach the workers, however many
wait: re-sent jobs never stampede, and a tenant's backlog waits in its own list, not in the
queue in front of other tenants' jobs.

A concurrency slot is a member of ``backlot:conc:<name>`` (job id -> lease expiry, in Redis'
clock). It is renewed with the job's lease (jobs.lease), released when the job ends, and lapses
with the lease when the worker died; every script drops lapsed members before it counts.
All decisions are Lua scripts reading Redis' own clock, atomic across hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import redis
from redis.exceptions import RedisError

from .redis import redis_client, redis_text

logger = logging.getLogger(__name__)

PREFIX = "backlot:gate:"
CONC_PREFIX = "backlot:conc:"
RATE_PREFIX = "backlot:rate:"  # jobs.ratelimit.RateLimiter's buckets: one token stream per name
GATES = PREFIX + "waiting"  # gates that have parked jobs (the relay's sweep visits them)
QUEUES = PREFIX + "queues"  # queue -> parked jobs of that queue (the relay's lost-message check)
OWNER = PREFIX + "of"  # job id -> its gate, while it is parked or holds a slot
SEQUENCE = PREFIX + "seq"  # arrival order of parked jobs
# Messages re-published to wait for a slot (a release, a grant's countdown), per task; read by
# the benchmark and /metrics: re-sends per job stay near 1 (a parked job is sent once more).
RESENDS = "backlot:metrics:gate_resends"
PARKED = "backlot:metrics:gate_parked"  # jobs parked, per task

# A granted rate token is its job's even when the job arrives late (a busy pool, a backlog in
# its queue): it is never forfeited, so the average holds. Bunching is what the bucket's last
# second of starts prevents: no start, on time or late, while it holds `limit` starts.
# ... and this much before it (the ETA is the worker's clock, the slot Redis').
EARLY = 0.01
# Most waiters one dispatch call releases (bounds the script's run time in Redis).
DISPATCH_MAX = 200
# Parks per pipelined round at enqueue (as the broker's BULK_BATCH for messages).
WAIT_BATCH = 1000

_COMMON = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function tat()
  local v = tonumber(redis.call('GET', KEYS[6]) or '0')
  if v < now then v = now end
  return v
end
local function take_token(interval, at)
  local nxt = at + interval
  redis.call('SET', KEYS[6], string.format('%.6f', nxt), 'PX', math.ceil((nxt - now) * 1000) + 1000)
end
"""

# KEYS: 1 wait, 2 messages, 3 grants, 4 conf, 5 holders, 6 bucket, 7 GATES, 8 QUEUES, 9 OWNER,
#       10 SEQUENCE, 11 the gates waiting on the holders' slots
# ARGV: job, gate, limit (0: none), interval (0: none), lease, early, horizon, message,
#       queue, holders name, bucket name, "1" to park it whatever the slots (at enqueue)
# Returns {verdict, wait, jobs waiting}: "go" (let in, a slot taken), "held" (it already held its
# slot: a redelivery), "early" (granted: run after wait), "parked", "waiting" (already parked: a
# duplicate).
_ADMIT = (
    _COMMON
    + """
local job, gate = ARGV[1], ARGV[2]
local function answer(verdict, wait)
  return {verdict, wait, redis.call('ZCARD', KEYS[1])}
end
local limit, interval, lease = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local early, horizon = tonumber(ARGV[6]), tonumber(ARGV[7])
local function hold(expiry)
  if limit > 0 then
    redis.call('ZADD', KEYS[5], expiry, job)
    redis.call('HSET', KEYS[9], job, gate)
  end
end
local function full()
  -- seconds until the bucket's last second of starts leaves room for one more, or false: every
  -- start, on time or not, keeps any 1-second window within the rate (late ones bunch up)
  if interval == 0 then return false end
  redis.call('ZREMRANGEBYSCORE', KEYS[12], '-inf', now - 1)
  local last = redis.call('ZRANGE', KEYS[12], -1, -1, 'WITHSCORES')
  if last[2] and now - tonumber(last[2]) < interval / 2 then
    -- late ones catch up at twice the rate at most, never in a clump
    return math.max(0.001, tonumber(last[2]) + interval / 2 - now)
  end
  local cap = math.max(1, math.floor(1 / interval + 1e-9))
  if redis.call('ZCARD', KEYS[12]) < cap then return false end
  local oldest = redis.call('ZRANGE', KEYS[12], 0, 0, 'WITHSCORES')
  return math.max(0.001, tonumber(oldest[2]) + 1 - now)
end
local function started()
  -- the last second's starts of the bucket (read for late grants, below)
  if interval > 0 then
    redis.call('ZADD', KEYS[12], now, job)
    redis.call('ZREMRANGEBYSCORE', KEYS[12], '-inf', now - 1)
    redis.call('PEXPIRE', KEYS[12], 2000)
  end
  return answer('go', '0')
end
local function park(at_head)
  local score
  if at_head then
    local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
    score = (tonumber(first[2]) or 0) - 1
  else
    score = redis.call('INCR', KEYS[10])
  end
  redis.call('ZADD', KEYS[1], score, job)
  redis.call('HSET', KEYS[2], job, ARGV[8])
  redis.call('HSET', KEYS[4], 'limit', limit, 'interval', interval, 'lease', lease,
    'queue', ARGV[9], 'holders', ARGV[10], 'bucket', ARGV[11])
  redis.call('SADD', KEYS[7], gate)
  if limit > 0 then redis.call('SADD', KEYS[11], gate) end
  redis.call('HINCRBY', KEYS[8], ARGV[9], 1)
  redis.call('HSET', KEYS[9], job, gate)
  return answer('parked', '0')
end
if redis.call('ZSCORE', KEYS[1], job) then return answer('waiting', '0') end
if ARGV[12] == '1' then return park(false) end -- parked at enqueue: the gate decides, in order
if limit > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now) end
local holding = limit > 0 and redis.call('ZSCORE', KEYS[5], job) ~= false
local grant = redis.call('HGET', KEYS[3], job)
if grant then
  redis.call('HDEL', KEYS[3], job)
  local slot = tonumber(grant)
  if limit > 0 and not holding then
    grant = false -- its slot lapsed on the way: it is a newcomer again
  elseif interval == 0 then
    hold(now + lease)
    return answer('go', '0')
  elseif now < slot - early then
    redis.call('HSET', KEYS[3], job, grant)
    return answer('early', tostring(slot - now))
  else
    -- on time, or late (its token went unused at its time, and is still its own: the total
    -- stays within the tokens given): it runs once the last second's starts leave room
    local busy = full()
    if busy then
      redis.call('HSET', KEYS[3], job, grant)
      return answer('early', tostring(busy))
    end
    hold(now + lease)
    return started()
  end
end
if holding then
  -- a redelivery of a job whose run held the slot (its worker died): it keeps the slot
  if interval > 0 then
    local at = tat()
    if at > now + early then
      redis.call('ZREM', KEYS[5], job)
      return park(true)
    end
    take_token(interval, at)
  end
  hold(now + lease)
  return answer('held', '0')
end
-- a newcomer: it may pass only when nobody waits before it and every slot it needs is free
if redis.call('ZCARD', KEYS[1]) == 0 and (limit == 0 or redis.call('ZCARD', KEYS[5]) < limit) then
  if interval == 0 then
    hold(now + lease)
    return answer('go', '0')
  end
  local at = tat()
  if at <= now + early and not full() then
    take_token(interval, at)
    hold(now + lease)
    return started()
  end
end
return park(false)
"""
)

# KEYS: 1 wait, 2 messages, 3 grants, 4 conf, 5 holders, 6 bucket, 7 GATES, 8 QUEUES, 9 OWNER,
#       10 the gates waiting on the holders' slots
# ARGV: gate, limit, interval, lease, horizon, max, queue
# Returns a flat list: job, message, wait (seconds until its slot), ... for each released job.
_DISPATCH = (
    _COMMON
    + """
local gate = ARGV[1]
local limit, interval, lease = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local horizon, most = tonumber(ARGV[5]), tonumber(ARGV[6])
local out = {}
if limit > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now) end
local released = 0
while released < most do
  local head = redis.call('ZRANGE', KEYS[1], 0, 0)
  if #head == 0 then break end
  if limit > 0 and redis.call('ZCARD', KEYS[5]) >= limit then break end
  local slot = now
  if interval > 0 then
    local at = tat()
    if at - now > horizon then break end
    slot = at
    take_token(interval, at)
  end
  local job = head[1]
  redis.call('ZREM', KEYS[1], job)
  local message = redis.call('HGET', KEYS[2], job)
  redis.call('HDEL', KEYS[2], job)
  redis.call('HINCRBY', KEYS[8], ARGV[7], -1)
  if limit > 0 then
    redis.call('ZADD', KEYS[5], slot + lease, job)
  else
    redis.call('HDEL', KEYS[9], job)
  end
  -- the grant tells its delivery that it was let in (and when), not merely redelivered
  redis.call('HSET', KEYS[3], job, string.format('%.6f', slot))
  redis.call('EXPIRE', KEYS[3], 86400)
  if message then
    out[#out + 1] = job
    out[#out + 1] = message
    out[#out + 1] = tostring(slot - now)
  end
  released = released + 1
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[7], gate)
  redis.call('SREM', KEYS[10], gate)
end
return out
"""
)

# KEYS: 1 wait, 2 messages, 3 grants, 4 holders, 5 QUEUES, 6 OWNER; ARGV: job, queue
# Takes a job out of its gate (cancelled while parked, finished, or dropped at claim): 1 when it
# was parked or held a slot.
_FORGET = """
local job = ARGV[1]
local was = 0
if redis.call('ZREM', KEYS[1], job) == 1 then
  redis.call('HDEL', KEYS[2], job)
  redis.call('HINCRBY', KEYS[5], ARGV[2], -1)
  was = 1
end
redis.call('HDEL', KEYS[3], job)
if redis.call('ZREM', KEYS[4], job) == 1 then was = 1 end
redis.call('HDEL', KEYS[6], job)
return was
"""


@dataclass(frozen=True)
class Gate:
    """What a job waits for: a concurrency slot of `holders` (at most `limit` at once) and/or a
    token of the rate bucket `bucket` (one per `interval` seconds)."""

    name: str
    queue: str
    holders: str = ""  # concurrency key's slot set name ("" with no concurrency limit)
    limit: int = 0
    bucket: str = ""  # rate bucket name ("" with no rate limit)
    interval: float = 0.0
    lease: float = 30.0  # seconds a slot is held without renewal (the job's lease)

    def keys(self) -> list[str]:
        base = PREFIX + self.name
        return [
            base + ":wait",
            base + ":messages",
            base + ":grants",
            base + ":conf",
            CONC_PREFIX + (self.holders or "-"),
            RATE_PREFIX + (self.bucket or "-"),
        ]

    def starts_key(self) -> str:
        """The rate bucket's starts of the last second (job id -> when)."""
        return RATE_PREFIX + (self.bucket or "-") + ":starts"

    def waiters_key(self) -> str:
        """The set of gates whose parked jobs wait for a slot of this gate's holders."""
        return CONC_PREFIX + (self.holders or "-") + ":gates"


@dataclass(frozen=True)
class Admission:
    """The gate's answer to a delivery: "go" / "held" (run now), "early" (run after `wait`),
    "parked" (it waits in the gate), "waiting" (a duplicate of a parked job: drop it)."""

    verdict: str
    wait: float = 0.0
    waiting: int = 0  # jobs parked in the gate after this call

    @property
    def runs(self) -> bool:
        return self.verdict in ("go", "held")


@dataclass(frozen=True)
class Released:
    """A parked job the gate let go: re-publish `message` to run after `wait` seconds."""

    job_id: str
    message: str
    wait: float


def horizon_for(interval: float, max_reserve: float) -> float:
    """How far ahead dispatch grants rate tokens: a second's worth (or one token of a slower
    rate), capped by RATE_LIMIT_MAX_RESERVE; rarer tokens are granted by the relay's sweep."""
    return min(max_reserve, max(1.0, interval))


class Gates:
    """The waiting rooms and slot sets in one Redis."""

    def __init__(self, client: redis.Redis | None = None) -> None:
        self.client = client or redis_client()
        self._admit = self.client.register_script(_ADMIT)
        self._dispatch = self.client.register_script(_DISPATCH)
        self._forget = self.client.register_script(_FORGET)

    def admit(self, gate: Gate, job_id: str, message: str, *, horizon: float) -> Admission:
        """Let a delivered job through its gate, or park it (its `message` kept for later)."""
        verdict, wait, waiting = self._admit(
            keys=[
                *gate.keys(),
                GATES,
                QUEUES,
                OWNER,
                SEQUENCE,
                gate.waiters_key(),
                gate.starts_key(),
            ],
            args=[
                job_id,
                gate.name,
                gate.limit,
                repr(gate.interval),
                repr(gate.lease),
                repr(EARLY),
                repr(horizon),
                message,
                gate.queue,
                gate.holders,
                gate.bucket,
                "0",
            ],
        )
        return Admission(redis_text(verdict), float(wait), int(waiting))

    def wait(self, jobs: list[tuple[Gate, str, str]]) -> None:
        """Park (gate, job id, message) triples in arrival order, whatever the slots (jobs
        just accepted: dispatch then lets the oldest through), pipelined."""
        for start in range(0, len(jobs), WAIT_BATCH):
            pipe = self.client.pipeline(transaction=False)
            for gate, job_id, message in jobs[start : start + WAIT_BATCH]:
                self._admit(
                    keys=[
                        *gate.keys(),
                        GATES,
                        QUEUES,
                        OWNER,
                        SEQUENCE,
                        gate.waiters_key(),
                        gate.starts_key(),
                    ],
                    args=[
                        job_id,
                        gate.name,
                        gate.limit,
                        repr(gate.interval),
                        repr(gate.lease),
                        repr(EARLY),
                        "0",
                        message,
                        gate.queue,
                        gate.holders,
                        gate.bucket,
                        "1",
                    ],
                    client=pipe,
                )
            pipe.execute()

    def dispatch(self, gate: Gate, *, horizon: float, most: int = DISPATCH_MAX) -> list[Released]:
        """Release the oldest waiters into the slots free now (and rate tokens within
        `horizon` s); the caller re-publishes what is returned."""
        flat = self._dispatch(
            keys=[*gate.keys(), GATES, QUEUES, OWNER, gate.waiters_key()],
            args=[
                gate.name,
                gate.limit,
                repr(gate.interval),
                repr(gate.lease),
                repr(horizon),
                most,
                gate.queue,
            ],
        )
        return [
            Released(redis_text(flat[i]), redis_text(flat[i + 1]), float(flat[i + 2]))
            for i in range(0, len(flat), 3)
        ]

    def release(self, gate: Gate, job_id: str) -> bool:
        """The job ended (or will not run): free its slot, or take it out of the line."""
        keys = gate.keys()
        return bool(
            self._forget(
                keys=[keys[0], keys[1], keys[2], keys[4], QUEUES, OWNER], args=[job_id, gate.queue]
            )
        )

    def renew(self, gate: Gate, job_id: str) -> None:
        """Extend the slot of a running job by its lease (only while it still holds it)."""
        if not gate.limit:
            return
        seconds, micros = self.client.time()
        self.client.zadd(
            CONC_PREFIX + gate.holders,
            {job_id: seconds + micros / 1e6 + gate.lease},
            xx=True,
        )

    def sharing(self, gate: Gate) -> list[Gate]:
        """The gates with jobs waiting for a slot of `gate`'s holders (itself included)."""
        if not gate.limit:
            return [gate]
        names = {redis_text(name) for name in self.client.smembers(gate.waiters_key())}
        others = [self.stored(name) for name in sorted(names - {gate.name})]
        return [gate, *(other for other in others if other is not None)]

    def gate_of(self, job_id: str) -> Gate | None:
        """The gate a job is parked in or holds a slot of, as its last park recorded it."""
        name = self.client.hget(OWNER, job_id)
        return None if name is None else self.stored(redis_text(name))

    def stored(self, name: str) -> Gate | None:
        """A gate as its parks recorded it (limits, queue), for the sweep and for cancels."""
        conf = {
            redis_text(k): redis_text(v)
            for k, v in self.client.hgetall(PREFIX + name + ":conf").items()
        }
        if not conf:
            return None
        return Gate(
            name=name,
            queue=conf["queue"],
            holders=conf.get("holders", ""),
            limit=int(conf.get("limit", 0)),
            bucket=conf.get("bucket", ""),
            interval=float(conf.get("interval", 0)),
            lease=float(conf.get("lease", 30)),
        )

    def waiting_gates(self) -> list[str]:
        return sorted(redis_text(name) for name in self.client.smembers(GATES))

    def waiting_queues(self) -> set[str]:
        """Queues that have parked jobs: their jobs wait here, not in the broker's lists."""
        return {
            redis_text(queue)
            for queue, count in self.client.hgetall(QUEUES).items()
            if int(count) > 0
        }

    def waiting(self, gate: Gate) -> int:
        return int(self.client.zcard(gate.keys()[0]))

    def holding(self, gate: Gate) -> list[str]:
        """Jobs holding a slot of the gate's concurrency key now (lapsed ones left out)."""
        seconds, micros = self.client.time()
        members: list[bytes] = self.client.zrangebyscore(  # type: ignore[assignment]
            CONC_PREFIX + gate.holders, seconds + micros / 1e6, "+inf"
        )
        return [redis_text(member) for member in members]


def count(counter: str, task: str, amount: int = 1) -> None:
    """Add to a per-task counter (RESENDS, PARKED); never raises."""
    try:
        redis_client().hincrby(counter, task, amount)
    except RedisError as exc:
        logger.debug("Could not count %s for %s: %s", counter, task, exc)


def counted(counter: str, tasks: Iterable[str] | None = None) -> dict[str, int]:
    """The per-task counts of RESENDS or PARKED."""
    stored: dict[bytes, bytes] = redis_client().hgetall(counter)  # type: ignore[assignment]
    raw = {redis_text(k): int(v) for k, v in stored.items()}
    return raw if tasks is None else {task: raw.get(task, 0) for task in tasks}
