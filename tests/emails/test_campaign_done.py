"""The campaign's completion job (emails.campaign_done, its batch's on_complete callback) takes
the campaign with it: dead-lettered, the campaign ends failed with the reason; cancelled, it
ends cancelled."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from emails import services
from emails.models import Campaign, CampaignStatus
from emails.tasks import campaign_done_job, campaign_fan_out_job
from jobs.models import Job, JobState
from tests.conftest import wait_until
from tests.support.refusals import status_refused


@pytest.fixture
def user(django_user_model: Any) -> Any:
    return django_user_model.objects.create_user("completer", password="not-used-here")


def test_a_campaign_whose_completion_job_dies_ends_failed_with_the_reason(
    worker, mailbox, client, user
):
    campaign = services.campaign_create(
        name="never done",
        template="campaign",
        context={"body": "Hello!", "headline": "News"},
        owner=user,
        recipients=[{"email": "one@example.com"}],
    )
    client.force_login(user)
    # given a database that refuses to mark any campaign done: the completion job's write fails
    with status_refused(Campaign, CampaignStatus.DONE):
        # when the campaign is sent and its batch completes
        services.campaign_start(campaign=campaign, fan_out_job=campaign_fan_out_job)
        # then, once the completion job is dead, the campaign reads failed, with the reason
        body = wait_until(
            lambda: (
                (b := client.get(f"/api/campaigns/{campaign.pk}/").json())["status"] == "failed"
                and b
            ),
            timeout=60,
            what="the campaign to fail",
        )
    [done] = Job.objects.filter(task_name="emails.campaign_done")
    assert done.state == JobState.DEAD and done.args[1] == campaign.pk  # (batch, campaign)
    assert body["error"].startswith("the completion job gave up: IntegrityError: ")
    assert body["summary"]["sent"] == 1  # what was sent stays sent
    assert len(mailbox.received()) == 1


def test_cancelling_a_waiting_completion_job_cancels_its_campaign(worker, client, user):
    # given a sending campaign whose completion job waits (batch id first, campaign id second)
    campaign = services.campaign_create(
        name="stopped", template="campaign", context={}, owner=user, recipients=[]
    )
    campaign.mark_sending(job_id=str(uuid.uuid4()))
    handle = campaign_done_job.using(owner=user, delay=600).enqueue(str(uuid.uuid4()), campaign.pk)
    client.force_login(user)

    # when it is cancelled through the jobs API
    response = client.post(f"/api/jobs/{handle.id}/cancel")

    # then the campaign reads cancelled
    assert response.status_code == 202, response.content
    assert client.get(f"/api/jobs/{handle.id}/").json()["state"] == "cancelled"
    assert client.get(f"/api/campaigns/{campaign.pk}/").json()["status"] == "cancelled"
