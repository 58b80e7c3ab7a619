"""A host with Django's stock SQLite settings (what `startproject` writes: ENGINE and NAME, no
OPTIONS) and Backlot installed, as a process of its own: `python -m
tests.jobs.ledger.stock_sqlite_host <file> <redis url> settings|prepare|replay|write <n>`.

settings: prints the connection's journal mode, busy timeout and transaction mode (JSON).
prepare: migrates and makes <n> dead letters (a job that always fails, run here).
replay: replays every dead letter and enqueues <n> jobs, each in its own transaction, counting
what failed (JSON). write: writes a row in its own IMMEDIATE transaction every few ms for <n>
seconds, through plain sqlite3 (another process holding SQLite's one write lock).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time

import django
from django.conf import settings

FILE, REDIS_URL, MODE, COUNT = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])

if MODE == "write":
    writer = sqlite3.connect(FILE, timeout=30, isolation_level=None)
    writer.execute("CREATE TABLE IF NOT EXISTS other_writes (at REAL)")
    ends = time.monotonic() + COUNT
    print(json.dumps({"writing": True}), flush=True)
    while time.monotonic() < ends:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("INSERT INTO other_writes VALUES (?)", (time.time(),))
        time.sleep(0.003)  # the lock held 3 ms, then free 2 ms: "a write every few ms"
        writer.execute("COMMIT")
        time.sleep(0.002)
    sys.exit(0)

settings.configure(
    DEBUG=False,
    SECRET_KEY="stock-sqlite-host",
    INSTALLED_APPS=[
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "django_celery_results",
        "django_celery_beat",
        "jobs",
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": FILE}},
    USE_TZ=True,
    BACKLOT={"REDIS_URL": REDIS_URL},
)
django.setup()
if os.environ.get("STOCK_SQLITE_CONTROL") == "1":  # Django's stock connection, for comparison
    from django.db.backends.signals import connection_created

    connection_created.disconnect(dispatch_uid="backlot-sqlite-connection")

from celery import Celery  # noqa: E402 (after django.setup())

import jobs.worker.celery  # noqa: E402

app = Celery("stock")
app.config_from_object("django.conf:settings", namespace="CELERY")
jobs.worker.celery.configure(app)

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from jobs import Permanent, dead_letter_replay, job  # noqa: E402
from jobs.models import DeadLetter  # noqa: E402
from jobs.testing import run_job  # noqa: E402


@job(name="stock.fails")
def fails(n: int) -> None:
    raise Permanent(f"fails {n}")


if MODE == "settings":
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        mode = cursor.fetchone()[0]
        cursor.execute("PRAGMA busy_timeout")
        busy = cursor.fetchone()[0]
    seen = {
        "journal_mode": mode,
        "busy_timeout": busy,
        "tx": getattr(connection, "transaction_mode", None),
    }
    print(json.dumps(seen))
elif MODE == "prepare":
    call_command("migrate", verbosity=0)
    for n in range(int(COUNT)):
        run_job(fails.enqueue(n))
    print(json.dumps({"dead_letters": DeadLetter.objects.count()}))
elif MODE == "replay":
    errors: list[str] = []
    replayed = enqueued = 0
    began = time.monotonic()
    for letter in list(DeadLetter.objects.all()):
        try:
            with transaction.atomic():
                dead_letter_replay(dead_letter=DeadLetter.objects.get(pk=letter.pk))
            replayed += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported, the test reads them
            errors.append(f"replay: {type(exc).__name__}: {exc}")
    for n in range(int(COUNT)):
        try:
            with transaction.atomic():
                DeadLetter.objects.exists()  # a read first: a DEFERRED transaction's trap
                fails.enqueue(n)
            enqueued += 1
        except Exception as exc:  # noqa: BLE001 - counted and reported, the test reads them
            errors.append(f"enqueue: {type(exc).__name__}: {exc}")
    took = time.monotonic() - began
    print(json.dumps({"replayed": replayed, "enqueued": enqueued, "errors": errors, "s": took}))
