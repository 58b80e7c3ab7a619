"""The relay's side of jobs.broker.reservations: give the messages a dead worker held back to their
queue within seconds, not after the broker's visibility timeout.

`restore_lost` (run by the relay's sweep) finds the holders whose heartbeat is gone (the worker
died, or the channel was dropped with its connection: Celery forgets what it held then, kombu
cannot give it back through a dead connection) and moves each of their unacked messages back to
the head of its queue, as kombu's restore_by_tag would, in a Lua script that checks, atomically
with the move, that the message is still unacknowledged, still theirs, and their heartbeat
still absent. A live holder's message is never touched. A message whose job the ledger shows
running or finished is dropped instead: the running job's lease brings it back if its run died,
and a copy would only be a duplicate.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
from celery import current_app
from kombu.utils.json import dumps, loads

from jobs.broker import running
from jobs.broker.heartbeat import HEARTBEAT, WORKERS, plain_client
from jobs.broker.protocol import BELL, BELL_CAP
from jobs.broker.redis import redis_client
from jobs.broker.reservations import DROPPED, OWNERS, RESTORED
from jobs.core.conf import backlot_settings

logger = logging.getLogger(__name__)

# A pass over every record of OWNERS (forgetting those of acknowledged messages) at most this
# often, cluster-wide; the regular sweep reads the hash only when a registered holder died.
FULL_PASS_KEY = "backlot:reserved:full-pass"
FULL_PASS_EVERY = 60

# Messages moved per Lua call: keeps one script well under a millisecond of Redis' time.
RESTORE_BATCH = 200

# KEYS: unacked, unacked_index, OWNERS, the worker's heartbeat; ARGV: worker id, the bells'
# cap, then (delivery tag, destination list, message, the queue's bell) per message. Each
# message still unacknowledged and still the worker's moves to the head of its list (RPUSH:
# kombu pops from the right) and rings its queue's bell (jobs.broker.fetch); an empty destination
# drops the message instead (DROP), or only its record once the message is gone (STALE). Nothing
# when the heartbeat is back. Returns {moved, dropped}.
_RESTORE_LUA = """
if redis.call('EXISTS', KEYS[4]) == 1 then return {-1, 0} end
local moved, dropped, done = 0, 0, {}
for i = 3, #ARGV, 4 do
    local tag, dest, payload, bell = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    if redis.call('HGET', KEYS[3], tag) == ARGV[1] then
        local held = redis.call('HEXISTS', KEYS[1], tag) == 1
        if dest ~= '' and held then
            redis.call('RPUSH', dest, payload)
            if bell ~= '' then
                redis.call('LPUSH', bell, 1)
                redis.call('LTRIM', bell, 0, tonumber(ARGV[2]) - 1)
            end
            if not done[tag] then moved = moved + 1 end
            done[tag] = true
        elseif dest == '' and payload == 'drop' and held then
            dropped = dropped + 1
            done[tag] = true
        elseif dest == '' and not held then
            done[tag] = true
        end
    end
end
for tag in pairs(done) do
    redis.call('HDEL', KEYS[1], tag)
    redis.call('ZREM', KEYS[2], tag)
    redis.call('HDEL', KEYS[3], tag)
end
return {moved, dropped}
"""
_STALE, _DROP = ["", "", ""], ["", "drop", ""]
# KEYS: unacked, OWNERS; ARGV: holder, then delivery tags: forget each record still the
# holder's whose message is no longer unacknowledged.
_FORGET_LUA = """
for i = 2, #ARGV do
    if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1]
        and redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
        redis.call('HDEL', KEYS[2], ARGV[i])
    end
end
return 0
"""


def restore_lost(*, settled: Callable[[list[str]], set[str]] | None = None) -> int:
    """Give the messages of dead holders (registered, heartbeat gone) back to the head of their
    queues; returns how many. `settled(job_ids)` names the jobs whose message would be a duplicate
    (running: their lease brings them back; finished): those messages are dropped instead.
    Broker errors are raised (the caller logs them and sweeps again)."""
    connection: Any
    # app.pool is the broker connection pool (celery-types calls it a producer pool).
    with current_app.pool.acquire(block=True, timeout=5) as connection:
        channel = connection.default_channel
        prefix = channel.global_keyprefix
        client = plain_client(channel.client)
        workers = [_text(w) for w in client.smembers(f"{prefix}{WORKERS}")]
        alive = _alive(client, prefix, workers)
        dead = {w for w in workers if not alive[w]}
        full_pass = bool(client.set(f"{prefix}{FULL_PASS_KEY}", 1, nx=True, ex=FULL_PASS_EVERY))
        if not dead and not full_pass:
            return 0
        held: dict[str, list[str]] = defaultdict(list)
        for tag, worker in client.hgetall(f"{prefix}{OWNERS}").items():
            held[_text(worker)].append(_text(tag))
        restored = dropped = 0
        for worker in dead:
            if worker not in held:
                client.srem(f"{prefix}{WORKERS}", worker)  # gone, and holds nothing any more
                continue
            moved, gone = _restore_worker(channel, client, prefix, worker, held[worker], settled)
            restored, dropped = restored + moved, dropped + gone
        if full_pass:
            # Records a holder outside the registry left (the registry flushed, or its first
            # beat failed) stay: with no heartbeat to go by, its liveness is unknown.
            for worker, tags in held.items():
                if worker not in dead:
                    _forget_acknowledged(channel, client, prefix, worker, tags)
        if restored or dropped:  # counted where /metrics reads the platform's counters
            pipe = redis_client().pipeline(transaction=False)
            pipe.incrby(RESTORED, restored)
            pipe.incrby(DROPPED, dropped)
            pipe.execute()
        return restored


def _restore_worker(
    channel: Any,
    client: redis.Redis,
    prefix: str,
    worker: str,
    tags: list[str],
    settled: Callable[[list[str]], set[str]] | None,
) -> tuple[int, int]:
    unacked = f"{prefix}{channel.unacked_key}"
    keys = [unacked, f"{prefix}{channel.unacked_index_key}", f"{prefix}{OWNERS}"]
    keys.append(f"{prefix}{HEARTBEAT}{worker}")
    script = client.register_script(_RESTORE_LUA)
    moved = dropped = 0
    for at in range(0, len(tags), RESTORE_BATCH):
        batch = tags[at : at + RESTORE_BATCH]
        messages = {
            tag: loads(stored)
            for tag, stored in zip(batch, client.hmget(unacked, batch), strict=True)
            if stored is not None
        }
        ids = {tag: _job_id(stored[0]) for tag, stored in messages.items()}
        duplicates = settled([i for i in ids.values() if i]) if settled is not None else set()
        argv: list[str] = [worker, str(BELL_CAP)]
        stamped: list[str] = []
        for tag in batch:
            if tag not in messages:
                argv += [tag, *_STALE]  # acknowledged: only the record is left
            elif ids[tag] in duplicates:
                argv += [tag, *_DROP]
            else:
                if running.unstamp(messages[tag][0]) and (job_id := ids[tag]):
                    stamped.append(job_id)
                argv += _restoring(channel, prefix, tag, *messages[tag])
        # before the move: the holder's own copy of a job no run took must read the row too
        running.hold_absent(stamped)
        result = script(keys=keys, args=argv)
        if int(result[0]) < 0:
            logger.info("Worker %s is back; its messages stay with it", worker)
            break
        moved, dropped = moved + int(result[0]), dropped + int(result[1])
    if moved or dropped:
        logger.warning(
            "Worker %s stopped beating: %d message(s) it held went back to their queue, %d "
            "of running or finished jobs were dropped",
            worker,
            moved,
            dropped,
        )
    return moved, dropped


def _restoring(
    channel: Any, prefix: str, tag: str, payload: Any, exchange: str, routing_key: str
) -> list[str]:
    """(tag, list, message, bell) of a message going back to its queue, as kombu's
    _do_restore_message writes it (marked redelivered, in the list of its priority); the bell
    of its queue, rung with it (jobs.broker.fetch)."""
    try:
        payload["headers"]["redelivered"] = True
        payload["properties"]["delivery_info"]["redelivered"] = True
    except (KeyError, TypeError):
        pass
    priority = channel._get_message_priority(payload, reverse=False)
    argv: list[str] = []
    for queue in channel._lookup(exchange, routing_key):
        destination = f"{prefix}{channel._q_for_pri(queue, priority)}"
        bell = f"{prefix}{BELL}{queue}" if backlot_settings().ATOMIC_FETCH else ""
        argv += [tag, destination, dumps(payload), bell]
    return argv


def _job_id(payload: Any) -> str | None:
    """The task id of a Celery message (protocol 2: in its headers)."""
    try:
        job_id = payload["headers"]["id"]
    except (KeyError, TypeError):
        return None
    return job_id if isinstance(job_id, str) else None


def _forget_acknowledged(
    channel: Any, client: redis.Redis, prefix: str, worker: str, tags: list[str]
) -> None:
    """Drop the records of messages no longer in `unacked` (acknowledged through a kombu path
    that bypasses the QoS's indices); the holder's live messages are left alone."""
    unacked = f"{prefix}{channel.unacked_key}"
    script = client.register_script(_FORGET_LUA)
    for at in range(0, len(tags), RESTORE_BATCH):
        batch = tags[at : at + RESTORE_BATCH]
        gone = [t for t, m in zip(batch, client.hmget(unacked, batch), strict=True) if m is None]
        if gone:
            script(keys=[unacked, f"{prefix}{OWNERS}"], args=[worker, *gone])


def _alive(client: redis.Redis, prefix: str, workers: list[str]) -> dict[str, bool]:
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        pipe.exists(f"{prefix}{HEARTBEAT}{worker}")
    return {worker: bool(found) for worker, found in zip(workers, pipe.execute(), strict=True)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
