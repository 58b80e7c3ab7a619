"""Client side of the failover test (tests/scale/test_failover.py), run as
`python -m tests.scale.failover_driver CMD JSON` inside the services namespace. The settings
name the Sentinels (REDIS_SENTINELS, REDIS_SENTINEL_MASTER), so every Redis call here goes to
whichever server they name the primary. Each command prints JSON lines, its result last.
"""

# ruff: noqa: E402 (the models and the jobs import only after django.setup())
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import django

django.setup()

from django.core.management import call_command
from django.db import connection, transaction
from django.db.models import Count, Sum

from jobs import enqueue_many
from jobs.broker import queues, reservations
from jobs.broker.redis import redis_client
from jobs.enqueue.submit import enqueue as enqueue_one
from jobs.flow.relay import LEASE_LAPSES, MISSING_RESENT
from jobs.models import Job, JobState
from jobs.worker.lease import FENCING
from tests.scale import driver, failover_jobs
from tests.scale.driver import ping

QUEUE = "default"


def emit(data: dict[str, Any]) -> None:
    print(json.dumps(data), flush=True)


def setup(spec: dict[str, Any]) -> dict[str, Any]:
    began = time.monotonic()
    call_command("migrate", verbosity=0, interactive=False)
    with connection.cursor() as cursor:
        for table in (failover_jobs.RUNS_TABLE, failover_jobs.MARKS_TABLE):
            cursor.execute(
                f"CREATE TABLE {table} (id bigserial PRIMARY KEY, run text NOT NULL,"
                " item integer NOT NULL, host text NOT NULL, pid integer NOT NULL,"
                " at double precision NOT NULL)"
            )
    return {"seconds": time.monotonic() - began}


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """Accept `jobs` jobs at `rate` a second, in batches of 5 (each through enqueue_many in a
    transaction of its own, published after commit), printing the count after each batch. When
    the file `burst_file` appears, `burst` jobs due in `burst_delay` s are accepted at once
    (countdown messages: a worker holds them in `unacked` until due), then "burst" is printed.
    A call that fails accepts nothing and is not counted; one that returns accepted its jobs,
    whatever Redis did (the relay publishes what the broker did not take)."""
    run, total, rate = spec["run"], spec["jobs"], spec["rate"]
    burst_file = Path(spec["burst_file"])
    ids: list[str] = []
    failed: Counter = Counter()
    began = time.monotonic()
    item, steady, burst_done = 0, 0, False
    while steady < total or not burst_done:
        if not burst_done and burst_file.exists():
            burst_began = time.monotonic()
            for _ in range(spec["burst"]):
                handle = enqueue_one(
                    task=failover_jobs.work,
                    kwargs={"run": run, "item": item},
                    delay=spec["burst_delay"],
                )
                ids.append(str(handle.id))
                item += 1
            burst_done = True
            emit({"accepted": len(ids), "burst": time.monotonic() - burst_began})
            continue
        if steady >= total:
            time.sleep(0.05)  # the steady load is done; waiting for the burst signal
            continue
        due = began + steady / rate
        if due > time.monotonic():
            time.sleep(due - time.monotonic())
        calls = [((), {"run": run, "item": item + i}) for i in range(min(5, total - steady))]
        try:
            with transaction.atomic():
                ids += enqueue_many(task=failover_jobs.work, calls=calls)
        except Exception as exc:  # noqa: BLE001 - counted, reported; nothing was accepted
            failed[type(exc).__name__] += 1
            time.sleep(0.2)
            continue
        item += len(calls)
        steady += len(calls)
        emit({"accepted": len(ids)})
    return {
        "accepted": len(ids),
        "distinct": len(set(ids)),
        "ids": ids,
        "failed": dict(failed),
        "seconds": time.monotonic() - began,
    }


def relay(spec: dict[str, Any]) -> dict[str, Any]:
    """`manage.py jobs relay` with the test's job registered (the workers import it with -I;
    the relay process loads only the project's own task modules)."""
    call_command("jobs", "relay")
    return {}


def missing(spec: dict[str, Any]) -> dict[str, Any]:
    """Right after the promotion: the accepted, published jobs not finished whose message the
    new primary does not hold (in no list of the queue, in no worker's `unacked`): the
    messages the replica never received."""
    waiting = {
        str(job_id)
        for job_id in Job.objects.filter(
            task_name="failover.work",
            state__in=(JobState.QUEUED, JobState.SCHEDULED),
            published_at__isnull=False,
        ).values_list("id", flat=True)
    }
    held = queues.held_job_ids(QUEUE)
    if held is None:
        raise SystemExit("the new primary could not be read")
    return {"waiting": len(waiting), "held": len(held), "missing": sorted(waiting - held)}


def states() -> Counter:
    rows = Job.objects.filter(task_name="failover.work").values_list("state")
    return Counter(dict(rows.annotate(n=Count("id"))))


def wait(spec: dict[str, Any]) -> dict[str, Any]:
    """Poll the ledger until `total` jobs succeeded or are dead, at most `within` seconds."""
    return driver.wait_for(states, spec)


def _per_item(table: str, run: str) -> dict[int, int]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT item, count(*) FROM {table} WHERE run = %s GROUP BY item", [run])
        return dict(cursor.fetchall())


def _counter(key: str) -> int:
    return int(redis_client().get(key) or 0)


def report(spec: dict[str, Any]) -> dict[str, Any]:
    """The ledger, the effects and runs per item, when the jobs found missing finished, and
    the platform's recovery counters (read from the new primary)."""
    rows = Job.objects.filter(task_name="failover.work")
    ledger = rows.aggregate(attempts=Sum("attempts"), deliveries=Sum("deliveries"))
    finished = {
        str(job_id): at.timestamp()
        for job_id, at in rows.values_list("id", "finished_at")
        if at is not None
    }
    item_of = {str(job_id): kwargs["item"] for job_id, kwargs in rows.values_list("id", "kwargs")}
    dead = list(rows.filter(state=JobState.DEAD).values_list("id", "error")[:20])
    fencing = redis_client().hgetall(FENCING)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT host, count(*) FROM {failover_jobs.RUNS_TABLE} WHERE run = %s AND at > %s"
            " GROUP BY host",
            [spec["run"], spec["after"]],
        )
        hosts_after = dict(cursor.fetchall())
    return {
        "states": dict(states()),
        "ids": sorted(item_of),
        "item_of": item_of,
        "finished": finished,
        "attempts": ledger["attempts"],
        "deliveries": ledger["deliveries"],
        "marks": _per_item(failover_jobs.MARKS_TABLE, spec["run"]),
        "runs": _per_item(failover_jobs.RUNS_TABLE, spec["run"]),
        "hosts_after_promotion": hosts_after,
        "dead": [[str(job_id), str(error)[:300]] for job_id, error in dead],
        "counters": {
            "missing_resent": _counter(MISSING_RESENT),
            "lease_lapses": _counter(LEASE_LAPSES),
            "reservations_restored": _counter(reservations.RESTORED),
            "reservations_dropped": _counter(reservations.DROPPED),
            "fencing": {k.decode(): int(v) for k, v in fencing.items()},  # type: ignore[union-attr]
        },
    }


COMMANDS = {
    "setup": setup,
    "ping": ping,
    "load": load,
    "relay": relay,
    "missing": missing,
    "wait": wait,
    "report": report,
}

if __name__ == "__main__":
    emit(COMMANDS[sys.argv[1]](json.loads(sys.argv[2])))
