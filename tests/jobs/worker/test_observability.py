"""Structured job log lines without personal data, and worker-side Prometheus metrics."""

from __future__ import annotations

import json
import logging

from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.support import tasks
from web.logs import JsonFormatter


def test_worker_logs_one_line_per_event_and_no_email_addresses(worker, unique):
    handle = tasks.refused.enqueue(unique, to="secret.person@example.com")
    wait_until(lambda: Job.objects.filter(id=handle.id, state=JobState.DEAD).exists())

    log = wait_until(
        lambda: (
            (text := worker.output())
            and f"job dead id={handle.id}" in text
            and "550 recipient refused: s***@example.com" in text
            and text
        ),
        what="the dead-letter log lines",
    )
    assert f"job started id={handle.id} task=tests.refused queue=default attempt=1" in log
    assert "secret.person@example.com" not in log


def test_json_log_lines_carry_the_job_fields():
    record = logging.LogRecord(
        "backlot.jobs",
        logging.INFO,
        __file__,
        1,
        "job %s to %s",
        ("succeeded", "ann@example.com"),
        None,
    )
    record.job_id, record.task, record.attempt, record.duration = "abc", "emails.send", 2, 0.5

    entry = json.loads(JsonFormatter().format(record))

    assert entry["job_id"] == "abc" and entry["task"] == "emails.send" and entry["attempt"] == 2
    assert entry["message"] == "job succeeded to a***@example.com"


def test_metrics_count_finished_jobs_across_worker_processes(worker, admin_client, unique):
    handles = [tasks.add.enqueue(n, n) for n in range(6)] + [
        tasks.refused.enqueue(unique, to="x@example.com")
    ]
    wait_until(
        lambda: (
            Job.objects.filter(
                id__in=[h.id for h in handles], state__in=["succeeded", "dead"]
            ).count()
            == 7
        )
    )

    text = admin_client.get("/metrics").content.decode()  # a staff session

    assert 'backlot_jobs_finished_total{state="succeeded",task="tests.add"} 6.0' in text
    assert 'backlot_jobs_finished_total{state="dead",task="tests.refused"} 1.0' in text
    assert 'backlot_job_run_seconds_count{task="tests.add"} 6.0' in text
    assert 'backlot_job_run_seconds_bucket{le="+Inf",task="tests.add"} 6.0' in text
