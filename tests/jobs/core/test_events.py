"""The job events (jobs.core.events) as a receiver sees them, and jobs.testing.run_job, which runs a
job in-process through the worker's own path: claim → run → decide → persist → events."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from jobs import dead_letter_replay, events
from jobs.models import DeadLetter, JobState
from jobs.testing import run_job
from tests.support import tasks


@pytest.fixture
def received() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every job event sent while the test runs, as (event name, arguments)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name, signal in events.ALL.items():

        def receive(sender: str, name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal", None)
            seen.append((name, {"sender": sender, **kwargs}))

        receivers[name] = receive
        signal.connect(receive)
    yield seen
    for name, signal in events.ALL.items():
        signal.disconnect(receivers[name])


def test_a_job_that_succeeds_sends_enqueued_started_succeeded(
    db, clean_redis, received, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        handle = tasks.add.enqueue(2, 40)
    job = run_job(handle)

    assert job.state == JobState.SUCCEEDED and job.result == 42 and job.attempts == 1
    assert [name for name, _ in received] == ["enqueued", "started", "succeeded"]
    enqueued, started, succeeded = (arguments for _, arguments in received)
    assert enqueued["job_id"] == handle.id and enqueued["queue"] == "default"
    assert enqueued["sender"] == enqueued["task"] == "tests.add"
    assert started == {
        "sender": "tests.add",
        "task": "tests.add",
        "job_id": handle.id,
        "queue": "default",
        "attempt": 1,
    }
    assert succeeded["result"] == 42 and succeeded["duration"] >= 0


def test_a_failed_attempt_sends_retrying_with_its_delay(db, received, unique):
    handle = tasks.explicit.enqueue(unique, 3)  # delays 0.5, 2.0, 1.0
    job = run_job(handle)

    assert job.state == JobState.RETRYING and job.attempts == 1
    (name, arguments) = received[-1]
    assert name == "retrying" and arguments["delay"] == 0.5
    assert isinstance(arguments["exception"], TimeoutError)  # what tests.explicit raises


def test_giving_up_sends_dead_with_the_dead_letter_and_replay_sends_replayed(
    db, clean_redis, received, unique, django_capture_on_commit_callbacks
):
    job = run_job(tasks.refused.enqueue(unique, to="x@example.com"))

    assert job.state == JobState.DEAD
    dead_letter = DeadLetter.objects.get(job_id_value=str(job.id))
    name, arguments = received[-1]
    assert name == "dead" and arguments["dead_letter_id"] == dead_letter.pk
    assert arguments["exception"].__class__.__name__ == "Permanent"

    with django_capture_on_commit_callbacks(execute=True):
        new = dead_letter_replay(dead_letter=dead_letter)
    name, arguments = received[-1]
    assert name == "replayed"
    assert arguments["job_ids"] == [new.id] and arguments["dead_letter_ids"] == [dead_letter.pk]


def test_a_receiver_that_raises_is_logged_and_never_breaks_the_job(db, received, caplog):
    def broken(sender: str, **kwargs: Any) -> None:
        raise RuntimeError("receiver bug")

    events.job_started.connect(broken)
    events.job_succeeded.connect(broken)
    try:
        with caplog.at_level(logging.ERROR, logger="jobs.core.events"):
            job = run_job(tasks.add.enqueue(1, 1))
    finally:
        events.job_started.disconnect(broken)
        events.job_succeeded.disconnect(broken)

    assert job.state == JobState.SUCCEEDED and job.result == 2
    failures = [r for r in caplog.records if r.name == "jobs.core.events"]
    assert len(failures) == 2 and all("receiver bug" in r.exc_text for r in failures)
    # the other receivers still ran
    assert [name for name, _ in received] == ["started", "succeeded"]


def test_run_job_does_not_run_a_job_twice(db):
    handle = tasks.add.enqueue(3, 4)
    assert run_job(handle).state == JobState.SUCCEEDED

    again = run_job(handle)

    assert again.state == JobState.SUCCEEDED and again.attempts == 1 and again.deliveries == 2
