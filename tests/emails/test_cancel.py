"""Cancel a campaign half-sent, on a real worker and a real SMTP server: the messages sent stay
sent, the rest never go out (counted on the server), and every row says which it was."""

from __future__ import annotations

import time
from typing import Any

import pytest

from emails import services
from emails.models import Campaign, CampaignStatus, EmailMessage, EmailStatus
from emails.tasks import campaign_fan_out_job, email_send_job
from jobs.models import Job, JobState
from tests.conftest import wait_until

RECIPIENTS = 40
# The server takes this many messages, then holds every later one at RCPT until released.
TAKEN_BEFORE_HOLD = 10
# How long the server's count is watched after the release, for a message that went out late.
WATCH_SECONDS = 3.0


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("sender", password="not-used-here")


def hold_after(mailbox: Any, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """Make the server hold every message at RCPT once it has taken `count` (aiosmtpd looks the
    handler's hooks up per connection, and each send opens one)."""
    take = mailbox.handle_DATA

    async def handle_DATA(server: Any, session: Any, envelope: Any) -> str:
        reply = await take(server, session, envelope)
        if len(mailbox.received()) >= count:
            mailbox.hold_at = "rcpt"
        return str(reply)

    monkeypatch.setattr(mailbox, "handle_DATA", handle_DATA)


def send_jobs_active() -> int:
    return (
        Job.objects.filter(task_name="emails.send")
        .exclude(state__in=[JobState.SUCCEEDED, JobState.CANCELLED, JobState.DEAD])
        .count()
    )


def test_cancelling_a_half_sent_campaign_stops_the_rest(worker, mailbox, monkeypatch, client, user):
    # given a campaign of 40 whose server takes 10 messages, then holds the next ones
    hold_after(mailbox, monkeypatch, TAKEN_BEFORE_HOLD)
    campaign = services.campaign_create(
        name="Half",
        template="campaign",
        context={"headline": "News", "body": "Hello"},
        owner=user,
        recipients=[{"email": f"r{n}@example.com"} for n in range(RECIPIENTS)],
    )
    services.campaign_start(campaign=campaign, owner=user, fan_out_job=campaign_fan_out_job)
    wait_until(mailbox.held.is_set, timeout=60, what="the server to hold a message")
    wait_until(
        lambda: EmailMessage.objects.filter(recipient__campaign=campaign).count() == RECIPIENTS,
        what="every recipient to be fanned out",
    )
    client.force_login(user)
    page = client.get(f"/emails/campaigns/{campaign.pk}/").content.decode()
    assert 'id="cancel"' in page

    # when its owner presses Cancel, and then the server lets the held messages through
    response = client.post(f"/emails/campaigns/{campaign.pk}/cancel", follow=True)
    mailbox.release.set()

    # then the page says so, and the server got exactly the messages marked sent
    body = response.content.decode()
    assert "Campaign cancelled" in body and 'id="cancel"' not in body
    wait_until(lambda: send_jobs_active() == 0, timeout=60, what="every send job to end")
    sent = EmailMessage.objects.filter(recipient__campaign=campaign, status=EmailStatus.SENT)
    deadline = time.monotonic() + WATCH_SECONDS
    while time.monotonic() < deadline:  # bounded: nothing else goes out later
        assert len(mailbox.received()) == sent.count()
        time.sleep(0.1)
    delivered = {m["Message-ID"] for m in mailbox.received()}
    assert delivered == {m.provider_message_id for m in sent}
    # the held messages never got to DATA: they are cancelled with the rest
    assert TAKEN_BEFORE_HOLD <= sent.count() < RECIPIENTS
    print(f"\n{sent.count()} of {RECIPIENTS} sent before the cancel; the rest cancelled")
    statuses = set(
        EmailMessage.objects.filter(recipient__campaign=campaign).values_list("status", flat=True)
    )
    assert statuses == {EmailStatus.SENT, EmailStatus.CANCELLED}
    jobs = Job.objects.filter(task_name="emails.send")
    assert jobs.filter(state=JobState.SUCCEEDED).count() == sent.count()
    assert jobs.filter(state=JobState.CANCELLED).count() == RECIPIENTS - sent.count()
    campaign.refresh_from_db()
    assert campaign.status == CampaignStatus.CANCELLED
    assert campaign.summary() == {
        "total": RECIPIENTS,
        "sent": sent.count(),
        "failed": 0,
        "cancelled": RECIPIENTS - sent.count(),
        "pending": 0,
    }
    api = client.get(f"/api/campaigns/{campaign.pk}/").json()
    assert api["status"] == "cancelled" and api["summary"]["pending"] == 0
    # a second press: it already finished
    again = client.post(f"/emails/campaigns/{campaign.pk}/cancel", follow=True).content.decode()
    assert "already finished" in again


def test_a_fan_out_cancelled_through_the_jobs_api_cancels_its_campaign(
    transactional_db, clean_redis, client, user
):
    # given a started campaign whose fan-out job waits (scheduled a minute ahead)
    campaign = services.campaign_create(
        name="Never", template="campaign", context={}, owner=user,
        recipients=[{"email": "a@example.com"}, {"email": "b@example.com"}],
    )  # fmt: skip
    handle = campaign_fan_out_job.using(owner=user, delay=60).enqueue(campaign.pk)
    assert campaign.mark_sending(job_id=handle.id)

    # when the fan-out job is cancelled through the generic jobs API
    client.force_login(user)
    assert client.post(f"/api/jobs/{handle.id}/cancel").status_code == 202

    # then its hook cancelled the campaign, and a late run of the fan-out queues nothing
    campaign = Campaign.objects.get(pk=campaign.pk)
    assert campaign.status == CampaignStatus.CANCELLED
    assert campaign.summary()["cancelled"] == 2 and campaign.summary()["pending"] == 0
    assert services.campaign_fan_out_run(campaign_id=campaign.pk, send_job=email_send_job) == 0
    assert not EmailMessage.objects.exists()
