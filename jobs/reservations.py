"""Which worker holds which message: a heartbeat per worker process and a record of what it
took from Redis, so that the messages a dead worker held go back to their queue within
seconds instead of after the broker's visibility timeout (Sidekiq Pro's super_fetch, per
process).

kombu's Redis transport keeps every message a worker took and has not acknowledged (the
prefetched ones, the running ones, those waiting for their countdown) in its `unacked` hash,
delivery tag → message, and gives it back only once the visibility timeout (2 h) has passed: a
lost host strands concurrency x prefetch jobs per worker that long. Here:

- a worker's main process has an id of its own (node name, pid and a random part: a worker
  restarted under the same name is another worker), and each channel it opens is a holder of
  that id and a sequence number, whose `backlot:worker:<holder>` key a thread of the process
  keeps alive (TTL HEARTBEAT_TTL, every HEARTBEAT_EVERY seconds) while the channel is open;
- each holder (ReservingQoS) records the messages it takes in `backlot:reserved` (delivery tag
  → holder) in the MULTI/EXEC that puts them in `unacked`, and drops the record in the one
  that acknowledges or requeues them: the record and the unacked entry come and go together;
- the relay's sweep (`restore_lost`) finds the holders whose heartbeat is gone (the worker died,
  or the channel was dropped with its connection: Celery forgets what it held then, kombu
  cannot give it back through a dead connection) and moves each of their unacked messages
  back to the head of its queue, as kombu's restore_by_tag would, in a Lua script that checks,
  atomically with the move, that the message is still unacknowledged, still theirs, and their
  heartbeat still absent. A live holder's message is never touched. A message whose job the
  ledger shows running or finished is dropped instead: the running job's lease brings it back
  if its run died, and a copy would only be a duplicate.

A prefetched job runs once, on the next worker that takes it (the ledger's claim).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import redis
from celery import current_app
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps, loads

from .redis import redis_client

logger = logging.getLogger(__name__)

# delivery tag → the holder of the message (while it is in `unacked`): a worker's channel.
OWNERS = "backlot:reserved"
# Holders that may hold messages (each with a heartbeat while its channel is open).
WORKERS = "backlot:workers"
HEARTBEAT = "backlot:worker:"
# Messages given back to their queue because their worker died, and those dropped instead
# because their job was running or finished (counts; for /metrics).
RESTORED = "backlot:metrics:reservations_restored"
DROPPED = "backlot:metrics:reservations_dropped"
# A pass over every record of OWNERS (forgetting those of acknowledged messages) at most this
# often, cluster-wide; the regular sweep reads the hash only when a registered holder died.
FULL_PASS_KEY = "backlot:reserved:full-pass"
FULL_PASS_EVERY = 60
# A worker whose heartbeat is this old is dead. Refreshed every HEARTBEAT_EVERY s: five missed
# refreshes in a row (a main process stalled that long is frozen, not busy) before its
# messages go back; with the relay's 1 s sweep, they run again about 16 s after the death.
HEARTBEAT_TTL = 15
HEARTBEAT_EVERY = 3.0
# A channel's first heartbeat, written before the pool has started (a few seconds; more on a
# loaded 2-core machine), lasts this long: the thread's refreshes begin once the worker is ready.
STARTUP_TTL = 60
# Messages moved per Lua call: keeps one script well under a millisecond of Redis' time.
RESTORE_BATCH = 200

# KEYS: unacked, unacked_index, OWNERS, the worker's heartbeat; ARGV: worker id, then
# (delivery tag, destination list, message) per message. Each message still unacknowledged and
# still the worker's moves to the head of its list (RPUSH: kombu pops from the right); an empty
# destination drops the message instead (DROP), or only its record once the message is gone
# (STALE). Nothing when the heartbeat is back. Returns {moved, dropped}.
_RESTORE_LUA = """
if redis.call('EXISTS', KEYS[4]) == 1 then return {-1, 0} end
local moved, dropped, done = 0, 0, {}
for i = 2, #ARGV, 3 do
    local tag, dest, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    if redis.call('HGET', KEYS[3], tag) == ARGV[1] then
        local held = redis.call('HEXISTS', KEYS[1], tag) == 1
        if dest ~= '' and held then
            redis.call('RPUSH', dest, payload)
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
_STALE, _DROP = ["", ""], ["", "drop"]
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


class ReservingQoS(kombu_redis.QoS):
    """kombu's Redis QoS that also records which holder took each message (see the module
    docstring): installed on the transport's Channel in worker processes by `install()`.

    Each channel is a holder of its own (`owner`: the worker's id and a sequence number),
    alive while the channel is open: a channel dropped with its connection (Redis restarted,
    a network cut) leaves what it held in `unacked`, and Celery forgets those messages with it;
    once its heartbeat lapses they go back to their queue like a dead worker's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owner = heartbeat.register(self)

    def append(self, message: Any, delivery_tag: str) -> None:
        if self.owner is None:
            return super().append(message, delivery_tag)
        delivery = message.delivery_info
        stored = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        # As kombu's QoS.append, with the owner record in the same MULTI/EXEC.
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
                self.unacked_key, delivery_tag, stored
            ).hset(OWNERS, delivery_tag, self.owner).execute()
            virtual.QoS.append(self, message, delivery_tag)
        return None

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        # Every ack, reject and restore of kombu's QoS goes through here (a private method
        # kombu's type stubs leave out).
        if pipe is None and self._connection_closed():
            # The ack of a job that finished after its channel's connection was closed (a Redis
            # failover or restart): kombu would rebuild the pool from the closed connection and
            # raise AttributeError, which Celery does not catch, and the worker would exit. A
            # connection error is logged ("Couldn't ack") instead; the message stays in
            # `unacked` until this holder's heartbeat lapses, and its copy is dropped at claim.
            raise redis.ConnectionError("the channel's broker connection is closed")
        removed = super()._remove_from_indices(delivery_tag, pipe)  # type: ignore[misc]
        return removed.hdel(OWNERS, delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        """What the channel held, back to its queues when it closes; not when its connection
        is already gone (the consumer closing it after a failover): kombu would rebuild the
        pool out of the closed connection and the AttributeError would stop the worker. The
        messages stay in `unacked` and go back once this holder's heartbeat lapses."""
        if client is None and self._connection_closed():
            logger.warning(
                "%d message(s) this channel held stay in unacked: its broker connection is "
                "closed; they go back to their queue once its heartbeat lapses",
                len(self._delivered or ()),
            )
            return
        super().restore_unacked(client)

    def _connection_closed(self) -> bool:
        """Whether kombu has dropped this channel's connection details (the connection was
        closed): no Redis client can be built for it any more."""
        return getattr(getattr(self.channel, "connection", None), "client", None) is None

    @property
    def open(self) -> bool:
        return not getattr(self.channel, "closed", True)


def _plain(client: Any) -> redis.Redis:
    """A client on the broker's connection pool that does not prefix keys (kombu's
    PrefixedStrictRedis prefixes only some commands; the keys here carry the prefix)."""
    return redis.Redis(connection_pool=client.connection_pool)


class Heartbeat:
    """The worker process' id, its holders (one per open channel) and the thread that keeps
    their heartbeats alive."""

    def __init__(self) -> None:
        self.worker_id: str | None = None
        self._holders: weakref.WeakSet[ReservingQoS] = weakref.WeakSet()
        self._count = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._connection: Any = None
        self._failing = False
        self._app: Any = None
        self._pid = 0

    def install(self, *, node: str, app: Any = None) -> str:
        """Become worker `node`'s keeper of reservations, before its consumer takes anything:
        the channels it opens from now on record what they take."""
        self.worker_id = f"{node}:{os.getpid()}:{secrets.token_hex(4)}"
        self._pid = os.getpid()
        self._app = app or current_app
        if not issubclass(kombu_redis.Channel.QoS, ReservingQoS):
            kombu_redis.Channel.QoS = ReservingQoS
        return self.worker_id

    def register(self, holder: ReservingQoS) -> str | None:
        """A new channel's holder id, beating at once: for STARTUP_TTL until the thread runs
        (the pool starts after the consumer), then HEARTBEAT_TTL. None outside a worker."""
        if self.worker_id is None or self._pid != os.getpid():
            return None  # not a worker, or one of its pool processes (they take no messages)
        with self._lock:
            self._count += 1
            owner = f"{self.worker_id}/{self._count}"
            self._holders.add(holder)
        running = self._thread is not None and self._thread.is_alive()
        self._beat([owner], HEARTBEAT_TTL if running else STARTUP_TTL)
        return owner

    def keep_alive(self) -> None:
        """Refresh the heartbeats from a thread of this process, every HEARTBEAT_EVERY s.
        Started once the pool has forked (a process that forks with threads running may hand
        a held lock to its children)."""
        if self.worker_id is None or (self._thread is not None and self._thread.is_alive()):
            return
        self.beat()
        self._thread = threading.Thread(target=self._run, name="backlot-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """One heartbeat for every holder whose channel is still open."""
        with self._lock:
            owners = [h.owner for h in list(self._holders) if h.open and h.owner]
        if owners:
            self._beat(owners, HEARTBEAT_TTL)

    def _beat(self, owners: list[str], ttl: int) -> None:
        try:
            with self._lock:
                if self._connection is None:
                    self._connection = self._app.connection_for_write()
                channel = self._connection.default_channel
            prefix = channel.global_keyprefix
            pipe = _plain(channel.client).pipeline(transaction=True)
            for owner in owners:
                pipe.set(f"{prefix}{HEARTBEAT}{owner}", int(time.time()), ex=ttl)
            pipe.sadd(f"{prefix}{WORKERS}", *owners)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the broker is away: the next beat retries
            if not self._failing:
                logger.warning("Worker heartbeat failed (%s): %s", type(exc).__name__, exc)
            self._failing = True
            with self._lock:
                connection, self._connection = self._connection, None
            if connection is not None:
                with contextlib.suppress(Exception):  # broken: dropped anyway
                    connection.release()
            return
        if self._failing:
            logger.info("Worker heartbeat is back")
        self._failing = False

    def _run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_EVERY)
            self.beat()


heartbeat = Heartbeat()


def install(*, node: str, app: Any = None) -> str:
    """In a worker's main process, before it consumes (worker_init): record what it
    reserves. Returns the worker's id."""
    return heartbeat.install(node=node, app=app)


def keep_alive() -> None:
    """In a worker's main process once it is ready (worker_ready): keep its heartbeat."""
    heartbeat.keep_alive()


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
        client = _plain(channel.client)
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
        argv: list[str] = [worker]
        for tag in batch:
            if tag not in messages:
                argv += [tag, *_STALE]  # acknowledged: only the record is left
            elif ids[tag] in duplicates:
                argv += [tag, *_DROP]
            else:
                argv += _restoring(channel, prefix, tag, *messages[tag])
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
    """(tag, list, message) of a message going back to its queue, as kombu's
    _do_restore_message writes it (marked redelivered, in the list of its priority)."""
    try:
        payload["headers"]["redelivered"] = True
        payload["properties"]["delivery_info"]["redelivered"] = True
    except (KeyError, TypeError):
        pass
    priority = channel._get_message_priority(payload, reverse=False)
    argv: list[str] = []
    for queue in channel._lookup(exchange, routing_key):
        argv += [tag, f"{prefix}{channel._q_for_pri(queue, priority)}", dumps(payload)]
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
