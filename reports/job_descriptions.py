"""How "My jobs" names the jobs of reports (jobs.describe_jobs): a render and its email by the
report's title, linking the report's page. One query per task per page. Registered by
ReportsConfig.ready()."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.urls import reverse

from jobs import JobDescription, describe_jobs

from .models import Report


def describe_reports(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    wanted = {job.id: job.kwargs.get("report_id", (job.args or [None])[0]) for job in jobs}
    reports = Report.objects.in_bulk([r for r in wanted.values() if isinstance(r, int)])
    return {
        key: JobDescription(reports[r].title, reverse("reports:detail", kwargs={"report_id": r}))
        for key, r in wanted.items()
        if r in reports
    }


def register() -> None:
    describe_jobs("reports.render", kind="Report", describe=describe_reports)
    describe_jobs("reports.email", kind="Report email", describe=describe_reports)
    describe_jobs("reports.scheduled", kind="Scheduled report")
