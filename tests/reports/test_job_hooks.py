"""Reports follow the jobs that are not their render: the email step and the scheduled run.
Dead-lettered or cancelled, each leaves its report saying why (the render job's own hooks are
tested in test_flow.py and test_cancel_api.py)."""

from __future__ import annotations

from django.utils import timezone

from emails.models import EmailMessage, EmailStatus
from jobs import dead_letter_replay
from jobs.models import DeadLetter, Job, JobState
from reports.models import Report, ReportOrigin, ReportStatus
from reports.tasks import report_email_job, report_scheduled_job
from tests.conftest import wait_until
from tests.reports.conftest import final_job, final_report, post_report
from tests.support.refusals import status_refused


def test_a_report_whose_email_step_dies_stays_ready_and_says_why(rworker, mailbox, client, owner):
    today = str(timezone.localdate())
    client.force_login(owner)
    # given a database that refuses every queued email: the email step's write fails for good
    with status_refused(EmailMessage, EmailStatus.QUEUED):
        # when a report emailed to its owner is rendered and its email step runs
        response = post_report(
            client,
            kind="operations",
            params={"start": today, "end": today},
            email_to=["owner@example.com"],
        )
        assert response.status_code == 202, response.content
        report_id = response.json()["report_id"]
        assert final_report(report_id).status == ReportStatus.READY
        email_step = wait_until(
            lambda: Job.objects.filter(
                task_name="reports.email", args=[report_id], state=JobState.DEAD
            ).first(),
            timeout=60,
            what="the email step to be dead",
        )
        # then the report keeps its PDF and says it was not emailed, and why
        body = wait_until(
            lambda: (b := client.get(f"/api/reports/{report_id}/").json())["error"] and b,
            what="the report to say why it was not emailed",
        )
    assert body["state"] == "ready" and body["download_url"] and body["emailed_at"] is None
    assert body["error"].startswith("the email step gave up: IntegrityError: ")

    # once the cause is gone, replaying the step emails the PDF and clears the error
    dead_letter_replay(dead_letter=DeadLetter.objects.get(job_id_value=email_step.id))
    wait_until(lambda: len(mailbox.received()) == 1, timeout=60, what="the report's email")
    body = wait_until(
        lambda: (b := client.get(f"/api/reports/{report_id}/").json())["emailed_at"] and b,
        what="the report to read emailed",
    )
    assert body["error"] is None and body["state"] == "ready"


def test_cancelling_a_ready_reports_email_step_says_it_was_not_emailed(rworker, client, owner):
    today = str(timezone.localdate())
    report = Report.objects.create(
        kind="operations",
        owner=owner,
        params={"start": today, "end": today, "timezone": "UTC"},
        email_to=["owner@example.com"],
        status=ReportStatus.READY,
        file="reports/never-written.pdf",
    )
    handle = report_email_job.using(owner=owner, delay=600).enqueue(report.pk)
    client.force_login(owner)

    response = client.post(f"/api/jobs/{handle.id}/cancel")

    assert response.status_code == 202, response.content
    body = client.get(f"/api/reports/{report.pk}/").json()
    assert body["state"] == "ready" and body["emailed_at"] is None
    assert body["error"] == "the email step was cancelled: the PDF was not emailed"


def test_a_scheduled_run_that_dies_leaves_a_failed_report_with_the_reason(rworker, client, staff):
    # given a schedule whose time zone does not exist: the run fails for good (not retried)
    handle = report_scheduled_job.enqueue("operations", days=1, timezone="Mars/Olympus_Mons")

    # when the scheduled job is dead-lettered
    assert final_job(handle.id).state == JobState.DEAD

    # then a failed report of the schedule says why (staff see it; it has no owner)
    report = wait_until(
        lambda: Report.objects.filter(origin=ReportOrigin.SCHEDULE).first(),
        what="the schedule's failed report",
    )
    client.force_login(staff)
    body = client.get(f"/api/reports/{report.pk}/").json()
    assert (
        body["state"] == "failed" and body["kind"] == "operations" and body["download_url"] is None
    )
    assert body["error"].startswith("the scheduled job gave up: ZoneInfoNotFoundError: ")
    assert "Mars/Olympus_Mons" in body["error"]
