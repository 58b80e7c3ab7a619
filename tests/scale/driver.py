"""Client side of the scale test, run as `python -m tests.scale.driver CMD JSON` inside the
services namespace (`ip netns exec`), where Redis and PostgreSQL listen; the pytest process
lives in the machine's own namespace and cannot reach them. Each command prints one JSON line.
"""

# ruff: noqa: E402 (the models and the jobs import only after django.setup())
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import django

django.setup()

from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Count, Max, Min, Sum

from config.celery import app
from jobs import enqueue_many
from jobs.models import Job, JobState
from tests.scale import jobs as scale_jobs

# One transaction and one publish round per this many jobs, as a campaign fan-out does.
BATCH = 500


def setup(spec: dict[str, Any]) -> dict[str, Any]:
    """Migrate the fresh database and create the marks table."""
    began = time.monotonic()
    call_command("migrate", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE {scale_jobs.MARKS_TABLE} (id bigserial PRIMARY KEY, kind text NOT NULL,"
            " run text NOT NULL, item integer NOT NULL, host text NOT NULL, pid integer NOT NULL,"
            " at double precision NOT NULL)"
        )
    return {"seconds": time.monotonic() - began}


def ping(spec: dict[str, Any]) -> dict[str, Any]:
    """Wait until every named worker answers a control ping (over the shared Redis)."""
    names = set(spec["names"])
    deadline = time.monotonic() + spec["within"]
    answered: set[str] = set()
    while answered != names:
        replies = app.control.ping(destination=sorted(names - answered), timeout=0.5) or []
        for reply in replies:
            answered |= set(reply) & names
        if answered != names and time.monotonic() > deadline:
            raise SystemExit(f"workers did not answer: {sorted(names - answered)}")
    return {"answered": sorted(answered)}


def enqueue(spec: dict[str, Any]) -> dict[str, Any]:
    """The rate-limited jobs first, then the others, through job_enqueue_many (ledger rows in
    one transaction per batch, published after commit)."""
    began = time.monotonic()
    ids: list[str] = []
    for task, count in ((scale_jobs.limited, spec["limited"]), (scale_jobs.work, spec["work"])):
        for at in range(0, count, BATCH):
            calls = [
                ((), {"run": spec["run"], "item": i}) for i in range(at, min(count, at + BATCH))
            ]
            with transaction.atomic():
                ids += enqueue_many(task=task, calls=calls)
    return {"jobs": len(ids), "distinct": len(set(ids)), "seconds": time.monotonic() - began}


def states() -> Counter:
    rows = Job.objects.filter(task_name__startswith="scale.").values_list("state")
    return Counter(dict(rows.annotate(n=Count("id"))))


def wait(spec: dict[str, Any]) -> dict[str, Any]:
    """Poll the ledger until `total` jobs succeeded or are dead, at most `within` seconds."""
    return wait_for(states, spec)


def wait_for(count: Callable[[], Counter], spec: dict[str, Any]) -> dict[str, Any]:
    """Poll `count()` (jobs per ledger state) until `total` jobs succeeded or are dead, at most
    `within` seconds (the failover driver's wait too)."""
    began = time.monotonic()
    while True:
        counts = count()
        finished = counts[JobState.SUCCEEDED] + counts[JobState.DEAD]
        if finished >= spec["total"]:
            break
        if time.monotonic() - began > spec["within"]:
            raise SystemExit(f"timed out after {spec['within']}s; ledger states: {dict(counts)}")
        time.sleep(0.5)  # polling interval of a bounded wait
    return {"seconds": time.monotonic() - began, "states": dict(counts)}


def report(spec: dict[str, Any]) -> dict[str, Any]:
    """What the test checks: the ledger, and the marks per kind and per host."""
    ledger = Job.objects.filter(task_name__startswith="scale.").aggregate(
        attempts=Sum("attempts"),
        deliveries=Sum("deliveries"),
        first_enqueued=Min("enqueued_at"),
        last_finished=Max("finished_at"),
    )
    kinds: dict[str, Any] = {}
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT kind, host, count(*) FROM {scale_jobs.MARKS_TABLE} WHERE run = %s"
            " GROUP BY kind, host",
            [spec["run"]],
        )
        for kind, host, n in cursor.fetchall():
            kinds.setdefault(kind, {"hosts": {}})["hosts"][host] = n
        cursor.execute(
            f"SELECT kind, item, count(*) FROM {scale_jobs.MARKS_TABLE} WHERE run = %s"
            " GROUP BY kind, item",
            [spec["run"]],
        )
        for kind, item, n in cursor.fetchall():
            entry = kinds.setdefault(kind, {"hosts": {}})
            entry.setdefault("items", {})[item] = n
        cursor.execute(
            f"SELECT at, host FROM {scale_jobs.MARKS_TABLE} WHERE run = %s AND kind = 'limited'"
            " ORDER BY at",
            [spec["run"]],
        )
        limited_starts = cursor.fetchall()
    for kind, expected in spec["expected"].items():
        entry = kinds.setdefault(kind, {"hosts": {}})
        items = entry.pop("items", {})
        missing = sorted(set(range(expected)) - set(items))
        entry["rows"] = sum(items.values())
        entry["distinct"] = len(items)
        entry["missing"] = len(missing)
        entry["missing_sample"] = missing[:20]
        entry["duplicated"] = sorted(item for item, n in items.items() if n > 1)[:20]
    span = None
    if ledger["first_enqueued"] and ledger["last_finished"]:
        span = (ledger["last_finished"] - ledger["first_enqueued"]).total_seconds()
    return {
        "states": dict(states()),
        "attempts": ledger["attempts"],
        "deliveries": ledger["deliveries"],
        "ledger_span": span,
        "kinds": kinds,
        "limited_starts": limited_starts,
    }


COMMANDS = {"setup": setup, "ping": ping, "enqueue": enqueue, "wait": wait, "report": report}

if __name__ == "__main__":
    print(json.dumps(COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))), flush=True)
