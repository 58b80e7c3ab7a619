"""How "My jobs" names the jobs of emails (jobs.describe_jobs): a campaign's fan-out and its
finish by the campaign's name, a send by its subject and recipient, an import by its campaign;
each links the campaign's page (a send without a campaign: the email page). One query per task
per page. Registered by EmailsConfig.ready()."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from django.db.models import Q
from django.urls import reverse

from jobs import JobDescription, describe_jobs

from .models import Campaign, EmailMessage, RecipientImport


def _arg(job: Any, name: str, index: int) -> Any:
    """The job's argument `name`, passed by keyword or at position `index`."""
    if name in job.kwargs:
        return job.kwargs[name]
    return job.args[index] if len(job.args) > index else None


def _campaign_url(campaign_id: int) -> str:
    return reverse("emails:campaign", kwargs={"campaign_id": campaign_id})


def _by_campaign(jobs: Sequence[Any], index: int, suffix: str = "") -> dict[Any, JobDescription]:
    wanted = {job.id: _arg(job, "campaign_id", index) for job in jobs}
    names = dict(
        Campaign.objects.filter(pk__in=[c for c in wanted.values() if c is not None]).values_list(
            "pk", "name"
        )
    )
    return {
        key: JobDescription(names[campaign_id] + suffix, _campaign_url(campaign_id))
        for key, campaign_id in wanted.items()
        if campaign_id in names
    }


def describe_fan_outs(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    return _by_campaign(jobs, 0)


def describe_campaign_finishes(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    # a batch callback, (batch id, campaign id): it marks the campaign done
    return _by_campaign(jobs, 1, suffix=": finish")


def _message_key(email: Any) -> int | str | None:
    """A send names its message by id, or by uid (EmailMessageQuerySet.named)."""
    if isinstance(email, int) or (isinstance(email, str) and email.isdigit()):
        return int(email)
    try:
        return str(uuid.UUID(email))
    except (TypeError, ValueError, AttributeError):
        return None


def describe_sends(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    wanted = {job.id: _message_key(_arg(job, "email_id", 0)) for job in jobs}
    ids = [e for e in wanted.values() if isinstance(e, int)]
    uids = [e for e in wanted.values() if isinstance(e, str)]
    rows: dict[int | str, tuple[str, str, int | None]] = {}
    for pk, uid, subject, to, campaign in EmailMessage.objects.filter(
        Q(pk__in=ids) | Q(uid__in=uids)
    ).values_list("pk", "uid", "subject", "to", "recipient__campaign_id"):
        rows[pk] = rows[str(uid)] = (subject, to, campaign)
    found = {}
    for key, email_id in wanted.items():
        if email_id in rows:
            subject, to, campaign_id = rows[email_id]
            url = _campaign_url(campaign_id) if campaign_id else reverse("emails:index")
            found[key] = JobDescription(f"{subject} → {to}", url)
    return found


def describe_imports(jobs: Sequence[Any]) -> dict[Any, JobDescription]:
    wanted = {job.id: _arg(job, "import_id", 0) for job in jobs}
    rows = dict(
        RecipientImport.objects.filter(
            pk__in=[i for i in wanted.values() if i is not None]
        ).values_list("pk", "campaign_id")
    )
    names = dict(Campaign.objects.filter(pk__in=rows.values()).values_list("pk", "name"))
    return {
        key: JobDescription(f"Recipients for {names[rows[i]]}", _campaign_url(rows[i]))
        for key, i in wanted.items()
        if i in rows and rows[i] in names
    }


def register() -> None:
    describe_jobs("emails.campaign_fan_out", kind="Campaign", describe=describe_fan_outs)
    describe_jobs("emails.campaign_done", kind="Campaign", describe=describe_campaign_finishes)
    describe_jobs("emails.send", kind="Email", describe=describe_sends)
    describe_jobs("emails.recipients_import", kind="Import", describe=describe_imports)
