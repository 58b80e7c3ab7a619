"""Client-side processes of the fault suite, run as `python -m tests.system.faults.driver CMD`.

The pytest process's Celery app is bound to the shared test Redis, so everything that talks
to a test's private Redis (enqueue, relay) runs here, in a subprocess whose REDIS_URL is the
private one. Each command prints one JSON line with what it did.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import django

django.setup()

from django.db import close_old_connections, transaction  # noqa: E402 (after django.setup())

from jobs import enqueue_many  # noqa: E402 (after django.setup())
from jobs.flow.cancellation import cancel  # noqa: E402 (after django.setup())
from jobs.flow.relay import job_relay  # noqa: E402 (after django.setup())
from jobs.worker.task import PlatformTask  # noqa: E402 (after django.setup())
from tests.system.faults import jobs as fault_jobs  # noqa: E402 (after django.setup())

TASKS: dict[str, PlatformTask[Any, Any]] = {
    "effect": fault_jobs.effect,
    "slow": fault_jobs.slow,
    "poison": fault_jobs.poison,
    "flaky": fault_jobs.flaky,
    "soft_stop": fault_jobs.soft_stop,
    "stubborn": fault_jobs.stubborn,
    "quick": fault_jobs.quick,
}


def enqueue(spec: dict) -> dict:
    """One task.enqueue() per job (the API's path), each timed; or job_enqueue_many batches."""
    task = TASKS[spec["task"]]
    items: Sequence[int] = range(spec["start"], spec["start"] + spec["count"])
    extra = spec.get("kwargs", {})
    ids: list[str] = []
    slowest = 0.0
    began = time.monotonic()
    if spec.get("many"):
        batch = spec.get("batch", 1000)
        items = list(items)
        for at in range(0, len(items), batch):
            with transaction.atomic():
                ids += enqueue_many(
                    task=task,
                    calls=[
                        ((), {"run": spec["run"], "item": i, **extra})
                        for i in items[at : at + batch]
                    ],
                )
    else:
        pace = spec.get("pace", 0.0)
        for item in items:
            start = time.monotonic()
            ids.append(task.enqueue(run=spec["run"], item=item, **extra).id)
            slowest = max(slowest, time.monotonic() - start)
            if pace:
                time.sleep(pace)  # pacing of a deliberate load loop
    return {"ids": ids, "slowest": slowest, "seconds": time.monotonic() - began}


def feed(spec: dict) -> dict:
    """A sustained producer: enqueue `count` jobs in batches, keeping at most `cap` messages
    waiting in Redis, like a steady stream of API calls rather than one huge backlog."""
    from jobs.broker.redis import redis_client

    task = TASKS[spec["task"]]
    broker = redis_client()
    lists = ["default"] + [f"default:{level}" for level in range(1, 10)]
    ids: list[str] = []
    batch, extra = spec.get("batch", 250), spec.get("kwargs", {})
    began = time.monotonic()
    item = spec.get("start", 0)
    end = item + spec["count"]
    while item < end:
        try:
            depth = sum(broker.llen(name) for name in lists)
        except Exception:  # noqa: BLE001 (Redis away for a moment: the outbox takes the jobs anyway)
            depth = 0
        if depth >= spec.get("cap", 2000):
            time.sleep(0.2)  # pacing of the load loop
            continue
        upto = min(end, item + batch)
        with transaction.atomic():
            ids += enqueue_many(
                task=task,
                calls=[((), {"run": spec["run"], "item": i, **extra}) for i in range(item, upto)],
            )
        item = upto
    return {"ids": ids, "seconds": time.monotonic() - began}


def die_between_commit_and_publish(spec: dict) -> None:
    """Enqueue `count` jobs in one transaction and die right after COMMIT, once the first
    `published` of them ran their publish hook: on_commit hooks run in registration order,
    so a hook registered after the n-th enqueue runs after the n-th publish and before the rest."""
    task = TASKS[spec["task"]]
    with transaction.atomic():
        for n, item in enumerate(range(spec["start"], spec["start"] + spec["count"])):
            if n == spec["published"]:
                transaction.on_commit(lambda: os._exit(17))
            task.enqueue(run=spec["run"], item=item)
        if spec["published"] >= spec["count"]:
            transaction.on_commit(lambda: os._exit(17))
    raise SystemExit("unreachable: the on-commit hook exits the process")


def relay_loop(spec: dict) -> None:
    """What beat's relay schedule does, every `interval` seconds, until SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    sent = errors = 0
    while not stop:
        try:
            sent += job_relay(limit=spec.get("limit", 5000))
        except Exception as exc:  # noqa: BLE001 (a database outage: keep looping, like beat)
            errors += 1
            print(f"relay error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            close_old_connections()
        time.sleep(spec.get("interval", 1.0))
    print(json.dumps({"sent": sent, "errors": errors}), flush=True)


def cancel_job(spec: dict) -> dict:
    """Cancel a job as an application would (this process's settings: DEFER_CLAIM's records)."""
    return {"state": str(cancel(spec["job_id"]).state)}


COMMANDS = {
    "enqueue": enqueue,
    "cancel": cancel_job,
    "feed": feed,
    "die": die_between_commit_and_publish,
    "relay": relay_loop,
}

if __name__ == "__main__":
    result = COMMANDS[sys.argv[1]](json.loads(sys.argv[2]))
    if result is not None:
        print(json.dumps(result), flush=True)
