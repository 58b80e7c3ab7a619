"""A campaign's reminder (issue 27, durable sleep in the reference project): a campaign created
with `remind_after` gets, once it is done, a reminder job that sleeps in the ledger without
holding a worker, then emails each recipient sent a "Reminder: " message, once. Real worker,
Redis, PostgreSQL and SMTP server."""

from __future__ import annotations

from datetime import datetime

import pytest

from emails import services
from emails.models import Campaign, CampaignRecipient, EmailMessage
from emails.tasks import email_send_job
from jobs.models import Job
from tests.conftest import wait_until

REMIND_AFTER = 3  # seconds


def test_a_done_campaign_sleeps_then_reminds_each_recipient_once(
    worker, mailbox, client, admin_user
):
    # given: a started campaign of three recipients that asks for a reminder
    client.force_login(admin_user)
    recipients = [{"email": f"reader{n}@example.com", "name": f"Reader {n}"} for n in range(3)]
    response = client.post(
        "/api/campaigns/",
        {
            "name": "Autumn sale",
            "template": "campaign",
            "subject": "Autumn sale",
            "context": {"body": "Everything half price.", "headline": "Sale"},
            "recipients": recipients,
            "start": True,
            "remind_after": REMIND_AFTER,
        },
        content_type="application/json",
    )
    assert response.status_code == 202, response.content
    campaign_url = f"/api/campaigns/{response.json()['campaign_id']}/"
    assert response.json()["remind_after"] == REMIND_AFTER

    # when: it is done, its reminder job is scheduled and sleeps (parked: no worker held)
    done = wait_until(
        lambda: (c := client.get(campaign_url).json())["reminder_job_id"] and c,
        timeout=60,
        what="the campaign to be done with its reminder scheduled",
    )
    assert done["status"] == "done" and done["summary"]["sent"] == 3
    reminder_url = done["reminder_status_url"]
    parked = wait_until(
        lambda: (j := client.get(reminder_url).json())["state"] == "scheduled" and j,
        timeout=30,
        what="the reminder job to sleep",
    )
    [sleep] = parked["steps"]
    assert sleep["kind"] == "sleep" and sleep["state"] == "sleeping"
    assert len(mailbox.received()) == 3  # no reminder before its time
    wake_at = datetime.fromisoformat(sleep["wake_at"])

    # then: after the sleep, each recipient gets one reminder, and the job succeeded
    finished = wait_until(
        lambda: (j := client.get(reminder_url).json())["state"] == "succeeded" and j,
        timeout=60,
        what="the reminder job to finish",
    )
    assert finished["result"] == 3 and finished["attempts"] == 1
    assert [(s["name"], s["kind"], s["state"]) for s in finished["steps"]] == [
        (sleep["name"], "sleep", "succeeded"),
        ("remind", "step", "succeeded"),
    ]
    wait_until(lambda: len(mailbox.received()) == 6, timeout=60, what="the three reminders")
    reminders = [m for m in mailbox.received() if m["Subject"] == "Reminder: Autumn sale"]
    assert sorted(m["To"] for m in reminders) == [r["email"] for r in recipients]
    reminded = EmailMessage.objects.filter(reminded__isnull=False)
    assert all(m.sent_at is not None and m.sent_at >= wake_at for m in reminded), [
        (m.sent_at, wake_at) for m in reminded
    ]

    # and running the reminder step again (a retry, a replay) queues nobody twice
    campaign_id = done["campaign_id"]
    assert services.campaign_remind_run(campaign_id=campaign_id, send_job=email_send_job) == 0
    assert CampaignRecipient.objects.filter(reminder_message__isnull=False).count() == 3
    assert Job.objects.filter(task_name="emails.campaign_remind").count() == 1


@pytest.mark.django_db
def test_a_reminder_time_out_of_range_is_refused_and_nothing_is_created(client, admin_user):
    client.force_login(admin_user)
    for bad in (0, 30 * 86_400 + 1):
        response = client.post(
            "/api/campaigns/",
            {"name": "Bad", "recipients": [], "remind_after": bad},
            content_type="application/json",
        )
        assert response.status_code == 422, response.content
        assert "remind_after" in response.content.decode()
    assert not Campaign.objects.exists()
