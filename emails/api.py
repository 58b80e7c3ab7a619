"""JSON API of emails: single messages, campaigns and recipient imports."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from ninja import File, Router, Schema, Status
from ninja.decorators import decorate_view
from ninja.errors import HttpError
from ninja.files import UploadedFile
from pydantic import BaseModel, EmailStr, Field

from config.api_types import AuthenticatedRequest
from jobs import InvalidPayload
from web.api_input import body_limit
from web.uploads import upload_limited

from . import services
from .models import Campaign, EmailMessage, RecipientImport
from .tasks import campaign_fan_out_job, email_send_job, recipients_import_job

router = Router(tags=["emails"])

# Template variables stay small: they ride in the ledger and in every message.
MAX_CONTEXT_KEYS = 50
# A campaign's body may list 10,000 recipients of up to 254 + 200 characters: 5 MB; every other
# JSON body takes the API's default (API_MAX_BODY_BYTES, 1 MiB).
CAMPAIGN_MAX_BODY_BYTES = 5 * 1024 * 1024


# A plain pydantic model, not ninja's Schema: a body is a dict, which Schema's root validator
# (made for ORM objects) would wrap in a DjangoGetter for nothing on every POST /api/emails/.
class EmailIn(BaseModel):
    to: EmailStr
    template: str = Field(min_length=1, max_length=100)
    context: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, max_length=MAX_CONTEXT_KEYS
    )
    subject: str | None = Field(default=None, max_length=255)


class ErrorOut(Schema):
    detail: str


class Accepted(Schema):
    job_id: str
    status_url: str


class EmailAccepted(Accepted):
    email_id: int


class EmailOut(Schema):
    email_id: int
    status: str
    attempts: int
    subject: str
    job_id: str | None
    sent_at: Any = None
    error: str


def _bad_request(exc: Exception) -> HttpError:
    return HttpError(400, str(exc))


@router.post("/emails/", response={202: EmailAccepted}, url_name="email_create")
def email_create(request: AuthenticatedRequest, payload: EmailIn) -> Status:
    """Queue one templated email (HTML + text); 400 names the bad field, nothing is queued."""
    try:
        message, handle = services.email_queue(
            to=payload.to,
            template=payload.template,
            context=payload.context,
            subject=payload.subject,
            owner=request.auth,
            send_job=email_send_job,
        )
    except (services.EmailError, InvalidPayload) as exc:
        raise _bad_request(exc) from None
    # an instance of the response's schema is dumped as it is, not validated again (ninja)
    return Status(
        202, EmailAccepted(job_id=handle.id, email_id=message.pk, status_url=handle.status_url)
    )


@router.get("/emails/{email_id}/", response=EmailOut, url_name="email_detail")
def email_detail(request: AuthenticatedRequest, email_id: int) -> dict[str, Any]:
    message = get_object_or_404(EmailMessage.objects.visible_to(request.auth), pk=email_id)
    return {
        "email_id": message.pk,
        "status": message.status,
        "attempts": message.attempts,
        "subject": message.subject,
        "job_id": str(message.job_id) if message.job_id else None,
        "sent_at": message.sent_at,
        "error": message.error,
    }


class RecipientIn(Schema):
    email: EmailStr
    name: str = Field(default="", max_length=200)


class CampaignIn(Schema):
    name: str = Field(min_length=1, max_length=200)
    template: str = Field(default="campaign", max_length=100)
    subject: str = Field(default="", max_length=255)
    context: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, max_length=MAX_CONTEXT_KEYS
    )
    recipients: list[RecipientIn] = Field(default_factory=list, max_length=10_000)
    start: bool = False
    remind_after: int | None = Field(
        default=None,
        ge=1,
        le=services.MAX_REMIND_AFTER,
        description=(
            "Seconds after the campaign is done to email each recipient sent a reminder "
            "(its subject prefixed 'Reminder: '); none by default, at most 30 days."
        ),
    )


class CampaignOut(Schema):
    campaign_id: int
    name: str
    status: str
    error: str = Field(
        description="Why a failed campaign failed (its fan-out or completion job's error)."
    )
    summary: dict[str, int]
    job_id: str | None
    status_url: str | None
    batch_id: str | None
    batch_url: str | None
    remind_after: int | None
    reminder_job_id: str | None = Field(
        description="The reminder's job once the campaign is done: it sleeps, then sends."
    )
    reminder_status_url: str | None


def _campaign_out(campaign: Campaign) -> dict[str, Any]:
    """A campaign as the API shows it; reads only (done is derived, not saved)."""
    summary = campaign.summary()
    job_id = str(campaign.job_id) if campaign.job_id else None
    batch_id = str(campaign.batch_id) if campaign.batch_id else None
    reminder = str(campaign.reminder_job_id) if campaign.reminder_job_id else None
    return {
        "campaign_id": campaign.pk,
        "name": campaign.name,
        "status": campaign.status_shown(summary),
        "error": campaign.error,
        "summary": summary,
        "job_id": job_id,
        "status_url": f"/api/jobs/{job_id}/" if job_id else None,
        "batch_id": batch_id,
        "batch_url": f"/api/batches/{batch_id}/" if batch_id else None,
        "remind_after": campaign.remind_after,
        "reminder_job_id": reminder,
        "reminder_status_url": f"/api/jobs/{reminder}/" if reminder else None,
    }


@router.post(
    "/campaigns/", response={201: CampaignOut, 202: CampaignOut}, url_name="campaign_create"
)
@decorate_view(body_limit(CAMPAIGN_MAX_BODY_BYTES))
def campaign_create(request: AuthenticatedRequest, payload: CampaignIn) -> Status:
    """Create a campaign, optionally with recipients; `start: true` fans it out at once (202)."""
    try:
        campaign = services.campaign_create(
            name=payload.name,
            template=payload.template,
            subject=payload.subject,
            context=payload.context,
            owner=request.auth,
            recipients=[r.dict() for r in payload.recipients],
            remind_after=payload.remind_after,
        )
        if payload.start:
            services.campaign_start(
                campaign=campaign, owner=request.auth, fan_out_job=campaign_fan_out_job
            )
            campaign.refresh_from_db()
    except (services.EmailError, InvalidPayload) as exc:
        raise _bad_request(exc) from None
    return Status((202 if payload.start else 201), _campaign_out(campaign))


@router.get("/campaigns/{campaign_id}/", response=CampaignOut, url_name="campaign_detail")
def campaign_detail(request: AuthenticatedRequest, campaign_id: int) -> dict[str, Any]:
    """A campaign's progress: sent, failed and pending recipients."""
    return _campaign_out(
        get_object_or_404(Campaign.objects.visible_to(request.auth), pk=campaign_id)
    )


@router.post(
    "/campaigns/{campaign_id}/start", response={202: CampaignOut}, url_name="campaign_start"
)
def campaign_start(request: AuthenticatedRequest, campaign_id: int) -> Status:
    campaign = get_object_or_404(Campaign.objects.visible_to(request.auth), pk=campaign_id)
    try:
        services.campaign_start(
            campaign=campaign, owner=request.auth, fan_out_job=campaign_fan_out_job
        )
    except services.EmailError as exc:
        raise HttpError(409, str(exc)) from None
    campaign.refresh_from_db()
    return Status(202, _campaign_out(campaign))


@router.post(
    "/campaigns/{campaign_id}/cancel",
    response={202: CampaignOut, 409: ErrorOut},
    url_name="campaign_cancel",
)
def campaign_cancel(request: AuthenticatedRequest, campaign_id: int) -> Status:
    """Stop a sending campaign, as its page's Cancel button does: no more messages are fanned
    out or sent, those sent stay sent; 202 with the campaign. 409 when it is not sending."""
    campaign = get_object_or_404(Campaign.objects.visible_to(request.auth), pk=campaign_id)
    try:
        services.campaign_cancel(campaign=campaign, by=request.auth)
    except services.EmailError as exc:
        raise HttpError(409, str(exc)) from None
    campaign.refresh_from_db()
    return Status(202, _campaign_out(campaign))


class ImportAccepted(Accepted):
    import_id: int


class ImportOut(Schema):
    import_id: int
    status: str
    rows_read: int
    imported: int
    duplicates: int
    skipped: int
    errors: list[dict[str, Any]]
    job_id: str | None


@router.post(
    "/campaigns/{campaign_id}/recipients/import",
    response={202: ImportAccepted, 409: ErrorOut},
    url_name="recipients_import",
)
@decorate_view(upload_limited)
def recipients_import(
    request: AuthenticatedRequest, campaign_id: int, file: File[UploadedFile]
) -> Status:
    """Upload a CSV (header: email, name, ...); it is imported in the background.

    A file over BACKLOT_MAX_UPLOAD_BYTES is refused with 413 while it is read; nothing is kept.
    A campaign that is no longer a draft takes no recipients: 409. The import ends failed with
    the row number at a field over csv's limit, a line that is not UTF-8 or a row past
    EMAIL_IMPORT_MAX_ROWS.
    """
    campaign = get_object_or_404(Campaign.objects.visible_to(request.auth), pk=campaign_id)
    try:
        row, handle = services.recipients_import_create(
            campaign=campaign, upload=file, owner=request.auth, import_job=recipients_import_job
        )
    except services.CampaignNotDraft as exc:
        raise HttpError(409, str(exc)) from None
    return Status(202, {"import_id": row.pk, "job_id": handle.id, "status_url": handle.status_url})


@router.get(
    "/campaigns/{campaign_id}/imports/{import_id}/", response=ImportOut, url_name="import_detail"
)
def import_detail(
    request: AuthenticatedRequest, campaign_id: int, import_id: int
) -> dict[str, Any]:
    row = get_object_or_404(
        RecipientImport.objects.filter(campaign__in=Campaign.objects.visible_to(request.auth)),
        pk=import_id,
        campaign_id=campaign_id,
    )
    return {
        "import_id": row.pk,
        "status": row.status,
        "rows_read": row.rows_read,
        "imported": row.imported,
        "duplicates": row.duplicates,
        "skipped": row.skipped,
        "errors": row.errors,
        "job_id": str(row.job_id) if row.job_id else None,
    }
