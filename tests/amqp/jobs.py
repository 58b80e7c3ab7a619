"""Jobs of the RabbitMQ suite; its workers, relay and driver import this module besides
tests.support.tasks."""

from __future__ import annotations

import os
import time
from typing import Any

from django.db import connection

from jobs.broker.redis import redis_client
from jobs.worker.decorators import job
from jobs.worker.effects import effect_once
from tests.support.tasks import mark

# One row per application of a `work` job's effect, written in effect_once's transaction and
# with no unique constraint: a second application would be a second row (tests/amqp/conftest.py
# creates it in the suite's database).
EFFECTS_TABLE = "amqp_effects"


@job(name="tests.amqp.work", bind=True)
def work(self: Any, key: str, label: str, seconds: float = 0.0) -> str:
    """Marks its run (with the pool process's pid), works `seconds`, then applies its effect
    once."""
    mark(key, f"run:{label}:{os.getpid()}")
    if seconds:
        time.sleep(seconds)
    with effect_once(f"amqp:{key}:{label}") as effect:
        if not effect.done:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {EFFECTS_TABLE} (key, label, job_id) VALUES (%s, %s, %s)",
                    [key, label, self.request.id],
                )
    return label


@job(name="tests.amqp.after_members")
def after_members(batch_id: str, key: str, kind: str) -> None:
    """A batch callback: records how many member runs had been recorded when it ran."""
    runs = int(redis_client().llen(f"test:{key}:runs"))
    mark(f"{key}:{kind}", f"{batch_id}:{runs}")
