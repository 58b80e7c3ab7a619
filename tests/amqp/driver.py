"""The test's hands on the RabbitMQ site: `python -m tests.amqp.driver`, a process whose
BROKER_URL is the suite's RabbitMQ vhost, DATABASE_URL its PostgreSQL database and REDIS_URL its
private Redis (the pytest process itself is bound to the test database and the shared Redis).

Reads one JSON command per line on stdin, answers one JSON line on stdout:
{"cmd": "enqueue", "task": "tests.add", "args": [...], "kwargs": {...}, "options": {...}}.

`python -m tests.amqp.driver relay` is the site's relay instead: `manage.py jobs relay` itself,
in a process that knows the test jobs as a project's relay knows the project's. The commands
and the protocol shared with tests.sqlite.driver are tests.support.driver's.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import django

django.setup()

from django.core.management import call_command  # noqa: E402 (after django.setup())
from django.db import connection  # noqa: E402 (after django.setup())

import jobs  # noqa: E402 (after django.setup())
from jobs import enqueue_many  # noqa: E402
from jobs.core.conf import backlot_settings  # noqa: E402
from jobs.models import Batch  # noqa: E402
from jobs.worker.registry import task_by_name  # noqa: E402
from tests.amqp import jobs as amqp_jobs  # noqa: E402 (registers the suite's jobs)
from tests.support import driver  # noqa: E402
from tests.support import tasks as _tasks  # noqa: E402 (the test jobs)


def apply_async(task: str, args: list, kwargs: dict, options: dict) -> dict[str, Any]:
    """Celery's call, with Celery's options (expires, countdown...)."""
    return {"id": task_by_name(task).apply_async(args, kwargs, **options).id}


def command(args: list[str]) -> dict[str, Any]:
    """`manage.py jobs ARGS...`, the operator's command (pause, resume, status...); its output."""
    out = io.StringIO()
    call_command("jobs", *args, stdout=out, stderr=out)
    return {"output": out.getvalue()}


def batch(key: str, members: int) -> dict[str, Any]:
    """A batch of `members` tests.batch_member jobs (in bulk), with on_success and on_complete
    callbacks (tests.amqp.after_members); its id and its members' ids."""
    with jobs.batch(
        description=f"amqp {key}",
        on_success=amqp_jobs.after_members.s(key, "success"),
        on_complete=amqp_jobs.after_members.s(key, "complete"),
    ) as opened:
        ids = enqueue_many(_tasks.batch_member, [([key, n], {}) for n in range(members)])
    return {"id": str(opened.id), "members": ids}


def batch_state(batch_id: str) -> dict[str, Any]:
    row = Batch.objects.get(id=batch_id)
    return {
        "state": row.state,
        "total": row.total,
        "pending": row.pending,
        "succeeded": row.succeeded,
        "dead": row.dead,
    }


def effects(key: str) -> dict[str, Any]:
    """label -> how many times a tests.amqp.work job of `key` applied its effect."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT label, count(*) FROM {amqp_jobs.EFFECTS_TABLE} WHERE key = %s GROUP BY label",
            [key],
        )
        return {"effects": dict(cursor.fetchall())}


def settings() -> dict[str, Any]:
    """What Backlot resolved its broker settings to in this process."""
    conf = backlot_settings()
    return {
        "broker": conf.BROKER_URL,
        "queue_type": conf.AMQP_QUEUE_TYPE,
        "delivery_limit": conf.AMQP_DELIVERY_LIMIT,
        "queues": list(conf.QUEUES),
        "vendor": connection.vendor,
    }


def depths() -> dict[str, Any]:
    """The queue depths the dashboard, /health and /metrics read (jobs.broker.queues)."""
    from jobs.broker import queues

    return queues.queue_depths(list(backlot_settings().QUEUES))


def purge(queue: str) -> dict[str, Any]:
    """Drop every ready message of `queue` in RabbitMQ (an operator's purge, a lost queue)."""
    from celery import current_app

    with current_app.connection_for_write() as conn:
        channel: Any = conn.default_channel  # celery-types types it as kombu's StdChannel
        return {"purged": channel.queue_purge(queue)}


COMMANDS: dict[str, driver.Command] = {
    **driver.COMMANDS,
    "apply_async": apply_async,
    "command": command,
    "batch": batch,
    "batch_state": batch_state,
    "effects": effects,
    "settings": settings,
    "depths": depths,
    "purge": purge,
}


if __name__ == "__main__":
    if sys.argv[1:2] == ["relay"]:
        call_command("jobs", "relay", *sys.argv[2:])
    else:
        driver.serve(COMMANDS)
