"""Cancel a half-sent campaign through the job its start answered with (the fan-out job, which
had ended as soon as every message was queued) and through the campaigns API's own cancel
route: the sent stay sent (counted on the real SMTP server), the rest never go out, the job
reads cancelled, and once nothing is left a cancel is 409."""

from __future__ import annotations

import time
from typing import Any

import pytest

from emails import services
from emails.models import Campaign, CampaignStatus, EmailMessage, EmailStatus
from emails.tasks import campaign_fan_out_job
from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.emails.test_cancel import (
    RECIPIENTS,
    TAKEN_BEFORE_HOLD,
    WATCH_SECONDS,
    hold_after,
    send_jobs_active,
)


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("api-sender", password="not-used-here")


def half_sent(mailbox: Any, monkeypatch: Any, user: Any) -> Campaign:
    """A campaign of 40 whose server took 10 messages and holds the next; all fanned out."""
    hold_after(mailbox, monkeypatch, TAKEN_BEFORE_HOLD)
    campaign = services.campaign_create(
        name="Half via API",
        template="campaign",
        context={"headline": "News", "body": "Hello"},
        owner=user,
        recipients=[{"email": f"r{n}@example.com"} for n in range(RECIPIENTS)],
    )
    services.campaign_start(campaign=campaign, owner=user, fan_out_job=campaign_fan_out_job)
    wait_until(mailbox.held.is_set, timeout=60, what="the server to hold a message")
    campaign.refresh_from_db()
    wait_until(
        lambda: Job.objects.get(id=str(campaign.job_id)).state == JobState.SUCCEEDED,
        what="the fan-out job to end",
    )
    return campaign


def sent_stay_sent(mailbox: Any, campaign: Campaign) -> int:
    wait_until(lambda: send_jobs_active() == 0, timeout=60, what="every send job to end")
    sent = EmailMessage.objects.filter(recipient__campaign=campaign, status=EmailStatus.SENT)
    deadline = time.monotonic() + WATCH_SECONDS
    while time.monotonic() < deadline:  # bounded: nothing else goes out later
        assert len(mailbox.received()) == sent.count()
        time.sleep(0.1)
    assert {m["Message-ID"] for m in mailbox.received()} == {m.provider_message_id for m in sent}
    assert TAKEN_BEFORE_HOLD <= sent.count() < RECIPIENTS
    statuses = set(
        EmailMessage.objects.filter(recipient__campaign=campaign).values_list("status", flat=True)
    )
    assert statuses == {EmailStatus.SENT, EmailStatus.CANCELLED}
    return sent.count()


def test_cancelling_the_campaigns_job_stops_the_unsent(worker, mailbox, monkeypatch, client, user):
    # given a half-sent campaign whose fan-out job has ended: it waits on its sends
    campaign = half_sent(mailbox, monkeypatch, user)
    client.force_login(user)
    job_url = f"/api/jobs/{campaign.job_id}/"
    assert client.get(job_url).json()["state"] == "waiting_children"

    # when the job is cancelled through the jobs API, and the server lets the held through
    response = client.post(f"{job_url}cancel")
    mailbox.release.set()

    # then 202, the sent stay sent, the rest never went out, and everything reads cancelled
    assert response.status_code == 202, response.content
    sent = sent_stay_sent(mailbox, campaign)
    print(f"\n{sent} of {RECIPIENTS} sent before the API's cancel")
    campaign.refresh_from_db()
    assert campaign.status == CampaignStatus.CANCELLED
    assert client.get(job_url).json()["state"] == "cancelled"
    listed = {item["job_id"]: item for item in client.get("/api/jobs/").json()["items"]}
    assert listed[str(campaign.job_id)]["state"] == "cancelled"
    assert client.post(f"{job_url}cancel").status_code == 409
    assert client.post(f"/api/campaigns/{campaign.pk}/cancel").status_code == 409


def test_the_campaigns_cancel_route_stops_the_unsent(worker, mailbox, monkeypatch, client, user):
    campaign = half_sent(mailbox, monkeypatch, user)
    client.force_login(user)

    response = client.post(f"/api/campaigns/{campaign.pk}/cancel")
    mailbox.release.set()

    assert response.status_code == 202, response.content
    assert response.json()["status"] == "cancelled"
    sent_stay_sent(mailbox, campaign)
    assert client.get(f"/api/jobs/{campaign.job_id}/").json()["state"] == "cancelled"
