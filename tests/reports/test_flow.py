"""Reports end to end on a real worker: API, rendering, progress, PDF read back, download, pages."""

from __future__ import annotations

import time
from datetime import date, timedelta

import pytest
from django.db.models import DecimalField, ExpressionWrapper, F, Sum
from django.utils import timezone

from jobs import dead_letter_replay
from jobs.models import DeadLetter, Job, JobState
from reports.demo import demo_seed
from reports.models import OrderLine, OrderStatus, Report, ReportOrigin, ReportStatus
from reports.percentiles import percentile
from reports.schemas import SalesParams
from tests.conftest import wait_until
from tests.reports.conftest import (
    downloaded,
    final_report,
    grant,
    pdf_text,
    pdf_title,
    post_report,
)


@pytest.fixture
def today() -> date:
    """Today (TIME_ZONE) as the test starts. Not taken at import: a run that passes midnight
    between collecting this module and running a test would ask for a period ending yesterday
    while its jobs finish today."""
    return timezone.localdate()


def ledger_rows(
    count_ok: int, count_dead: int, task: str = "shop.invoice", queue: str = "default"
) -> list[float]:
    """Finished jobs ten minutes ago with run times 0.1 s, 0.2 s, ...; returns the run times."""
    finished = timezone.now() - timedelta(minutes=10)
    times = []
    for index in range(count_ok + count_dead):
        seconds = round(0.1 * (index + 1), 3)
        times.append(seconds)
        Job.objects.create(
            task_name=task,
            queue=queue,
            state=JobState.SUCCEEDED if index < count_ok else JobState.DEAD,
            attempts=1 if index % 7 else 2,
            max_attempts=5,
            enqueued_at=finished - timedelta(seconds=30),
            started_at=finished - timedelta(seconds=seconds),
            finished_at=finished,
            run_seconds=seconds,
        )
    return times


@pytest.mark.clock  # jobs of 10 minutes ago in yesterday-and-today (UTC), the dated file name
def test_operations_report_end_to_end(rworker, client, owner, stranger, staff, today):
    # given: 37 jobs that succeeded and 3 that gave up, all finished in the period
    times = ledger_rows(37, 3)
    client.force_login(owner)

    # when
    response = post_report(
        client,
        kind="operations",
        params={"start": str(today - timedelta(days=1)), "end": str(today), "timezone": "UTC"},
    )
    assert response.status_code == 202, response.content
    body = response.json()
    report = final_report(body["report_id"])

    # then: the job ran on the worker and the PDF holds the figures
    assert report.status == ReportStatus.READY, report.error
    job = Job.objects.get(id=body["job_id"])
    assert job.state == JobState.SUCCEEDED and job.attempts == 1 and job.owner == owner
    status = client.get(body["status_url"]).json()
    assert status["state"] == "ready" and status["progress"]["percent"] == 100.0
    assert status["download_url"] == f"/api/reports/{report.pk}/download"
    assert status["pages"] == report.pages and status["render_seconds"] > 0

    pdf = client.get(status["download_url"])
    assert pdf.status_code == 200 and pdf["Content-Type"] == "application/pdf"
    assert (
        f'filename="backlot-operations-{today - timedelta(days=1)}_{today}.pdf"'
        in pdf["Content-Disposition"]
    )
    data = downloaded(pdf)
    reader, text = pdf_text(data)
    assert len(reader.pages) >= 1 and len(data) == report.size_bytes
    assert "Job operations report" in text
    assert "92.5%" in text  # 37 of 40 succeeded
    p95 = percentile(sorted(times), 0.95)
    assert f"{p95:.2f} s" in text  # 3.81 s
    assert "shop.invoice" in text

    # only the owner and staff may download it
    client.force_login(stranger)
    assert client.get(status["download_url"]).status_code == 404
    assert client.get(body["status_url"]).status_code == 404
    client.force_login(staff)
    staff_copy = client.get(status["download_url"])
    assert staff_copy.status_code == 200 and downloaded(staff_copy) == data


def test_sales_report_end_to_end(rworker, client, owner, today):
    demo_seed(days=90)
    params = SalesParams(start=today - timedelta(days=29), end=today)
    start, end = params.bounds()
    amount = ExpressionWrapper(
        F("quantity") * F("unit_price"), output_field=DecimalField(max_digits=14, decimal_places=2)
    )
    revenue = OrderLine.objects.filter(
        order__placed_at__gte=start, order__placed_at__lt=end, order__status=OrderStatus.PAID
    ).aggregate(total=Sum(amount))["total"]
    client.force_login(owner)

    response = post_report(
        client, kind="sales", params={"start": str(params.start), "end": str(params.end)}
    )
    report = final_report(response.json()["report_id"])

    assert report.status == ReportStatus.READY, report.error
    reader, text = pdf_text(downloaded(client.get(f"/api/reports/{report.pk}/download")))
    assert len(reader.pages) >= 1
    assert "Sales summary" in text and pdf_title(reader).startswith("Sales summary")
    assert f"${revenue:,.2f}" in text
    assert "Top 10 products" in text


def test_progress_is_visible_while_rendering(rworker, client, owner, today):
    demo_seed(days=366)
    client.force_login(owner)
    response = post_report(
        client, kind="sales", params={"start": str(today - timedelta(days=365)), "end": str(today)}
    )
    status_url = response.json()["status_url"]

    seen = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        body = client.get(status_url).json()
        seen.append(
            (
                body["state"],
                body["progress"]["done"],
                body["progress"]["total"],
                body["progress"]["message"],
            )
        )
        if body["state"] in ("ready", "failed"):
            break
        time.sleep(0.02)

    assert seen[-1][0] == "ready", seen[-1]
    midway = [
        entry for entry in seen if entry[0] == "rendering" and entry[2] and 0 < entry[1] < entry[2]
    ]
    assert midway, f"no progress seen while rendering: {sorted(set(seen))}"
    assert all(message for *_, message in midway)  # each step says what it did
    steps = [done for state, done, total, _ in seen if state == "rendering"]
    assert steps == sorted(steps)  # monotonic


def test_report_emailed_on_request_as_a_chain(rworker, mailbox, client, owner, today):
    demo_seed(days=30)
    client.force_login(grant(owner, "email_report_elsewhere"))

    response = post_report(
        client,
        kind="sales",
        params={"start": str(today - timedelta(days=6)), "end": str(today)},
        email_to=["jane.doe@example.com"],
    )
    report = final_report(response.json()["report_id"])

    assert report.status == ReportStatus.READY, report.error
    [received] = wait_for_mail(mailbox, 1)
    assert received["To"] == "jane.doe@example.com"
    assert received["Subject"].startswith("Sales summary")
    attachments = [part for part in received.walk() if part.get_content_type() == "application/pdf"]
    assert len(attachments) == 1
    _, text = pdf_text(attachments[0].get_payload(decode=True))
    assert "Sales summary" in text
    report.refresh_from_db()
    assert report.emailed_at is not None


def wait_for_mail(mailbox, count: int, timeout: float = 60):
    return wait_until(
        lambda: len(mailbox.received()) >= count and mailbox.received(),
        timeout=timeout,
        interval=0.1,
        what=f"{count} email(s)",
    )


def test_render_that_gives_up_marks_the_report_failed(rworker, client, owner, today):
    # stored parameters that no longer validate: a Permanent error, no retry
    report = Report.objects.create(kind="operations", owner=owner, params={"start": "not a date"})
    from reports.tasks import report_render_job

    handle = report_render_job.using(owner=owner).enqueue(report.pk)
    report.mark_queued(job_id=handle.id)
    report = final_report(report.pk)

    assert report.status == ReportStatus.FAILED and "invalid parameters" in report.error
    client.force_login(owner)
    body = client.get(f"/api/reports/{report.pk}/").json()
    assert (
        body["state"] == "failed" and body["job_state"] == "dead" and body["download_url"] is None
    )

    # an operator fixes the data and replays the dead letter: the same report renders
    Report.objects.filter(pk=report.pk).update(
        params={"start": str(today), "end": str(today), "timezone": "UTC"}
    )
    replay = dead_letter_replay(dead_letter=DeadLetter.objects.get(job_id_value=handle.id))
    report = wait_until(
        lambda: Report.objects.filter(pk=report.pk, status=ReportStatus.READY).first(),
        timeout=60,
        what="the replayed render",
    )
    assert str(report.job_id) == replay.id and report.error == ""
    wait_until(
        lambda: client.get(f"/api/reports/{report.pk}/").json()["job_state"] == "succeeded",
        what="the replay job to finish",
    )


# --- pages ---------------------------------------------------------------------------------


def test_pages_request_follow_and_download(rworker, client, owner, stranger, today):
    demo_seed(days=30)
    client.force_login(owner)

    page = client.get("/reports/")
    assert page.status_code == 200 and b'name="kind"' in page.content

    response = client.post(
        "/reports/", {"kind": "sales", "start": str(today - timedelta(days=6)), "end": str(today)}
    )
    report = Report.objects.get(owner=owner)
    assert response.status_code == 302 and response["Location"] == f"/reports/{report.pk}/"
    assert report.origin == ReportOrigin.PAGE

    detail = client.get(response["Location"])
    assert detail.status_code == 200
    assert f'data-status-url="/api/reports/{report.pk}/"'.encode() in detail.content
    assert b"fetch(url" in detail.content  # the polling script of jobs/poll.html

    final_report(report.pk)
    listing = client.get("/reports/").content.decode()
    assert f'href="/api/reports/{report.pk}/download"' in listing
    ready = client.get(f"/reports/{report.pk}/").content.decode()
    assert (
        f'href="/api/reports/{report.pk}/download"' in ready
        and "hidden" not in ready.split('id="download"')[1][:20]
    )

    client.force_login(stranger)
    assert client.get(f"/reports/{report.pk}/").status_code == 404
    assert f"/reports/{report.pk}/" not in client.get("/reports/").content.decode()


def test_page_form_shows_field_errors_and_queues_nothing(client, owner, transactional_db):
    client.force_login(owner)

    response = client.post(
        "/reports/",
        {"kind": "sales", "start": "2025-03-10", "end": "2025-03-01", "email_to": "nope"},
    )

    assert response.status_code == 200
    content = response.content.decode()
    assert "End (2025-03-01) is before start (2025-03-10)." in content
    assert "Enter a valid email address." in content
    assert Report.objects.count() == 0 and Job.objects.count() == 0


def test_pages_need_login(client):
    response = client.get("/reports/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
