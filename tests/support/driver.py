"""What the suites' driver processes share (tests.sqlite.driver, tests.amqp.driver): a process
bound to a site's own database, broker and Redis, which the pytest process (bound to the test
database and the shared Redis) drives one JSON command per line on stdin, answered one JSON
line on stdout: {"cmd": "enqueue", "task": "tests.add", "args": [...], "kwargs": {...},
"options": {...}}.

Imported after django.setup() (the driver's settings come from its environment): the common
commands below, and `serve`, the loop that runs a driver's commands.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from django.db import connection, transaction

from jobs import cancel, dead_letter_replay, enqueue_many
from jobs.flow.relay import job_relay
from jobs.models import DeadLetter, Job
from jobs.worker.registry import task_by_name
from tests.support import tasks as _tasks  # noqa: F401 (registers the test jobs)

Command = Callable[..., dict[str, Any]]


def _row(job: Job) -> dict[str, Any]:
    return {
        "id": str(job.id),
        "task": job.task_name,
        "state": job.state,
        "attempts": job.attempts,
        "deliveries": job.deliveries,
        "crashes": job.crashes,
        "error": job.error,
        "published": job.published_at is not None,
        "replay_of": job.replay_of_id,
        "result": job.result,
    }


def enqueue(task: str, args: list, kwargs: dict, options: dict) -> dict[str, Any]:
    handle = task_by_name(task).using(**options).enqueue(*args, **kwargs)
    return {"id": handle.id}


def enqueue_many_(task: str, calls: list) -> dict[str, Any]:
    with transaction.atomic():
        ids = enqueue_many(task_by_name(task), [(a, k) for a, k in calls])
    return {"ids": ids}


def jobs(ids: list[str]) -> dict[str, Any]:
    rows = {str(j.id): _row(j) for j in Job.objects.filter(id__in=ids)}
    return {"jobs": [rows.get(i) for i in ids]}


def dead_letters(ids: list[str]) -> dict[str, Any]:
    return {
        "dead_letters": [
            {
                "id": d.pk,
                "job_id": str(d.job_id_value),
                "exception": d.exception_class,
                "message": d.exception_message,
            }
            for d in DeadLetter.objects.filter(job_id_value__in=ids)
        ]
    }


def replay(dead_letter_id: int) -> dict[str, Any]:
    handle = dead_letter_replay(dead_letter=DeadLetter.objects.get(pk=dead_letter_id))
    return {"id": handle.id}


def cancel_(job_id: str) -> dict[str, Any]:
    done = cancel(job_id)
    return {"state": done.state, "cancelled": done.cancelled, "requested": done.requested}


def relay() -> dict[str, Any]:
    return {"sent": job_relay()}


COMMANDS: dict[str, Command] = {
    "enqueue": enqueue,
    "enqueue_many": enqueue_many_,
    "jobs": jobs,
    "dead_letters": dead_letters,
    "replay": replay,
    "cancel": cancel_,
    "relay": relay,
}


def serve(commands: Mapping[str, Command]) -> None:
    """Answer the commands read on stdin until it closes; a command that raises is answered
    with its error and traceback, and the driver goes on."""
    for line in sys.stdin:
        request = json.loads(line)
        handler = commands[request.pop("cmd")]
        try:
            answer: dict[str, Any] = {"ok": handler(**request)}
        except Exception as exc:  # noqa: BLE001 - the test reads the failure
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            connection.close()  # no connection (or read snapshot) held between commands
        sys.stdout.write(json.dumps(answer, default=str) + "\n")
        sys.stdout.flush()
