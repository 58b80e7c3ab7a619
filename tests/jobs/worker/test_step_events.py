"""The step events (jobs.core.events.step_started, step_finished) as a receiver in a real worker
process sees them, and the step outcomes /metrics counts (backlot_steps_total, whose counts
those events add up): real worker, Redis and PostgreSQL."""

from __future__ import annotations

import functools
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from jobs.models import JobState
from tests.conftest import wait_until
from tests.jobs.worker.test_steps import TIMEOUT, ended, step_worker  # noqa: F401
from tests.support import step_events, step_tasks

RECEIVERS = ("tests.support.step_events",)


def summary(event: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(event.get(key) for key in ("event", "name", "position", "attempt", "outcome"))


def test_each_step_sends_started_and_finished_with_its_outcome(
    step_worker,  # noqa: F811 (the fixture of test_steps.py)
    unique,
):
    # given: a worker whose process has receivers of the step events
    step_worker("step-events", imports=RECEIVERS)

    # when: a 3-step job runs whose second step takes 0.5 s and whose third fails once
    handle = step_tasks.three.enqueue(unique, fail_times=1, stall=0.5)
    job = wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")
    assert job.state == JobState.SUCCEEDED and job.attempts == 2, job.error

    # then: the first run sent a start and a finish for each step, the third one failed; the
    # retry got steps 1 and 2 back without running them (skipped) and ran step 3 again
    received = step_events.received(handle.id)
    assert [summary(event) for event in received] == [
        ("step_started", "fetch", 0, 1, None),
        ("step_finished", "fetch", 0, 1, "succeeded"),
        ("step_started", "sum", 1, 1, None),
        ("step_finished", "sum", 1, 1, "succeeded"),
        ("step_started", "post", 2, 1, None),
        ("step_finished", "post", 2, 1, "failed"),
        ("step_finished", "fetch", 0, 2, "skipped"),
        ("step_finished", "sum", 1, 2, "skipped"),
        ("step_started", "post", 2, 2, None),
        ("step_finished", "post", 2, 2, "succeeded"),
    ]
    # and each names its job and task, a finish its run time and what a failure raised
    assert {(e["sender"], e["task"], e["job_id"]) for e in received} == {
        ("steps.three", "steps.three", handle.id)
    }
    started, finished = received[2], received[3]
    assert set(started) == {"event", "sender", "task", "job_id", "name", "position", "attempt"}
    assert set(finished) == set(started) | {"outcome", "seconds", "exception"}
    assert 0.5 <= finished["seconds"] < TIMEOUT and finished["exception"] is None
    failed = received[5]
    assert failed["exception"] == "ConnectionError: the third step's service is away"
    assert 0 <= failed["seconds"] < 0.5
    assert [e["seconds"] for e in received[6:8]] == [0.0, 0.0]


def test_metrics_count_each_step_outcome(
    step_worker,  # noqa: F811 (the fixture of test_steps.py)
    unique,
    client,
    settings,
):
    # given: the same job, run to its end by a worker (no receivers of the test's own)
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "scrape-me"}
    step_worker("step-metrics")
    handle = step_tasks.three.enqueue(unique, fail_times=1)
    wait_until(functools.partial(ended, handle.id), timeout=TIMEOUT, what="the job")

    # when: Prometheus scrapes /metrics (the counts are written with the run's outcome)
    def counted() -> dict[str, float] | None:
        text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()
        by_outcome = {
            sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "backlot_steps_total" and sample.labels["task"] == "steps.three"
        }
        return by_outcome if len(by_outcome) == 3 else None

    # then: the step counter shows each outcome of its steps: 3 ran and succeeded, 1 failed,
    # and the retry skipped the 2 it had the results of
    counts = wait_until(counted, timeout=10, what="the step counts")
    assert counts == {"succeeded": 3, "failed": 1, "skipped": 2}
