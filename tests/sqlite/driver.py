"""The test's hands on the SQLite database: `python -m tests.sqlite.driver`, a process whose
DATABASE_URL is the suite's SQLite file and REDIS_URL its private Redis (the pytest process
itself is bound to the PostgreSQL test database and the shared Redis). The commands and the
protocol shared with tests.amqp.driver are tests.support.driver's.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import django

django.setup()

from django.db import connection  # noqa: E402 (after django.setup())
from django.utils import timezone  # noqa: E402 (after django.setup())

from jobs import ledger, signal  # noqa: E402
from jobs.models import ActiveJob, Job, JobState, JobStep  # noqa: E402
from jobs.worker.registry import task_by_name  # noqa: E402
from tests.sqlite import jobs as _sqlite_jobs  # noqa: E402,F401 (registers the suite's jobs)
from tests.support import driver  # noqa: E402
from tests.support import step_tasks as _step_tasks  # noqa: E402,F401 (the step jobs)


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


def sqlite() -> dict[str, Any]:
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        mode = cursor.fetchone()[0]
    name = str(connection.settings_dict["NAME"])
    return {"vendor": connection.vendor, "journal_mode": mode, "name": name}


def groups(names: list[str]) -> dict[str, Any]:
    from django.contrib.auth.models import Group

    return {"groups": sorted(Group.objects.filter(name__in=names).values_list("name", flat=True))}


def alongside(task: str, args: list, name: str, job_id: str | None = None) -> dict[str, Any]:
    """Enqueue with a new Group row alongside (jobs.ledger.alongside); a refused enqueue
    answers its error."""
    from django.contrib.auth.models import Group

    group = Group(name=name)
    try:
        handle = task_by_name(task).using(alongside=group, job_id=job_id).enqueue(*args)
    except Exception as exc:  # noqa: BLE001 (the test reads what failed)
        return {"error": type(exc).__name__}
    return {"id": handle.id, "group": group.pk}


COMMANDS: dict[str, driver.Command] = {
    **driver.COMMANDS,
    "outbox": outbox,
    "active": active,
    "steps": steps,
    "signal": signal_,
    "sqlite": sqlite,
    "groups": groups,
    "alongside": alongside,
}


if __name__ == "__main__":
    driver.serve(COMMANDS)
