"""How "My jobs" names the jobs of reports (reports.job_descriptions, registered through
jobs.describe_jobs): a render and its email by the report's title, linking its page."""

from __future__ import annotations

import re
from typing import Any

import pytest

from jobs.models import Job, JobState
from reports.models import Report, ReportKind

pytestmark = pytest.mark.django_db


def test_a_render_reads_as_its_report(client: Any, django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("reader", password="not-used-here")
    report = Report.objects.create(
        kind=ReportKind.OPERATIONS,
        params={"start": "2026-11-01", "end": "2026-11-30", "timezone": "UTC"},
        owner=user,
    )
    job = Job.objects.create(
        task_name="reports.render",
        args=[report.pk],
        queue="reports",
        owner=user,
        state=JobState.RUNNING,
    )
    client.force_login(user)

    html = client.get("/jobs/").content.decode()

    row = html.split(f'data-job-id="{job.id}"', 1)[1]
    assert '<span class="kind">Report</span>' in row
    link = re.search(r'<a data-field="label" href="(/[^"]*)">([^<]+)</a>', row)
    assert link is not None
    assert link.groups() == (f"/reports/{report.pk}/", report.title)
    assert report.title.endswith("2026-11-01 to 2026-11-30")
