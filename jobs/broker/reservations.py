"""Which worker holds which message, the worker's side: a heartbeat per worker process and a
record of what it took from Redis, so that the messages a dead worker held go back to their
queue within seconds instead of after the broker's visibility timeout (Sidekiq Pro's
super_fetch, per process). The relay's sweep that gives them back is jobs.broker.restore.

kombu's Redis transport keeps every message a worker took and has not acknowledged (the
prefetched ones, the running ones, those waiting for their countdown) in its `unacked` hash,
delivery tag → message, and gives it back only once the visibility timeout (2 h) has passed: a
lost host strands concurrency x prefetch jobs per worker that long. Here:

- a worker's main process has an id of its own (node name, pid and a random part: a worker
  restarted under the same name is another worker), and each channel it opens is a holder of
  that id and a sequence number, whose `backlot:worker:<holder>` key a thread of the process
  keeps alive (TTL HEARTBEAT_TTL, every HEARTBEAT_EVERY seconds) while the channel is open;
- each holder (ReservingQoS) records the messages it takes in `backlot:reserved` (delivery tag
  → holder) in the MULTI/EXEC that puts them in `unacked` (or jobs.broker.fetch's atomic fetch
  writes
  both in the script that pops the message), and drops the record in the one that acknowledges
  or requeues them: the record and the unacked entry come and go together;
- once a holder's heartbeat is gone, jobs.broker.restore moves what it held back to its queue.

A prefetched job runs once, on the next worker that takes it (the ledger's claim).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
import weakref
from functools import cached_property
from typing import Any

import redis
from celery import current_app
from kombu.asynchronous import get_event_loop
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from jobs.broker import counters
from jobs.broker.redis import redis_client, redis_text

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
# A worker's presence, for the cockpit (the dashboard, /metrics, /health/): its node name ->
# JSON {"queues", "concurrency", "pid", "beat"} under PRESENCE + node, TTL HEARTBEAT_TTL, in
# the platform's Redis; the set PRESENCE_NODES names them. Written by the same thread as the
# heartbeat, so reading who is there costs two Redis commands instead of a 1 s inspect
# broadcast (issue 25: 2.05-2.33 s per stale dashboard).
PRESENCE = "backlot:presence:"
PRESENCE_NODES = "backlot:presence"
# A `-P solo` worker's acknowledgements ride with its next fetch (jobs.broker.fetch, whose
# script drops the acknowledged messages' entries and writes the metric counts before it pops
# the next message): a round trip per job fewer. The next fetch is sent in the event loop's
# next turn; acknowledgements no fetch took within RIDE_WAIT seconds (the channel stopped
# consuming, or its prefetch is full of messages waiting for their countdown) are settled in a
# MULTI/EXEC of their own. Set by jobs.broker.fetch.install.
RIDE_WAIT = 0.1
_riding = {"on": False}
# A worker whose heartbeat is this old is dead. Refreshed every HEARTBEAT_EVERY s: five missed
# refreshes in a row (a main process stalled that long is frozen, not busy) before its
# messages go back; with the relay's 1 s sweep, they run again about 16 s after the death.
HEARTBEAT_TTL = 15
HEARTBEAT_EVERY = 3.0
# A channel's first heartbeat, written before the pool has started (a few seconds; more on a
# loaded 2-core machine), lasts this long: the thread's refreshes begin once the worker is ready.
STARTUP_TTL = 60


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
        self._fetched: str | None = None
        self.riding: list[str] = []  # acknowledged, for the next fetch to settle (RIDE_WAIT)
        self._ride_seen: list[str] | None = None
        self._ride_timer: Any = None

    def fetched(self, delivery_tag: str) -> None:
        """The message about to be delivered is in `unacked` and recorded as this holder's
        already (jobs.broker.fetch took it in one step): its append is in memory only."""
        self._fetched = delivery_tag

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag == self._fetched:
            self._fetched = None
            return virtual.QoS.append(self, message, delivery_tag)
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

    def ack(self, delivery_tag: str) -> None:
        if not (_riding["on"] and self._ride(delivery_tag)):
            self._settle(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def _ride(self, delivery_tag: str) -> bool:
        """Leave an acknowledgement to the channel's next fetch (RIDE_WAIT); False where it
        cannot wait: off the event loop's thread, or with no event loop."""
        if self._ride_timer is None:
            hub = get_event_loop()
            if hub is None:
                return False
            self._ride_timer = hub.call_repeatedly(RIDE_WAIT, self._settle_stale)
        if threading.current_thread() is not threading.main_thread():
            return False
        self.riding.append(delivery_tag)
        return True

    def take_riding(self) -> list[str]:
        """The acknowledgements waiting for a fetch, taken by the fetch that settles them."""
        tags, self.riding = self.riding, []
        return tags

    def _settle_stale(self) -> None:
        """Every RIDE_WAIT: settle the acknowledgements that waited a whole round for a fetch
        (the list a fetch takes is replaced by a new one; the same list twice is a stale one)."""
        if self.riding and self.riding is self._ride_seen:
            self.settle_riding()
        self._ride_seen = self.riding

    def settle_riding(self) -> None:
        """The acknowledgements no fetch took, in a MULTI/EXEC of their own; a connection error
        is logged, as kombu logs an acknowledgement that failed (the messages stay in `unacked`
        until this holder's heartbeat lapses, and their copies are dropped at claim)."""
        tags = self.take_riding()
        if not tags:
            return
        try:
            self._settle(*tags)
        except redis.RedisError as exc:
            logger.warning("Couldn't ack %d message(s): %s", len(tags), exc)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            return super().reject(delivery_tag, requeue=True)  # back to its queue, as kombu's
        self._settle(delivery_tag)
        return virtual.QoS.ack(self, delivery_tag)  # kombu's reject without requeue

    def _settle(self, *delivery_tags: str) -> None:
        """kombu's Redis ack: the messages out of `unacked` in one MULTI/EXEC, here with their
        owner records (`_remove_from_indices`) and the metric counts this process's runs left
        to it (jobs.broker.counters.carry()) when the broker's Redis is the platform's."""
        pipe = self._remove_from_indices(delivery_tags[0])
        for tag in delivery_tags[1:]:
            self._remove_from_indices(tag, pipe)
        counts = counters.take() if self.carries_counts else None
        if counts is None:
            pipe.execute()
            return
        settling = len(pipe.command_stack)  # the ack's own commands, before the counts
        counters.write(pipe, counts)
        try:
            replies = pipe.execute(raise_on_error=False)
        except BaseException:
            counters.give_back(counts)  # nothing ran (the MULTI/EXEC never reached Redis)
            raise
        # A count Redis refused (a metrics key of another type) is that count's loss only: the
        # others and the ack were applied, so neither the ack nor the counts are redone.
        (written,) = replies[settling:]
        if isinstance(written, Exception) or counters.refused(written):
            logger.debug("Metric counts not all written with an ack: %s", written)
        for reply in replies[:settling]:
            if isinstance(reply, Exception):
                raise reply

    @cached_property
    def carries_counts(self) -> bool:
        """Whether this channel's acks may write the platform's metric counts: the broker's
        Redis is the platform's (same server and database, no key prefix, no Sentinel)."""
        try:
            channel: Any = self.channel  # kombu's Redis Channel (the stubs know the base)
            return not channel.global_keyprefix and same_redis(
                channel.pool, redis_client().connection_pool
            )
        except Exception:  # noqa: BLE001 - then the runs flush their counts themselves
            return False

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
        messages stay in `unacked` and go back once this holder's heartbeat lapses. The
        acknowledgements waiting for a fetch are settled first."""
        if client is None and self._connection_closed():
            logger.warning(
                "%d message(s) this channel held stay in unacked: its broker connection is "
                "closed; they go back to their queue once its heartbeat lapses",
                len(self._delivered or ()),
            )
            return
        self.settle_riding()
        if self._ride_timer is not None:
            self._ride_timer.cancel()
        super().restore_unacked(client)

    def _connection_closed(self) -> bool:
        """Whether kombu has dropped this channel's connection details (the connection was
        closed): no Redis client can be built for it any more."""
        return getattr(getattr(self.channel, "connection", None), "client", None) is None

    @property
    def open(self) -> bool:
        return not getattr(self.channel, "closed", True)


def ride_acks(on: bool) -> None:
    """A `-P solo` worker's acknowledgements ride with its next fetch (RIDE_WAIT;
    jobs.broker.fetch.install)."""
    _riding["on"] = on


def carries_counts() -> bool:
    """Whether this process's acknowledgements write the metric counts its runs hold (a
    worker's main process on a Redis broker that is the platform's Redis: -P solo, threads)."""
    return any(qos.carries_counts for qos in heartbeat.holders())


def same_redis(one: redis.ConnectionPool, other: redis.ConnectionPool) -> bool:
    """Whether two plain (not Sentinel) connection pools reach the same Redis database."""
    if type(one) is not redis.ConnectionPool or type(other) is not redis.ConnectionPool:
        return False
    fields = ("host", "port", "path", "db", "username", "password")
    mine, theirs = one.connection_kwargs, other.connection_kwargs
    return all(mine.get(f) == theirs.get(f) for f in fields) and issubclass(
        one.connection_class, redis.SSLConnection
    ) == issubclass(other.connection_class, redis.SSLConnection)


def plain_client(client: Any) -> redis.Redis:
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
        self._node = ""
        self._presence: dict[str, Any] | None = None

    def install(self, *, node: str, app: Any = None) -> str:
        """Become worker `node`'s keeper of reservations, before its consumer takes anything:
        the channels it opens from now on record what they take."""
        self.worker_id = f"{node}:{os.getpid()}:{secrets.token_hex(4)}"
        self._node = node
        self._pid = os.getpid()
        self._app = app or current_app
        if not issubclass(kombu_redis.Channel.QoS, ReservingQoS):
            kombu_redis.Channel.QoS = ReservingQoS
        return self.worker_id

    def holders(self) -> list[ReservingQoS]:
        """The holders of this worker process's open channels (none in its pool processes)."""
        if self._pid != os.getpid():
            return []
        with self._lock:
            return list(self._holders)

    def register(self, holder: ReservingQoS) -> str | None:
        """A new channel's holder id, beating at once: for STARTUP_TTL until the thread runs
        (the pool starts after the consumer), then HEARTBEAT_TTL. None outside a worker."""
        if self.worker_id is None or self._pid != os.getpid():
            return None  # not a worker, or one of its pool processes (they take no messages)
        with self._lock:
            self._count += 1
            owner = f"{self.worker_id}/{self._count}"
            # set before the heartbeat thread can see the holder: register() returns only
            # after its first beat, which waits on Redis (long while Redis is away)
            holder.owner = owner
            self._holders.add(holder)
        running = self._thread is not None and self._thread.is_alive()
        self._beat([owner], HEARTBEAT_TTL if running else STARTUP_TTL)
        return owner

    def keep_alive(self, presence: dict[str, Any] | None = None) -> None:
        """Refresh the heartbeats from a thread of this process, every HEARTBEAT_EVERY s, and
        with them the worker's `presence` (its queues and concurrency) when given.
        Started once the pool has forked (a process that forks with threads running may hand
        a held lock to its children)."""
        if presence is not None:
            self._presence = {**presence, "pid": os.getpid()}
        if self.worker_id is None or (self._thread is not None and self._thread.is_alive()):
            return
        self.beat()
        self._thread = threading.Thread(target=self._run, name="backlot-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """One heartbeat for every holder whose channel is still open."""
        with self._lock:
            owners = [h.owner for h in list(self._holders) if h.open and h.owner]
        # (a holder's owner is set at register(), before it joins the set)
        if owners:
            self._beat(owners, HEARTBEAT_TTL)
        if self._presence is not None:
            self._announce()

    def _announce(self) -> None:
        """The worker's presence record, refreshed (a failure is the heartbeat's to report)."""
        try:
            client = redis_client()
            pipe = client.pipeline(transaction=False)
            record = {**(self._presence or {}), "beat": time.time()}
            pipe.set(PRESENCE + self._node, json.dumps(record), ex=HEARTBEAT_TTL)
            pipe.sadd(PRESENCE_NODES, self._node)
            pipe.execute()
        except Exception as exc:  # noqa: BLE001 - Redis away: the next beat retries
            logger.debug("Worker presence not written: %s", exc)

    def leave(self) -> None:
        """The worker stops: its presence goes at once, not HEARTBEAT_TTL later."""
        if self._presence is None or not self._node:
            return
        self._presence = None  # the heartbeat thread announces it no more
        with contextlib.suppress(Exception):
            client = redis_client()
            client.delete(PRESENCE + self._node)
            client.srem(PRESENCE_NODES, self._node)

    def _beat(self, owners: list[str], ttl: int) -> None:
        try:
            with self._lock:
                if self._connection is None:
                    self._connection = self._app.connection_for_write()
                channel = self._connection.default_channel
            prefix = channel.global_keyprefix
            pipe = plain_client(channel.client).pipeline(transaction=True)
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
        # The thread must outlive any one failing beat: if it died, this live worker's holders
        # would lapse and the relay would give back every message it holds as a dead worker's.
        while True:
            time.sleep(HEARTBEAT_EVERY)
            try:
                self.beat()
            except Exception:  # logged; the next beat runs HEARTBEAT_EVERY s on
                logger.exception("Worker heartbeat raised; it beats again in %s s", HEARTBEAT_EVERY)


heartbeat = Heartbeat()


def install(*, node: str, app: Any = None) -> str:
    """In a worker's main process, before it consumes (worker_init): record what it
    reserves. Returns the worker's id."""
    return heartbeat.install(node=node, app=app)


def keep_alive(presence: dict[str, Any] | None = None) -> None:
    """In a worker's main process once it is ready (worker_ready): keep its heartbeat, and
    its presence ({"queues": [...], "concurrency": n}) for workers_present()."""
    heartbeat.keep_alive(presence)


def leave() -> None:
    """In a worker's main process as it shuts down: its presence is removed."""
    heartbeat.leave()


def workers_present() -> dict[str, dict[str, Any]]:
    """Worker node -> its presence record ("queues" it was started with, "concurrency",
    "pid", "beat": its last heartbeat as a Unix time), for every worker whose heartbeat is
    younger than HEARTBEAT_TTL. Two Redis commands (three when one has gone); no broadcast."""
    client = redis_client()
    nodes = sorted(redis_text(node) for node in client.smembers(PRESENCE_NODES))
    if not nodes:
        return {}
    records = client.mget([PRESENCE + node for node in nodes])
    present = {node: json.loads(raw) for node, raw in zip(nodes, records, strict=True) if raw}
    gone = [node for node in nodes if node not in present]
    if gone:
        client.srem(PRESENCE_NODES, *gone)
    return present
