"""Writes to Redis whose replies the writer does not wait for.

Each Unanswered is one connection of its own (made from a pool, never handed back to it), on
which commands are sent and their replies counted; the replies that have arrived are read at the
next sends (or when the owner asks: the worker's event loop on a timer), all of them once MOST
are pending or the process ends. The caller waits for no round trip: ~0.1 ms of a single
enqueue's 0.7 (measured: most of a round trip to a local Redis is the two context switches,
not Redis's work).

What that gives up: a reply is an error, or the connection drops, after the caller went on.
The users below are those for whom that is covered elsewhere:
- a ledger-on enqueue's message (jobs.broker.broker.publish, `answered=False`): its row is
  already marked published, and a message Redis refused or lost is found missing by the
  relay's reconcile and sent again (jobs.flow.relay, MISSING_AFTER), as one lost with its
  process between the commit and the send; a send that fails is still the caller's error
  (the row goes back to the outbox);
- the worker's marks on run records (jobs.broker.reservations): a mark not made leaves the
  record as it was, which the record's readers handle.

No health check's PING on these connections (its PONG would be read among the replies). A
forked child does not use its parent's connection (its own is made on its first send). Per
thread: `for_thread(pool)`."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import redis

logger = logging.getLogger(__name__)

# A send reads the replies that have arrived once this many are pending (a look at the socket
# per send cost a select() each), and waits for all of them at MOST: a bound on what an error
# reported late may concern, and on the replies a Redis that stopped answering leaves unread.
READ_AT = 30
MOST = 300


class Unanswered:
    """One connection's writes whose replies are read later (see the module's doc)."""

    def __init__(self, pool: Callable[[], Any], what: str, refused_level: int = logging.WARNING):
        self._pool = pool  # the connection pool to make the connection from, when one is needed
        self._what = what  # what the writes are, for the log lines
        self._refused_level = refused_level
        self._connection: Any = None
        self._pid = os.getpid()
        self.pending = 0  # replies not read yet

    def send_packed(self, packed: bytes, replies: int) -> None:
        """Send `packed` (commands packed by hiredis, `replies` replies); raises the connection's
        error when the send fails (what reached Redis of it is not known)."""
        if self.pending >= READ_AT:
            self.read(wait=self.pending >= MOST)
        if self._connection is None or self._pid != os.getpid():
            self._connection, self._pid, self.pending = (
                self._pool().make_connection(),
                os.getpid(),
                0,
            )
        try:
            self._connection.send_packed_command([packed], check_health=False)
        except BaseException:
            self._drop()
            raise
        self.pending += replies

    def read(self, *, wait: bool = False) -> None:
        """Read the replies that have arrived, or (`wait`) all of them; errors are logged."""
        if self._connection is None or self._pid != os.getpid():
            return
        try:
            while self.pending and (wait or self._connection.can_read(timeout=0)):
                self.pending -= 1
                try:
                    self._connection.read_response()
                except redis.ResponseError as exc:
                    logger.log(self._refused_level, "Redis refused %s: %s", self._what, exc)
        except (redis.RedisError, OSError) as exc:
            logger.log(
                self._refused_level,
                "%d repl(ies) to %s not read, the connection is dropped: %s",
                self.pending + 1,
                self._what,
                exc,
            )
            self._drop()

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.disconnect()
        self._connection, self.pending = None, 0


_local = threading.local()
# Each thread's writers, read by the last flush (atexit, or a pool process's shutdown).
_writers: weakref.WeakSet[Unanswered] = weakref.WeakSet()
_writers_lock = threading.Lock()


def for_thread(pool: Any, what: str) -> Unanswered:
    """This thread's writer on `pool` (a redis-py connection pool)."""
    writers: dict[int, Unanswered] | None = getattr(_local, "writers", None)
    if writers is None:
        writers = _local.writers = {}
    writer = writers.get(id(pool))
    if writer is None:
        writer = writers[id(pool)] = Unanswered(lambda: pool, what)
        with _writers_lock:
            _writers.add(writer)
    return writer


def flush() -> None:
    """Read every pending reply of this process's writers (at exit: a connection closed with
    replies unread is reset, and a command Redis had not read yet could be lost with it)."""
    with _writers_lock:
        writers = list(_writers)
    for writer in writers:
        if writer.pending:
            writer.read(wait=True)


def _forked() -> None:
    _local.__dict__.clear()
    _writers.clear()


os.register_at_fork(after_in_child=_forked)
atexit.register(flush)
