"""The dashboard's finished counts (completed and failed in the last hour, the rate per minute,
the throughput chart) come from Redis's per-minute buckets of what workers finished, not from
jobs_job by finished_at (an unindexed column: issue 26). Real worker, Redis and PostgreSQL."""

from __future__ import annotations

import re
from typing import Any

from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.support import tasks

FINISHED = ("completed_last_hour", "failed_last_hour")


def default_row(data: dict[str, Any]) -> dict[str, Any]:
    (row,) = [q for q in data["queues"] if q["name"] == "default"]
    return row


def chart_counts(svg: str) -> tuple[int, list[float]]:
    """The chart's peak (jobs a minute) and its points' heights above the baseline."""
    peak = re.search(r"peak (\d+)/min", svg)
    points = re.search(r'points="([^"]*)"', svg)
    assert peak is not None and points is not None, svg
    heights = [116.0 - float(p.split(",")[1]) for p in points.group(1).split()]  # 120 - 4
    return int(peak.group(1)), heights


def test_dashboard_counts_the_jobs_a_real_worker_finished(worker, admin_client, unique):
    url = reverse("admin:jobs_dashboard_json")
    assert {k: default_row(admin_client.get(url).json())[k] for k in FINISHED} == {
        "completed_last_hour": 0,
        "failed_last_hour": 0,
    }

    # given: a real worker runs one job that succeeds and one that gives up (dead)
    done = tasks.add.enqueue(2, 3)
    dead = tasks.refused.enqueue(unique, to="x@example.com")
    wait_until(
        lambda: (
            Job.objects.filter(id=done.id, state=JobState.SUCCEEDED).exists()
            and Job.objects.filter(id=dead.id, state=JobState.DEAD).exists()
        ),
        what="one job succeeded and one dead",
    )

    # when: an operator's dashboard refreshes (the counts follow the ledger's write by a flush)
    data = wait_until(
        lambda: (
            (d := admin_client.get(url).json())
            and {k: default_row(d)[k] for k in FINISHED}
            == {"completed_last_hour": 1, "failed_last_hour": 1}
            and d
        ),
        what="the dashboard to count both jobs",
    )

    # then: the succeeded job is in the rate and on the chart
    assert default_row(data)["throughput_per_minute"] > 0
    peak, heights = chart_counts(data["chart_svg"])
    assert peak == 1 and len(heights) == 61
    assert sum(1 for h in heights if h > 0) == 1  # one minute's point above the baseline
    # and the dashboard read no row of jobs_job by finished_at
    with CaptureQueriesContext(connection) as queries:
        admin_client.get(url)
    assert not [q["sql"] for q in queries if "finished_at" in q["sql"]]
