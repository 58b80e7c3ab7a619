"""Pages: send a test email, create a campaign, import recipients, start and follow it."""

from __future__ import annotations

from typing import Any

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.translation import ngettext
from django.views.decorators.http import require_POST

from jobs import InvalidPayload

from . import services
from .models import Campaign, EmailMessage
from .tasks import campaign_fan_out_job, email_send_job, recipients_import_job


def _templates() -> list[tuple[str, str]]:
    return [(name, name) for name in services.email_templates()]


class TestEmailForm(forms.Form):
    to = forms.EmailField(label="To")
    template = forms.ChoiceField(label="Template", choices=_templates)
    name = forms.CharField(label="Name in the greeting", required=False, max_length=100)


class CampaignForm(forms.Form):
    """Shown on the same page as TestEmailForm: its ids are prefixed (id_campaign_name), so the
    two `name` fields do not share id_name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("auto_id", "id_campaign_%s")
        super().__init__(*args, **kwargs)

    name = forms.CharField(max_length=200)
    headline = forms.CharField(label="Subject", max_length=200)
    body = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), max_length=5000)


class ImportForm(forms.Form):
    file = forms.FileField(label="CSV file (columns: email, name, …)")


@login_required
def index(request: HttpRequest) -> HttpResponse:
    form = TestEmailForm(request.POST or None, initial={"template": "test"})
    if request.method == "POST" and form.is_valid():
        try:
            _, handle = services.email_queue(
                to=form.cleaned_data["to"],
                template=form.cleaned_data["template"],
                context={"name": form.cleaned_data["name"]},
                owner=request.user,
                send_job=email_send_job,
            )
        except (services.EmailError, InvalidPayload) as exc:
            form.add_error(None, str(exc))
        else:
            messages.success(request, "Email queued.")
            return redirect("job_page", job_id=handle.id)
    return render(
        request,
        "emails/pages/index.html",
        {
            "form": form,
            "campaign_form": CampaignForm(),
            "campaigns": Campaign.objects.visible_to(request.user)[:20],
            "recent": EmailMessage.objects.visible_to(request.user).filter(recipient__isnull=True)[
                :10
            ],
        },
    )


@login_required
@require_POST
def campaign_create(request: HttpRequest) -> HttpResponse:
    form = CampaignForm(request.POST)
    if not form.is_valid():
        messages.error(
            request,
            "Fix the campaign form: "
            + "; ".join(
                f"{field}: {' '.join(str(error) for error in errors)}"
                for field, errors in form.errors.items()
            ),
        )
        return redirect("emails:index")
    campaign = services.campaign_create(
        name=form.cleaned_data["name"],
        template="campaign",
        owner=request.user,
        context={"headline": form.cleaned_data["headline"], "body": form.cleaned_data["body"]},
    )
    return redirect("emails:campaign", campaign_id=campaign.pk)


@login_required
def campaign_detail(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign = get_object_or_404(Campaign.objects.visible_to(request.user), pk=campaign_id)
    form = ImportForm(request.POST or None, request.FILES or None)
    if request.method == "POST" and form.is_valid():
        upload = form.cleaned_data["file"]
        if upload.size > settings.BACKLOT_MAX_UPLOAD_BYTES:
            form.add_error(
                "file", f"The file is larger than {settings.BACKLOT_MAX_UPLOAD_BYTES} bytes."
            )
        else:
            try:
                services.recipients_import_create(
                    campaign=campaign,
                    upload=upload,
                    owner=request.user,
                    import_job=recipients_import_job,
                )
            except services.CampaignNotDraft as exc:
                form.add_error("file", str(exc))
            else:
                messages.success(request, "Import started; the recipient count updates as it runs.")
                return redirect("emails:campaign", campaign_id=campaign.pk)
    return render(
        request,
        "emails/pages/campaign.html",
        {
            "campaign": campaign,
            "form": form,
            "imports": campaign.imports.all()[:10],
            "summary": campaign.summary(),
        },
    )


@login_required
@require_POST
def campaign_cancel(request: HttpRequest, campaign_id: int) -> HttpResponse:
    """The Cancel button of a sending campaign (its owner or staff): no more messages go out;
    those sent stay sent."""
    campaign = get_object_or_404(Campaign.objects.visible_to(request.user), pk=campaign_id)
    try:
        stopped = services.campaign_cancel(campaign=campaign, by=request.user)
    except services.EmailError:
        messages.info(request, f"The campaign already finished: it is {campaign.status}.")
    else:
        messages.success(
            request,
            ngettext(
                "Campaign cancelled; %(n)d message will not go out.",
                "Campaign cancelled; %(n)d messages will not go out.",
                stopped,
            )
            % {"n": stopped},
        )
    return redirect("emails:campaign", campaign_id=campaign.pk)


@login_required
@require_POST
def campaign_start(request: HttpRequest, campaign_id: int) -> HttpResponse:
    campaign = get_object_or_404(Campaign.objects.visible_to(request.user), pk=campaign_id)
    try:
        services.campaign_start(
            campaign=campaign, owner=request.user, fan_out_job=campaign_fan_out_job
        )
        messages.success(request, "Campaign started.")
    except services.EmailError as exc:
        messages.error(request, str(exc))
    return redirect("emails:campaign", campaign_id=campaign.pk)
