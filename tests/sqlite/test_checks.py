"""`manage.py check` says when SQLite is past what it is for (one host, a small load) and how to
move to PostgreSQL: DATABASE_URL, then migrate."""

from __future__ import annotations

import subprocess
import sys
import time

from jobs.web.checks import SQLITE_MAX_JOBS_PER_HOUR
from jobs.worker.telemetry import finished_minute_key
from tests.conftest import ROOT
from tests.sqlite.conftest import SQLiteSite


def check(site: SQLiteSite, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env={**site.env, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # a warning, not an error
    return done.stdout + done.stderr


def test_sqlite_on_one_host_in_development_passes(site: SQLiteSite):
    assert "jobs.W006" not in check(site, DEBUG="1")


def test_sqlite_in_production_or_on_two_hosts_warns_with_the_way_to_postgresql(site: SQLiteSite):
    # DEBUG off: a production deployment
    out = check(site, DEBUG="0", SECRET_KEY="x" * 50)
    assert "jobs.W006" in out and "DEBUG is off" in out, out
    assert "DATABASE_URL=postgres://" in out and "manage.py migrate" in out

    # a worker on another host answers beside the suite's two (node name host@elsewhere)
    other = site.start_worker("sqlite-remote@elsewhere")
    try:
        out = check(site, DEBUG="1")
    finally:
        other.stop()
    assert "jobs.W006" in out and "workers on 2 hosts" in out, out


def test_sqlite_past_its_jobs_an_hour_warns_from_the_minute_counts(site: SQLiteSite):
    # given: more jobs finished in this minute than SQLite serves in an hour, as the workers
    # count them in Redis (jobs_job is not read by finished_at: it has no index there)
    key = finished_minute_key(time.time())
    site.redis.hincrby(key, "default\tsucceeded", SQLITE_MAX_JOBS_PER_HOUR)
    site.redis.hincrby(key, "default\tdead", 1)
    site.redis.hincrby(key, "default\tretrying", 5000)  # an attempt, not a finished job
    try:
        out = check(site, DEBUG="1")
    finally:
        site.redis.delete(key)
    assert "jobs.W006" in out and f"{SQLITE_MAX_JOBS_PER_HOUR + 1} jobs finished" in out, out
