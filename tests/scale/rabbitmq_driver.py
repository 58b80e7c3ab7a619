"""Client side of the RabbitMQ failover test (tests/scale/test_rabbitmq_failover.py), run as
`python -m tests.scale.rabbitmq_driver CMD JSON` inside a namespace. The settings name the
broker with BROKER_URL (the three nodes, kombu's `;` failover list) and Redis with REDIS_URL.
The job is the Sentinel failover test's (tests/scale/failover_jobs.py); so are the setup of its
tables, the relay, the ping and the wait. Each command prints JSON lines, its result last.
"""

# ruff: noqa: E402 (the models and the jobs import only after django.setup())
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any

import django

django.setup()

from django.db import transaction

from config.celery import app
from jobs import enqueue_many
from jobs.broker import amqp
from jobs.models import DeadLetter, Job
from tests.scale import failover_driver, failover_jobs

emit = failover_driver.emit


def setup(spec: dict[str, Any]) -> dict[str, Any]:
    """Migrate, create the job's tables, and declare Backlot's queues on the broker's first
    node (BROKER_URL's first URL): a quorum queue's leader starts on the node it is declared
    on, and its members are the nodes of the cluster at that moment, all three here."""
    result = failover_driver.setup(spec)
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=3)
        channel = connection.default_channel
        for queue in app.conf.task_queues:
            queue(channel).declare()
        amqp.undeliverable_queue()(channel).declare()
        result["declared_on"] = connection.as_uri()
    return result


def load(spec: dict[str, Any]) -> dict[str, Any]:
    """Accept `jobs` jobs at `rate` a second, 5 at a time (each through enqueue_many in a
    transaction of its own; on RabbitMQ a row is marked published once the broker confirmed
    its message, and one the broker did not take stays in the outbox for the relay). Prints
    the count after each call, and keeps the jobs still unpublished when their call returned:
    those the broker did not take at enqueue. A call that raises must have accepted nothing:
    it is counted, the ledger is read for rows of its jobs all the same (committed although
    the caller was told otherwise), and the same jobs are enqueued again, as a caller would."""
    run, total, rate = spec["run"], spec["jobs"], spec["rate"]
    ids: list[str] = []
    outbox: list[str] = []
    failed: Counter = Counter()
    raised: list[str] = []  # "Type: message" of each call that raised
    committed_anyway: list[str] = []  # ledger rows of the jobs of calls that raised
    slow: list[list[float]] = []  # [at, seconds] of calls that took over a second
    began = time.monotonic()
    item = 0
    while item < total:
        due = began + item / rate
        if due > time.monotonic():
            time.sleep(due - time.monotonic())
        calls = [((), {"run": run, "item": item + i}) for i in range(min(5, total - item))]
        call_began = time.monotonic()
        try:
            with transaction.atomic():
                new = enqueue_many(task=failover_jobs.work, calls=calls)
        except Exception as exc:  # noqa: BLE001 - counted, reported; nothing was accepted
            failed[type(exc).__name__] += 1
            raised.append(f"{type(exc).__name__}: {exc}"[:300])
            items = [kwargs["item"] for _, kwargs in calls]
            committed_anyway += [
                str(job_id)
                for job_id in Job.objects.filter(
                    task_name=failover_jobs.work.name, kwargs__run=run, kwargs__item__in=items
                )
                .exclude(id__in=ids + committed_anyway)
                .values_list("id", flat=True)
            ]
            time.sleep(0.2)
            continue
        took = time.monotonic() - call_began
        ids += new
        outbox += [
            str(job_id)
            for job_id in Job.objects.filter(id__in=new, published_at__isnull=True).values_list(
                "id", flat=True
            )
        ]
        if took > 1:
            slow.append([time.time(), took])
        item += len(calls)
        emit({"accepted": len(ids)})
    return {
        "accepted": len(ids),
        "distinct": len(set(ids)),
        "ids": ids,
        "outbox": outbox,
        "failed": dict(failed),
        "raised": raised,
        "committed_anyway": committed_anyway,
        "slow_calls": slow,
        "seconds": time.monotonic() - began,
    }


def report(spec: dict[str, Any]) -> dict[str, Any]:
    """The failover test's report (ledger, effects and runs per item, finish times, hosts that
    ran jobs after `after`), plus when each job was accepted and when its message was
    confirmed, and the dead letters of these jobs."""
    result = failover_driver.report(spec)
    rows = Job.objects.filter(task_name="failover.work")
    result["enqueued"] = {
        str(job_id): at.timestamp() for job_id, at in rows.values_list("id", "enqueued_at")
    }
    result["published"] = {
        str(job_id): at.timestamp()
        for job_id, at in rows.values_list("id", "published_at")
        if at is not None
    }
    result["dead_letters"] = DeadLetter.objects.filter(task_name="failover.work").count()
    return result


COMMANDS = {
    "setup": setup,
    "ping": failover_driver.ping,
    "load": load,
    "relay": failover_driver.relay,
    "wait": failover_driver.wait,
    "report": report,
}

if __name__ == "__main__":
    emit(COMMANDS[sys.argv[1]](json.loads(sys.argv[2])))
