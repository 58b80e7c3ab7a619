"""What the ledger's writers need of a SQLite connection, set on each one when it is created.

Every process of the platform (web, workers, beat, the relay) writes the one SQLite file, and
SQLite has one write lock. With Django's stock SQLite settings (every `startproject`) a second
writer fails at once with "database is locked": a transaction starts DEFERRED, reads, and its
first write cannot upgrade while another holds the lock (SQLite refuses rather than wait), and
readers block the writer without WAL. So, unless the project's OPTIONS say otherwise:

- ``PRAGMA journal_mode=WAL``: readers and the writer no longer block each other (persistent in
  the file; asking again is a no-op);
- ``PRAGMA busy_timeout``: a write waits up to BUSY_TIMEOUT_MS for the lock (Python's
  default is 5 s; the reference project's SQLITE_TIMEOUT is 20 s);
- ``transaction_mode = "IMMEDIATE"`` (Django >= 5.1's OPTIONS): the lock is taken at BEGIN,
  where the busy timeout applies, so a transaction waits there instead of failing mid-way.

A project that set ``OPTIONS["transaction_mode"]`` or ``OPTIONS["timeout"]`` keeps its own; an
in-memory database is left alone (one connection, no other writer). PostgreSQL is untouched.
"""

from __future__ import annotations

from typing import Any

from django.db.backends.signals import connection_created

# Milliseconds a write waits for SQLite's lock: the reference project's 20 s.
BUSY_TIMEOUT_MS = 20_000


def configure_connection(sender: Any = None, connection: Any = None, **kwargs: Any) -> None:
    """connection_created: WAL, the busy timeout and IMMEDIATE transactions on a SQLite file."""
    if connection is None or connection.vendor != "sqlite" or connection.is_in_memory_db():
        return
    options = connection.settings_dict.get("OPTIONS") or {}
    raw = connection.connection  # the sqlite3 connection, in autocommit (Django's)
    if str(raw.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        raw.execute("PRAGMA journal_mode=WAL")
    if "timeout" not in options:
        raw.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    if "transaction_mode" not in options and connection.transaction_mode is None:
        connection.transaction_mode = "IMMEDIATE"


def connect() -> None:
    """Set it on every connection created from now on (jobs.apps)."""
    connection_created.connect(configure_connection, dispatch_uid="backlot-sqlite-connection")
