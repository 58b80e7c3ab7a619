"""POST /api/reports/{id}/cancel: the page's Cancel button as an API route. Its owner cancels a
waiting render (202, the report reads cancelled), a stranger gets 404, and once it has settled
a cancel is 409. Real PostgreSQL and Redis."""

from __future__ import annotations

from typing import Any

import pytest

from jobs.models import Job, JobState
from reports.models import Report, ReportKind, ReportStatus
from reports.tasks import report_render_job


@pytest.fixture
def waiting_report(transactional_db: None, clean_redis: None, owner: Any) -> Report:
    """A report whose render job waits a minute (scheduled: no worker takes it meanwhile)."""
    report = Report.objects.create(
        kind=ReportKind.OPERATIONS,
        params={"start": "2026-11-01", "end": "2026-11-30", "timezone": "UTC"},
        owner=owner,
    )
    handle = report_render_job.using(owner=owner, delay=60).enqueue(report.pk)
    assert report.mark_queued(job_id=handle.id)
    return report


def test_the_owner_cancels_a_waiting_report_through_the_api(
    waiting_report, client, owner, stranger
):
    url = f"/api/reports/{waiting_report.pk}/cancel"
    client.force_login(stranger)
    assert client.post(url).status_code == 404
    client.force_login(owner)

    response = client.post(url)

    assert response.status_code == 202, response.content
    assert response.json()["state"] == ReportStatus.CANCELLED
    assert Job.objects.get(id=waiting_report.job_id).state == JobState.CANCELLED
    again = client.post(url)
    assert again.status_code == 409
    assert "already finished" in again.json()["detail"]
