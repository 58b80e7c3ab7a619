"""A host on Django's stock SQLite settings (no OPTIONS): Backlot sets WAL, a busy timeout and
IMMEDIATE transactions on each connection (jobs.ledger.sqlite), so a replay or an enqueue that
meets another process's writes waits and succeeds instead of "database is locked"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis
from django.conf import settings

from tests.conftest import ROOT

DEAD_LETTERS, ENQUEUES = 20, 50


def redis_url() -> str:
    """The test Redis, on a database number nothing consumes (the messages only sit there)."""
    return urlunsplit(urlsplit(settings.REDIS_URL)._replace(path="/12"))


def host(path: Path, mode: str, count: float, control: bool = False) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "tests.jobs.ledger.stock_sqlite_host", str(path), redis_url(),
         mode, str(count)],
        cwd=ROOT,
        env={**os.environ, "STOCK_SQLITE_CONTROL": "1" if control else "0"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def replay_while_another_process_writes(path: Path, control: bool) -> dict:
    host(path, "prepare", DEAD_LETTERS, control=control)
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.jobs.ledger.stock_sqlite_host", str(path), redis_url(),
         "write", "120"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert writer.stdout is not None
        assert json.loads(writer.stdout.readline()) == {"writing": True}
        return host(path, "replay", ENQUEUES, control=control)
    finally:
        writer.terminate()
        writer.wait(timeout=20)
        redis.Redis.from_url(redis_url()).flushdb()


def test_a_stock_sqlite_connection_gets_wal_a_busy_timeout_and_immediate(tmp_path):
    seen = host(tmp_path / "db.sqlite3", "settings", 0)

    assert seen == {"journal_mode": "wal", "busy_timeout": 20000, "tx": "IMMEDIATE"}


def test_replay_and_enqueue_on_a_busy_stock_sqlite_wait_and_succeed(tmp_path):
    # given: Django's stock connection, as a comparison: the fault is real
    stock = replay_while_another_process_writes(tmp_path / "stock.sqlite3", control=True)
    assert stock["errors"] and all("database is locked" in e for e in stock["errors"])

    # when: the same with Backlot's connection settings
    done = replay_while_another_process_writes(tmp_path / "backlot.sqlite3", control=False)

    # then: every replay and every enqueue succeeded, none met "database is locked"
    assert done["errors"] == []
    assert (done["replayed"], done["enqueued"]) == (DEAD_LETTERS, ENQUEUES)
