"""Campaigns (bulk fan-out, per-recipient idempotency, summary) and CSV recipient imports."""

from __future__ import annotations

import csv
import io
import tracemalloc

from django.db import connection
from django.test.utils import CaptureQueriesContext

from emails import services
from emails.models import (
    Campaign,
    CampaignRecipient,
    CampaignStatus,
    EmailMessage,
    EmailStatus,
    ImportStatus,
    RecipientImport,
)
from emails.tasks import campaign_fan_out_job, email_send_job
from jobs.models import Job
from tests.conftest import wait_until


def test_campaign_fans_out_one_job_per_recipient_and_reports_progress(
    worker, mailbox, client, admin_user
):
    recipients = [{"email": f"person{n}@example.com", "name": f"Person {n}"} for n in range(40)]
    recipients.append(
        {"email": "PERSON0@example.com", "name": "dup"}
    )  # same address: one recipient
    client.force_login(admin_user)

    response = client.post(
        "/api/campaigns/",
        {
            "name": "November news",
            "template": "campaign",
            "context": {"body": "Hello!", "headline": "News"},
            "recipients": recipients,
            "start": True,
        },
        content_type="application/json",
    )

    assert response.status_code == 202
    campaign_id = response.json()["campaign_id"]
    summary = wait_until(
        lambda: (
            (s := client.get(f"/api/campaigns/{campaign_id}/").json())["summary"]["sent"] == 40
            and s
        ),
        timeout=60,
        what="every recipient to be sent",
    )
    assert summary["status"] == "done"
    assert summary["summary"] == {
        "total": 40,
        "sent": 40,
        "failed": 0,
        "cancelled": 0,
        "pending": 0,
    }
    assert len(mailbox.received()) == 40
    assert sorted(m["To"] for m in mailbox.received())[:2] == [
        "person0@example.com",
        "person10@example.com",
    ]
    assert Job.objects.filter(task_name="emails.send").count() == 40

    # per-recipient idempotency: starting again is refused, fanning out again adds nothing
    assert client.post(f"/api/campaigns/{campaign_id}/start").status_code == 409
    assert services.campaign_fan_out_run(campaign_id=campaign_id, send_job=email_send_job) == 40
    assert (
        EmailMessage.objects.count() == 40
        and Job.objects.filter(task_name="emails.send").count() == 40
    )


def test_campaign_counts_refused_recipients_as_failed(worker, mailbox, admin_user):
    mailbox.refuse["gone@example.com"] = "550 5.1.1 no such user"
    campaign = services.campaign_create(
        name="c",
        template="campaign",
        context={},
        owner=admin_user,
        recipients=[{"email": "gone@example.com"}, {"email": "here@example.com"}],
    )
    services.campaign_start(campaign=campaign, fan_out_job=campaign_fan_out_job)

    wait_until(
        lambda: campaign.summary()["pending"] == 0, timeout=60, what="the campaign to finish"
    )
    assert campaign.summary() == {"total": 2, "sent": 1, "failed": 1, "cancelled": 0, "pending": 0}


def csv_upload(rows: list[list[str]]) -> io.BytesIO:
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    upload = io.BytesIO(out.getvalue().encode())
    upload.name = "people.csv"
    return upload


def test_csv_import_skips_bad_rows_with_row_numbers(worker, client, admin_user):
    campaign = services.campaign_create(
        name="imp", template="campaign", context={}, owner=admin_user
    )
    client.force_login(admin_user)
    upload = csv_upload(
        [
            ["email", "name", "plan"],
            ["ann@example.com", "Ann", "pro"],
            ["not-an-email", "Bob", "free"],
            ["", "Nobody", ""],
            ["ANN@example.com", "Ann again", "pro"],
            ["cy@example.com", "Cy", "free"],
        ]
    )

    response = client.post(f"/api/campaigns/{campaign.pk}/recipients/import", {"file": upload})

    assert response.status_code == 202
    import_id = response.json()["import_id"]
    body = wait_until(
        lambda: (
            (b := client.get(f"/api/campaigns/{campaign.pk}/imports/{import_id}/").json())["status"]
            == "done"
            and b
        ),
        what="the import to finish",
    )
    assert (body["rows_read"], body["imported"], body["duplicates"], body["skipped"]) == (
        5,
        2,
        1,
        2,
    )
    assert body["errors"] == [
        {"row": 3, "reason": "invalid email address"},
        {"row": 4, "reason": "email is empty"},
    ]
    ann = CampaignRecipient.objects.get(campaign=campaign, email="ann@example.com")
    assert ann.name == "Ann" and ann.data == {"plan": "pro"}


def test_csv_without_email_column_fails_clearly(worker, client, admin_user):
    campaign = services.campaign_create(
        name="imp", template="campaign", context={}, owner=admin_user
    )
    client.force_login(admin_user)
    response = client.post(
        f"/api/campaigns/{campaign.pk}/recipients/import",
        {"file": csv_upload([["mail", "name"], ["a@example.com", "A"]])},
    )

    row = wait_until(
        lambda: RecipientImport.objects.filter(
            pk=response.json()["import_id"], status=ImportStatus.FAILED
        ).first(),
        what="the import to fail",
    )
    assert row.errors == [{"row": 1, "reason": "no 'email' column in the header"}]


def test_hundred_thousand_rows_import_in_bounded_memory(
    transactional_db, admin_user, settings, tmp_path
):
    settings.MEDIA_ROOT = str(tmp_path)
    campaign = services.campaign_create(
        name="big", template="campaign", context={}, owner=admin_user
    )
    lines = ["email,name"] + [f"user{n}@example.com,User {n}" for n in range(100_000)]
    (tmp_path / "imports").mkdir()
    (tmp_path / "imports" / "big.csv").write_text("\n".join(lines) + "\n")
    file_bytes = (tmp_path / "imports" / "big.csv").stat().st_size
    del lines
    row = RecipientImport.objects.create(campaign=campaign, file="imports/big.csv")
    seen: list[int] = []

    tracemalloc.start()
    result = services.recipients_import_run(
        import_id=row.pk, progress=lambda done, total, msg: seen.append(done)
    )
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert result.imported == 100_000 and result.skipped == 0
    assert CampaignRecipient.objects.filter(campaign=campaign).count() == 100_000
    assert seen == sorted(seen) and seen[-1] == file_bytes  # progress by bytes, monotonic
    # one chunk of 1,000 rows in memory, never the whole file (~3 MB of text, ~60 MB as rows)
    assert peak < 16 * 1024 * 1024, f"peak {peak / 1e6:.1f} MB"


def test_csv_over_the_upload_limit_is_refused_and_not_kept(
    transactional_db, client, admin_user, settings, tmp_path
):
    settings.BACKLOT_MAX_UPLOAD_BYTES = 1000
    settings.MEDIA_ROOT = str(tmp_path)
    campaign = services.campaign_create(
        name="imp", template="campaign", context={}, owner=admin_user
    )
    client.force_login(admin_user)
    rows = [["email", "name"]] + [[f"user{n}@example.com", f"User {n}"] for n in range(200)]

    response = client.post(
        f"/api/campaigns/{campaign.pk}/recipients/import", {"file": csv_upload(rows)}
    )

    assert (
        response.status_code == 413
        and "uploads are limited to 1000 bytes" in response.json()["detail"]
    )
    assert RecipientImport.objects.count() == 0 and not (tmp_path / "imports").exists()


def _started_campaign(owner, addresses: list[str]):
    """A campaign started for real: its fan-out job and send jobs run on the worker."""
    campaign = services.campaign_create(
        name="c",
        template="campaign",
        context={},
        owner=owner,
        recipients=[{"email": address} for address in addresses],
    )
    services.campaign_start(campaign=campaign, fan_out_job=campaign_fan_out_job)
    campaign.refresh_from_db()
    return campaign


def test_campaign_detail_get_reads_only(worker, mailbox, client, admin_user):
    # given a campaign whose every message has its outcome (sent by the real send jobs)
    campaign = _started_campaign(admin_user, ["a@example.com", "b@example.com"])
    wait_until(
        lambda: EmailMessage.objects.filter(status=EmailStatus.SENT).count() == 2,
        timeout=60,
        what="both messages to be sent",
    )
    client.force_login(admin_user)

    # when its detail is read
    with CaptureQueriesContext(connection) as queries:
        body = client.get(f"/api/campaigns/{campaign.pk}/").json()

    # then it reads as done, and the read wrote nothing
    assert body["status"] == "done" and body["summary"]["pending"] == 0
    assert body["summary"]["sent"] == 2 and len(mailbox.received()) == 2
    writes = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().split(" ", 1)[0].upper() in ("INSERT", "UPDATE", "DELETE")
        and "django_session" not in q["sql"]
    ]
    assert writes == []


def test_the_last_outcome_marks_the_campaign_done(worker, mailbox, admin_user):
    # the first recipient is refused for good; the second waits in the SMTP conversation
    mailbox.refuse["a@example.com"] = "550 5.1.1 no such user"
    mailbox.hold_at = "rcpt"
    campaign = _started_campaign(admin_user, ["a@example.com", "b@example.com"])
    first, second = wait_until(
        lambda: (rows := list(EmailMessage.objects.order_by("to"))) and len(rows) == 2 and rows,
        timeout=60,
        what="both messages to be fanned out",
    )
    # (the summary counts the send jobs' outcomes: the refused one's job ends a moment after
    # its message reads failed, so the wait covers both)
    wait_until(
        lambda: (
            EmailMessage.objects.get(pk=first.pk).status == EmailStatus.FAILED
            and mailbox.held.is_set()
            and Campaign.objects.get(pk=campaign.pk).summary()["failed"] == 1
        ),
        timeout=60,
        what="the refused message to fail while the other is held",
    )
    campaign.refresh_from_db()
    assert campaign.status == CampaignStatus.SENDING  # one recipient still pending
    assert campaign.summary()["pending"] == 1

    mailbox.release.set()  # the second message goes out: the last outcome
    wait_until(
        lambda: Campaign.objects.get(pk=campaign.pk).status == CampaignStatus.DONE,
        timeout=60,
        what="the campaign to be done",
    )
    campaign.refresh_from_db()
    assert campaign.summary() == {"total": 2, "sent": 1, "failed": 1, "cancelled": 0, "pending": 0}
    assert EmailMessage.objects.get(pk=second.pk).status == EmailStatus.SENT
    # the batch's counters and its fan-out job's state are one statement, one snapshot (two
    # reads could straddle the fan-out's end: "sent" -1 and a recipient too many pending)
    with CaptureQueriesContext(connection) as queries:
        campaign.summary()
    batch_reads = [q["sql"] for q in queries.captured_queries if '"jobs_batch"' in q["sql"]]
    assert len(batch_reads) == 1 and '"jobs_job"' in batch_reads[0]


def test_a_campaign_whose_fan_out_job_dies_ends_failed_with_the_reason(worker, client, admin_user):
    # given a started campaign whose template vanished: the fan-out fails for good
    campaign = services.campaign_create(
        name="doomed",
        template="campaign",
        context={},
        owner=admin_user,
        recipients=[{"email": "one@example.com"}],
    )
    Campaign.objects.filter(pk=campaign.pk).update(template="no-such-template")
    services.campaign_start(campaign=campaign, fan_out_job=campaign_fan_out_job)
    campaign.refresh_from_db()
    client.force_login(admin_user)
    # when its job is dead-lettered, then the campaign reads failed, with the reason
    body = wait_until(
        lambda: (
            (b := client.get(f"/api/campaigns/{campaign.pk}/").json())["status"] == "failed" and b
        ),
        what="the campaign to fail",
    )
    assert Job.objects.get(pk=body["job_id"]).state == "dead"
    assert body["error"].startswith("the fan-out job gave up: ")
    assert "no-such-template" in body["error"]
