"""Which worker holds which message, the worker's side: a record of what each channel took
from Redis, so that a dead worker's messages go back to their queue within seconds, not after
the visibility timeout (Sidekiq Pro's super_fetch, per process). The channel's heartbeat is
jobs.broker.heartbeat; the relay's sweep that gives the messages back, jobs.broker.restore.

kombu's Redis transport keeps every message a worker took and has not acknowledged (the
prefetched ones, the running ones, those waiting for their countdown) in its `unacked` hash,
delivery tag → message, and gives it back only once the visibility timeout (2 h) has passed: a
lost host strands concurrency x prefetch jobs per worker that long. Here:

- each channel a worker's main process opens is a holder (ReservingQoS) with a heartbeat of its
  own while the channel is open (jobs.broker.heartbeat);
- each holder records the messages it takes in `backlot:reserved` (delivery tag → holder) in
  the MULTI/EXEC that puts them in `unacked` (or jobs.broker.fetch's atomic fetch writes both in
  the script that pops the message), and drops the record in the one that acknowledges or
  requeues them: the record and the unacked entry come and go together;
- once a holder's heartbeat is gone, jobs.broker.restore moves what it held back to its queue.

A prefetched job runs once, on the next worker that takes it (the ledger's claim).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any

import hiredis
import redis
from kombu.asynchronous import get_event_loop
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from jobs.broker import counters, running
from jobs.broker.heartbeat import heartbeat
from jobs.broker.redis import redis_client
from jobs.broker.unanswered import Unanswered

logger = logging.getLogger(__name__)

# delivery tag → the holder of the message (while it is in `unacked`): a worker's channel.
OWNERS = "backlot:reserved"
# Messages given back to their queue because their worker died, and those dropped instead
# because their job was running or finished (counts; for /metrics).
RESTORED = "backlot:metrics:reservations_restored"
DROPPED = "backlot:metrics:reservations_dropped"
# A `-P solo` worker's acknowledgements ride with its next fetch (jobs.broker.fetch, whose
# script drops the acknowledged messages' entries and writes the metric counts before it pops
# the next message): a round trip per job fewer. The next fetch is sent in the event loop's
# next turn; acknowledgements no fetch took within RIDE_WAIT seconds (the channel stopped
# consuming, or its prefetch is full of messages waiting for their countdown) are settled in a
# MULTI/EXEC of their own. Set by jobs.broker.fetch.install.
RIDE_WAIT = 0.1
_riding = {"on": False}


class HeldAcks:
    """Acknowledgements held until their job's success is written (jobs.worker.finishes: a
    worker writes several short successes in one statement). A held message leaves the channel's
    prefetch count at its ack, but stays in `unacked` (and this holder's) until it is released;
    then it rides with the next fetch (-P solo) or ack (prefork), or is settled within two
    RIDE_WAIT rounds. Thread-safe: a success may be written by another thread than the loop's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: set[str] = set()  # to be held at their ack
        self._parked: set[str] = set()  # acknowledged, not settled yet
        self._released: list[str] = []  # acknowledged and released: for the next fetch
        self.before_restore: list[Callable[[], None]] = []  # write what holds them, at close

    def hold(self, delivery_tag: str) -> None:
        with self._lock:
            self._held.add(delivery_tag)

    def park(self, delivery_tag: str) -> bool:
        """At the ack: True when it is held (parked until released)."""
        with self._lock:
            if delivery_tag not in self._held:
                return False
            self._held.discard(delivery_tag)
            self._parked.add(delivery_tag)
            return True

    def release(self, delivery_tags: Iterable[str]) -> None:
        with self._lock:
            for tag in delivery_tags:
                self._held.discard(tag)  # not acknowledged yet: its ack is an ordinary one
                if tag in self._parked:
                    self._parked.discard(tag)
                    self._released.append(tag)

    def take_released(self) -> list[str]:
        with self._lock:
            released, self._released = self._released, []
            return released


held_acks = HeldAcks()


# The run records' marks (running.STARTED), sent without waiting for their replies (read every
# RIDE_WAIT): a mark not made leaves the record reserved, which its readers handle.
unanswered = Unanswered(
    lambda: redis_client().connection_pool, "a run record's mark", refused_level=logging.DEBUG
)


def _mark(*args: Any) -> None:
    try:
        unanswered.send_packed(hiredis.pack_command(args), 1)
    except redis.RedisError as exc:
        logger.debug("Run records not marked started (they read reserved): %s", exc)


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
        # tag -> (job id, claim token): a run whose record goes with its message's ack (`ran`)
        self.runs: dict[str, tuple[str, str]] = {}
        # tag -> (job id, token): a record the prefork fetch took reserved, until `handed` or back
        self.reserved: dict[str, tuple[str, str]] = {}
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

    def reserve(self, message: dict[str, Any], token: str) -> None:
        """The fetch took this message's run record `reserved` (jobs.broker.running.STARTED)."""
        self.reserved[message["properties"]["delivery_tag"]] = (message["headers"]["id"], token)

    def handed(self, delivery_tag: str) -> None:
        """Celery took the delivered message for a free pool process: its record says started
        before the process can run it (a job killing its whole worker at once still counts)."""
        if run := self.reserved.pop(delivery_tag, None):
            _mark("EVAL", running.STARTED, 0, *running.forget_args([run]))

    def unreserve(self, delivery_tag: str, pipe: Any) -> None:
        """The message goes back to its queue undelivered (a paused queue's consumer cancelled,
        the channel closing): its reserved record goes in the restore's MULTI/EXEC."""
        if run := self.reserved.pop(delivery_tag, None):
            pipe.execute_command("EVAL", running.UNRESERVE, 0, *running.forget_args([run]))

    def ack(self, delivery_tag: str) -> None:
        later = self._riding()
        if later and held_acks.park(delivery_tag):
            pass  # held until its success is written: settled once released
        elif later and _riding["on"]:
            self.riding.append(delivery_tag)
        else:  # with those released since the last ack (a prefork worker's held ones)
            self._settle(delivery_tag, *self.take_riding())
        virtual.QoS.ack(self, delivery_tag)  # out of the channel's prefetch count

    def _riding(self) -> bool:
        """Whether an acknowledgement may wait (for the channel's next fetch, RIDE_WAIT, or for
        its success's write, HeldAcks): not off the event loop's thread, nor with no event
        loop."""
        if threading.current_thread() is not threading.main_thread():
            return False
        if self._ride_timer is None:
            hub = get_event_loop()
            if hub is None:
                return False
            self._ride_timer = hub.call_repeatedly(RIDE_WAIT, self._settle_stale)
        return True

    def take_riding(self) -> list[str]:
        """The acknowledgements waiting for a fetch (and those held until now: HeldAcks),
        taken by the fetch that settles them."""
        tags, self.riding = self.riding, []
        return tags + held_acks.take_released()

    def _settle_stale(self) -> None:
        """Every RIDE_WAIT: settle the acknowledgements that waited a whole round for a fetch
        (the list a fetch takes is replaced by a new one; the same list twice is a stale one)."""
        self.riding += held_acks.take_released()
        if self.riding and self.riding is self._ride_seen:
            self.settle_riding()
        self._ride_seen = self.riding
        unanswered.read()

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

    def ended(self, delivery_tags: Iterable[str]) -> list[tuple[str, str]]:
        """The runs of these messages, settled now: their records go (jobs.broker.running)."""
        return [run for tag in delivery_tags if (run := self.runs.pop(tag, None))]

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.runs.pop(delivery_tag, None)  # its record stays: the copy's run reads it
            return super().reject(delivery_tag, requeue=True)  # back to its queue, as kombu's
        self._settle(delivery_tag)
        return virtual.QoS.ack(self, delivery_tag)  # kombu's reject without requeue

    def _settle(self, *delivery_tags: str) -> None:
        """kombu's Redis ack: the messages out of `unacked` in one MULTI/EXEC, here with their
        owner records (`_remove_from_indices`), and when the broker's Redis is the platform's,
        their runs' records (jobs.broker.running.forget) and the metric counts this process's
        runs left to it (jobs.broker.counters.carry())."""
        pipe = self._remove_from_indices(delivery_tags[0])
        for tag in delivery_tags[1:]:
            self._remove_from_indices(tag, pipe)
        settling = len(pipe.command_stack)  # the ack's own commands, before the rest
        ended = self.ended(delivery_tags)
        if ended and self.carries_counts:
            pipe.execute_command("EVAL", running.FORGET, 0, *running.forget_args(ended))
        counts = counters.take() if self.carries_counts else None
        if counts is not None:
            counters.write(pipe, counts)
        try:
            replies = pipe.execute(raise_on_error=False)
        except BaseException:
            if counts is not None:
                counters.give_back(counts)  # nothing ran (the MULTI/EXEC never reached Redis)
            raise
        # A record or a count Redis refused (a key of another type) is that one's loss only:
        # the ack was applied, so nothing is redone. A record left expires (KEEP_MS).
        for reply in replies[settling:]:
            if isinstance(reply, Exception) or (counts is not None and counters.refused(reply)):
                logger.debug("Run records or metric counts not all written with an ack: %s", reply)
        for reply in replies[:settling]:
            if isinstance(reply, Exception):
                raise reply
        if ended and not self.carries_counts:
            forget_elsewhere(ended)

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
        if self._ride_timer is not None:
            self._ride_timer.cancel()
            self._ride_timer = None
        if client is None and self._connection_closed():
            logger.warning(
                "%d message(s) this channel held stay in unacked: its broker connection is "
                "closed; they go back to their queue once its heartbeat lapses",
                len(self._delivered or ()),
            )
            return
        self.settle_riding()
        super().restore_unacked(client)

    def restore_unacked_once(self, stderr: Any = None) -> None:
        """As the channel closes: the successes that hold acknowledgements back are written
        first (HeldAcks.before_restore) and the acknowledgements settled, even when no message
        is left to restore (kombu restores only what it has not seen acknowledged)."""
        if not getattr(self._delivered, "restored", False):
            for write in held_acks.before_restore:
                write()
            self.riding += held_acks.take_released()
            if not self._connection_closed():
                self.settle_riding()
        super().restore_unacked_once(stderr)

    def _connection_closed(self) -> bool:
        """Whether kombu has dropped this channel's connection details (the connection was
        closed): no Redis client can be built for it any more."""
        return getattr(getattr(self.channel, "connection", None), "client", None) is None

    @property
    def open(self) -> bool:
        return not getattr(self.channel, "closed", True)


def ran(message: Any, job_id: str, token: str) -> None:
    """A delivery whose run may keep a record (DEFER_CLAIM, jobs.broker.running): a short
    success's record goes with the message's acknowledgement, which follows its row's write. Until
    then a copy of the message meets the record; after it, Redis holds no copy of the message
    that carries `born` (jobs.broker.restore and kombu's requeue send theirs without)."""
    qos = getattr(getattr(message, "channel", None), "qos", None)
    if isinstance(qos, ReservingQoS):
        qos.runs[message.delivery_tag] = (job_id, token)


def forget_elsewhere(runs: list[tuple[str, str]]) -> None:
    """The records of acknowledged runs, on the platform's Redis when it is not the broker's: a
    record Redis did not drop expires (KEEP_MS)."""
    try:
        running.forget(runs)
    except redis.RedisError as exc:
        logger.debug("Run records left to expire: %s", exc)


def ride_acks(on: bool) -> None:
    """A `-P solo` worker's acknowledgements ride with its next fetch (RIDE_WAIT;
    jobs.broker.fetch.install)."""
    _riding["on"] = on


def carries_counts() -> bool:
    """Whether this process's acknowledgements write the metric counts its runs hold (a
    worker's main process on a Redis broker that is the platform's Redis: -P solo, threads)."""
    return any(isinstance(qos, ReservingQoS) and qos.carries_counts for qos in heartbeat.holders())


def same_redis(one: redis.ConnectionPool, other: redis.ConnectionPool) -> bool:
    """Whether two plain (not Sentinel) connection pools reach the same Redis database."""
    if type(one) is not redis.ConnectionPool or type(other) is not redis.ConnectionPool:
        return False
    fields = ("host", "port", "path", "db", "username", "password")
    mine, theirs = one.connection_kwargs, other.connection_kwargs
    return all(mine.get(f) == theirs.get(f) for f in fields) and issubclass(
        one.connection_class, redis.SSLConnection
    ) == issubclass(other.connection_class, redis.SSLConnection)


def install(*, node: str, app: Any = None) -> str:
    """In a worker's main process, before it consumes (worker_init): record what it
    reserves, with a heartbeat per channel. Returns the worker's id."""
    if not issubclass(kombu_redis.Channel.QoS, ReservingQoS):
        kombu_redis.Channel.QoS = ReservingQoS
    return heartbeat.install(node=node, app=app)
