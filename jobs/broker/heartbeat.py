"""A worker's heartbeat and presence: each worker process has an id of its own (node name, pid
and a random part: a worker restarted under the same name is another worker), and each channel
it opens is a holder of that id and a sequence number (jobs.broker.reservations.ReservingQoS),
whose `backlot:worker:<holder>` key a thread of the process keeps alive (TTL HEARTBEAT_TTL,
every HEARTBEAT_EVERY seconds) while the channel is open. Once a holder's heartbeat is gone,
jobs.broker.restore gives what it held back to its queue.

The same thread refreshes the worker's presence (its queues and concurrency) for the cockpit:
the dashboard, /metrics and /health/ read who is there with two Redis commands instead of an
inspect broadcast (workers_present).
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
from typing import Any, Protocol

import redis
from celery import current_app

from jobs.broker.redis import redis_client, redis_text

logger = logging.getLogger(__name__)

# Holders that may hold messages (each with a heartbeat while its channel is open).
WORKERS = "backlot:workers"
HEARTBEAT = "backlot:worker:"
# A worker's presence, for the cockpit (the dashboard, /metrics, /health/): its node name ->
# JSON {"queues", "concurrency", "pid", "beat"} under PRESENCE + node, TTL HEARTBEAT_TTL, in
# the platform's Redis; the set PRESENCE_NODES names them. Written by the same thread as the
# heartbeat, so reading who is there costs two Redis commands instead of a 1 s inspect
# broadcast (issue 25: 2.05-2.33 s per stale dashboard).
PRESENCE = "backlot:presence:"
PRESENCE_NODES = "backlot:presence"
# A worker whose heartbeat is this old is dead. Refreshed every HEARTBEAT_EVERY s: five missed
# refreshes in a row (a main process stalled that long is frozen, not busy) before its
# messages go back; with the relay's 1 s sweep, they run again about 16 s after the death.
HEARTBEAT_TTL = 15
HEARTBEAT_EVERY = 3.0
# A channel's first heartbeat, written before the pool has started (a few seconds; more on a
# loaded 2-core machine), lasts this long: the thread's refreshes begin once the worker is ready.
STARTUP_TTL = 60


class Holder(Protocol):
    """A channel that holds messages (jobs.broker.reservations.ReservingQoS)."""

    owner: str | None

    @property
    def open(self) -> bool: ...


def plain_client(client: Any) -> redis.Redis:
    """A client on the broker's connection pool that does not prefix keys (kombu's
    PrefixedStrictRedis prefixes only some commands; the keys here carry the prefix)."""
    return redis.Redis(connection_pool=client.connection_pool)


class Heartbeat:
    """The worker process' id, its holders (one per open channel) and the thread that keeps
    their heartbeats alive."""

    def __init__(self) -> None:
        self.worker_id: str | None = None
        self._holders: weakref.WeakSet[Holder] = weakref.WeakSet()
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
        """Become worker `node`'s keeper of heartbeats (jobs.broker.reservations.install): the
        channels it opens from now on register as holders."""
        self.worker_id = f"{node}:{os.getpid()}:{secrets.token_hex(4)}"
        self._node = node
        self._pid = os.getpid()
        self._app = app or current_app
        return self.worker_id

    def holders(self) -> list[Holder]:
        """The holders of this worker process's open channels (none in its pool processes)."""
        if self._pid != os.getpid():
            return []
        with self._lock:
            return list(self._holders)

    def register(self, holder: Holder) -> str | None:
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
