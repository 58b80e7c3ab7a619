"""The test's hands on the SQLite database: `python -m tests.sqlite.driver`, a process whose
DATABASE_URL is the suite's SQLite file and REDIS_URL its private Redis (the pytest process
itself is bound to the PostgreSQL test database and the shared Redis).

Reads one JSON command per line on stdin, answers one JSON line on stdout:
{"cmd": "enqueue", "task": "tests.add", "args": [...], "kwargs": {...}, "options": {...}}.
"""

from __future__ import annotations

import json
import sys
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import django

django.setup()

from django.db import connection, transaction  # noqa: E402 (after django.setup())
from django.utils import timezone  # noqa: E402 (after django.setup())

from jobs import cancel, dead_letter_replay, enqueue_many, ledger, signal  # noqa: E402
from jobs.flow.relay import job_relay  # noqa: E402
from jobs.models import ActiveJob, DeadLetter, Job, JobState, JobStep  # noqa: E402
from jobs.worker.registry import task_by_name  # noqa: E402
from tests.sqlite import jobs as _sqlite_jobs  # noqa: E402,F401 (registers the suite's jobs)
from tests.support import step_tasks as _step_tasks  # noqa: E402,F401 (the step jobs)
from tests.support import tasks as _tasks  # noqa: E402,F401 (registers the test jobs)


def _row(job: Job) -> dict[str, Any]:
    return {
        "id": str(job.id),
        "task": job.task_name,
        "state": job.state,
        "attempts": job.attempts,
        "deliveries": job.deliveries,
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


def outbox(task: str, args: list, kwargs: dict) -> dict[str, Any]:
    """A queued row whose message never reached Redis (what enqueue leaves while Redis is
    down), older than the relay's grace."""
    found = task_by_name(task)
    job = Job(
        id=uuid.uuid4(),
        task_name=found.name,
        args=args,
        kwargs=kwargs,
        queue=found.queue_name,
        priority=found.default_priority,
        state=JobState.QUEUED,
        max_attempts=found.policy.max_attempts,
        enqueued_at=timezone.now() - timedelta(minutes=1),
    )
    ledger.insert(job)
    return {"id": str(job.id)}


def jobs(ids: list[str]) -> dict[str, Any]:
    rows = {str(j.id): _row(j) for j in Job.objects.filter(id__in=ids)}
    return {"jobs": [rows.get(i) for i in ids]}


def dead_letters(ids: list[str]) -> dict[str, Any]:
    return {
        "dead_letters": [
            {"id": d.pk, "job_id": str(d.job_id_value), "exception": d.exception_class}
            for d in DeadLetter.objects.filter(job_id_value__in=ids)
        ]
    }


def replay(dead_letter_id: int) -> dict[str, Any]:
    handle = dead_letter_replay(dead_letter=DeadLetter.objects.get(pk=dead_letter_id))
    return {"id": handle.id}


def cancel_(job_id: str) -> dict[str, Any]:
    done = cancel(job_id)
    return {"state": done.state, "cancelled": done.cancelled, "requested": done.requested}


def steps(job_id: str) -> dict[str, Any]:
    """A job's durable steps in order: name, state, attempts, copied_from."""
    return {
        "steps": [
            [s.name, s.state, s.attempts, None if s.copied_from is None else str(s.copied_from)]
            for s in JobStep.objects.of_job(job_id)
        ]
    }


def signal_(job_id: str, name: str, payload: Any) -> dict[str, Any]:
    return {"woke": signal(job_id, name, payload)}


def active(ids: list[str]) -> dict[str, Any]:
    """The copies jobs_activejob holds of these jobs (the SQLite triggers keep them)."""
    rows = ActiveJob.objects.filter(job_id__in=ids).values_list("job_id", "state")
    return {"active": {str(job_id): state for job_id, state in rows}}


def relay() -> dict[str, Any]:
    return {"sent": job_relay()}


def sqlite() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        mode = cursor.fetchone()[0]
    name = str(connection.settings_dict["NAME"])
    return {"vendor": connection.vendor, "journal_mode": mode, "name": name}


def groups(names: list[str]) -> dict[str, Any]:
    from django.contrib.auth.models import Group

    return {"groups": sorted(Group.objects.filter(name__in=names).values_list("name", flat=True))}


COMMANDS: dict[str, Callable[..., dict[str, Any]]] = {
    "enqueue": enqueue,
    "enqueue_many": enqueue_many_,
    "outbox": outbox,
    "jobs": jobs,
    "dead_letters": dead_letters,
    "replay": replay,
    "cancel": cancel_,
    "relay": relay,
    "active": active,
    "steps": steps,
    "signal": signal_,
    "sqlite": sqlite,
    "groups": groups,
}


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        command = COMMANDS[request.pop("cmd")]
        try:
            answer: dict[str, Any] = {"ok": command(**request)}
        except Exception as exc:  # noqa: BLE001 - the test reads the failure
            answer = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            connection.close()  # no connection (or read snapshot) held between commands
        sys.stdout.write(json.dumps(answer, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
