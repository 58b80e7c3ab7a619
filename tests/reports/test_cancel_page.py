"""The report page's Cancel button: its owner (or staff) cancels a waiting render, the report
reads cancelled, the button goes; anyone else gets 404; a finished report says so."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from jobs.models import Job, JobState
from reports.models import Report, ReportKind, ReportStatus
from reports.tasks import report_render_job


@pytest.fixture
def waiting_report(transactional_db: None, clean_redis: None, owner: Any) -> Report:
    """A report whose render job waits a minute (scheduled: in the ledger, not yet in Redis),
    so no worker of the session can take it meanwhile."""
    report = Report.objects.create(
        kind=ReportKind.OPERATIONS,
        params={"start": "2026-11-01", "end": "2026-11-30", "timezone": "UTC"},
        owner=owner,
    )
    handle = report_render_job.using(owner=owner, delay=60).enqueue(report.pk)
    assert report.mark_queued(job_id=handle.id)
    return report


def test_the_owner_cancels_a_waiting_report_from_its_page(waiting_report, owner, stranger):
    report = waiting_report
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    page = client.get(f"/reports/{report.pk}/")
    assert page.status_code == 200 and 'id="cancel"' in page.content.decode()

    # a POST without the page's CSRF token is refused; a GET is not a cancel
    assert client.post(f"/reports/{report.pk}/cancel").status_code == 403
    assert client.get(f"/reports/{report.pk}/cancel").status_code == 405

    # someone else's report is not found, and stays queued
    other = Client()
    other.force_login(stranger)
    assert other.post(f"/reports/{report.pk}/cancel").status_code == 404
    assert Report.objects.get(pk=report.pk).status == ReportStatus.QUEUED

    # the owner's button (with the page's token) cancels it
    token = page.cookies["csrftoken"].value
    response = client.post(
        f"/reports/{report.pk}/cancel", {"csrfmiddlewaretoken": token}, follow=True
    )
    body = response.content.decode()
    assert response.status_code == 200 and f"Report #{report.pk} is cancelled." in body
    assert 'id="cancel"' not in body and ">cancelled<" in body
    report.refresh_from_db()
    assert report.status == ReportStatus.CANCELLED and report.finished_at is not None
    assert Job.objects.get(id=report.job_id).state == JobState.CANCELLED

    # pressed again: it already finished
    again = client.post(
        f"/reports/{report.pk}/cancel", {"csrfmiddlewaretoken": token}, follow=True
    ).content.decode()
    assert f"Report #{report.pk} already finished: it is cancelled." in again


def test_staff_may_cancel_anyones_report(waiting_report, staff, client):
    client.force_login(staff)
    response = client.post(f"/reports/{waiting_report.pk}/cancel")
    assert response.status_code == 302
    assert Report.objects.get(pk=waiting_report.pk).status == ReportStatus.CANCELLED
