"""Parked jobs on the admin dashboard and /metrics: jobs a real worker parked in a durable sleep
(self.sleep) or a wait_for() are counted as parked, apart from the queue's waiting backlog and
its scheduled jobs, until their time comes (a signal wakes a wait: it then waits for a worker
like any due job). Real worker, Redis and PostgreSQL."""

from __future__ import annotations

import functools
import re
from typing import Any

from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

import jobs
from jobs.models import Job
from tests.conftest import wait_until
from tests.jobs.worker.test_steps import TIMEOUT, parked, runs, step_worker  # noqa: F401
from tests.support import step_tasks

COUNTS = ("waiting", "scheduled", "parked", "running")


def reports_row(admin_client: Any) -> dict[str, Any]:
    """The `reports` queue's numbers in the dashboard's JSON (what its page refreshes from)."""
    data = admin_client.get(reverse("admin:jobs_dashboard_json")).json()
    (row,) = [q for q in data["queues"] if q["name"] == "reports"]
    return {key: row[key] for key in COUNTS}


def page_cells(admin_client: Any) -> dict[str, str]:
    """The `reports` row of the dashboard page as rendered: its cells by class."""
    html = admin_client.get(reverse("admin:jobs_dashboard")).content.decode()
    row = re.search(r'<tr data-queue="reports">(.*?)</tr>', html, re.S)
    assert row is not None, "no reports row on the dashboard"
    return dict(re.findall(r'<td class="(\w+)">(\d+)</td>', row.group(1)))


def queue_gauges(client: Any) -> dict[str, float]:
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-me").content.decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("backlot_queue_") and sample.labels.get("queue") == "reports"
    }


def test_parked_jobs_are_counted_apart_from_the_backlog(
    step_worker,  # noqa: F811 (the fixture of test_steps.py)
    unique,
    admin_client,
    client,
    settings,
):
    settings.BACKLOT = {**settings.BACKLOT, "METRICS_TOKEN": "scrape-me"}
    # given: a real worker parks a job in an hour's sleep and one in a wait_for() with no timeout
    worker = step_worker("parked-dashboard")
    sleeper = step_tasks.napper.enqueue(f"{unique}-nap", 3600)
    waiter = step_tasks.waiter.enqueue(f"{unique}-wait")
    for handle in (sleeper, waiter):
        wait_until(functools.partial(parked, handle.id), timeout=TIMEOUT, what="the job to park")
    assert runs(f"{unique}-nap:before") == runs(f"{unique}-wait:before") == 1
    # and with the worker gone, two jobs wait for one (the backlog) and one is delayed an hour
    worker.stop()
    for n in range(2):
        step_tasks.quick.enqueue(f"{unique}-queued-{n}")
    step_tasks.quick.using(delay=3600).enqueue(f"{unique}-later")

    # when: an operator opens the dashboard (its page and its JSON) and Prometheus scrapes
    # then: the 2 parked jobs are counted as parked, in neither the waiting nor the scheduled
    assert reports_row(admin_client) == {"waiting": 2, "scheduled": 1, "parked": 2, "running": 0}
    cells = page_cells(admin_client)
    assert {key: cells[key] for key in COUNTS} == {
        "waiting": "2",
        "scheduled": "1",
        "parked": "2",
        "running": "0",
    }
    assert queue_gauges(client) | {"backlot_queue_oldest_wait_seconds": 0} == {
        "backlot_queue_depth": 2,
        "backlot_queue_scheduled": 1,
        "backlot_queue_parked": 2,
        "backlot_queue_running": 0,
        "backlot_queue_oldest_wait_seconds": 0,
        "backlot_queue_paused": 0,
    }

    # when: the waiting job's signal comes (no worker is there to run it yet)
    assert jobs.signal(waiter.id, "approved", {"by": 7}) is True

    # then: it is due, so it waits for a worker with the backlog; the sleeper is still parked
    assert reports_row(admin_client) == {"waiting": 3, "scheduled": 1, "parked": 1, "running": 0}
    gauges = queue_gauges(client)
    assert (gauges["backlot_queue_depth"], gauges["backlot_queue_parked"]) == (3, 1)
    assert Job.objects.parked().count() == 1
