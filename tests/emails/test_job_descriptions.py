"""How "My jobs" names the jobs of emails (emails.job_descriptions, registered through
jobs.describe_jobs): a send by its subject and recipient, linking its campaign's page (the
email page when it has none), an import and a campaign's finish by the campaign's name."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest

from emails import services
from emails.models import CampaignRecipient, EmailMessage, RecipientImport
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db


def labels(client: Any, kind: str) -> list[tuple[str, str]]:
    """(link, text) of each job's name on "My jobs" filtered by `kind`."""
    html = client.get("/jobs/", {"kind": kind}).content.decode()
    return re.findall(r'<a data-field="label" href="(/[^"]*)">([^<]+)</a>', html)


def test_sends_imports_and_finishes_read_as_their_campaign(client: Any, django_user_model: Any):
    user = django_user_model.objects.create_user("namer", password="not-used-here")
    campaign = services.campaign_create(
        name="Autumn news",
        template="campaign",
        context={"headline": "News", "body": "Hello"},
        owner=user,
        recipients=[{"email": "ann@example.com"}],
    )
    in_campaign = EmailMessage.objects.create(
        to="ann@example.com", subject="Autumn", template="campaign", owner=user
    )
    CampaignRecipient.objects.filter(campaign=campaign).update(email_message=in_campaign)
    alone = EmailMessage.objects.create(
        to="bo@example.com", subject="Hi Bo", template="campaign", owner=user
    )
    # a send of POST /api/emails/ names its message by uid
    by_uid = EmailMessage.objects.create(
        to="cy@example.com", subject="Hi Cy", template="campaign", owner=user
    )
    upload = RecipientImport.objects.create(campaign=campaign, file="x.csv", owner=user)
    for task, args in (
        ("emails.send", [in_campaign.pk]),
        ("emails.send", [alone.pk]),
        ("emails.send", [str(by_uid.uid)]),
        ("emails.recipients_import", [upload.pk]),
        ("emails.campaign_done", [str(uuid.uuid4()), campaign.pk]),
    ):
        Job.objects.create(
            task_name=task, args=args, queue="emails", owner=user, state=JobState.SUCCEEDED
        )
    client.force_login(user)
    page = f"/emails/campaigns/{campaign.pk}/"

    assert sorted(labels(client, "Email")) == sorted(
        [
            (page, "Autumn → ann@example.com"),
            ("/emails/", "Hi Bo → bo@example.com"),
            ("/emails/", "Hi Cy → cy@example.com"),
        ]
    )
    assert labels(client, "Import") == [(page, "Recipients for Autumn news")]
    assert labels(client, "Campaign") == [(page, "Autumn news: finish")]


def test_the_job_page_names_the_campaign(client: Any, django_user_model: Any) -> None:
    user = django_user_model.objects.create_user("pager", password="not-used-here")
    campaign = services.campaign_create(
        name="Winter news", template="campaign", context={"headline": "N", "body": "B"}, owner=user
    )
    job = Job.objects.create(
        task_name="emails.campaign_fan_out", args=[campaign.pk], queue="emails", owner=user
    )
    client.force_login(user)

    html = client.get(f"/jobs/{job.id}/").content.decode()

    described = html.split('id="described"', 1)[1].split("</p>", 1)[0]
    assert '<span class="muted">Campaign</span>' in described
    assert f'<a href="/emails/campaigns/{campaign.pk}/">Winter news</a>' in described
