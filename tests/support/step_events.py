"""Receivers of the step events (jobs.core.events.step_started, step_finished) for
tests/jobs/worker/test_step_events.py: real worker processes import this module (-I), and each
event is appended to a Redis list as JSON (its exception as "Class: message"), which the test
reads back with `received`."""

from __future__ import annotations

import json
from typing import Any

from django.dispatch import receiver

from jobs import events
from jobs.broker.redis import redis_client

KEY = "test:step-events"


def _keep(event: str, sender: str, arguments: dict[str, Any]) -> None:
    arguments.pop("signal", None)
    exception = arguments.get("exception")
    if exception is not None:
        arguments["exception"] = f"{type(exception).__name__}: {exception}"
    redis_client().rpush(KEY, json.dumps({"event": event, "sender": sender, **arguments}))


@receiver(events.step_started, dispatch_uid="tests-step-started")
def kept_started(sender: str, **arguments: Any) -> None:
    _keep("step_started", sender, arguments)


@receiver(events.step_finished, dispatch_uid="tests-step-finished")
def kept_finished(sender: str, **arguments: Any) -> None:
    _keep("step_finished", sender, arguments)


def received(job_id: str) -> list[dict[str, Any]]:
    """The step events the workers sent for `job_id`, in the order they were sent."""
    entries = (json.loads(raw) for raw in redis_client().lrange(KEY, 0, -1))
    return [entry for entry in entries if entry["job_id"] == job_id]
