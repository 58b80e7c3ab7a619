"""Outgoing email messages, campaigns, their recipients and CSV imports."""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Count
from django.utils import timezone


class OwnedQuerySet(models.QuerySet):
    def visible_to(self, user: Any) -> OwnedQuerySet:
        """Rows a user may see: their own, or all of them for staff."""
        if getattr(user, "is_staff", False):
            return self
        if not getattr(user, "is_authenticated", False):
            return self.none()
        return self.filter(owner=user)


class EmailStatus(models.TextChoices):
    """Where a message is on its way out."""

    QUEUED = "queued", "Queued"  # accepted, the send job waits
    SENDING = "sending", "Sending"  # the SMTP server has the envelope; the body is going out
    SENT = "sent", "Sent"  # the server accepted it (250); never sent again
    FAILED = "failed", "Failed"  # refused for good, or gave up retrying
    UNCONFIRMED = "unconfirmed", "Unconfirmed"  # a worker died mid-send: not resent automatically


class EmailMessage(models.Model):
    """One message to one recipient; the send job moves it and never sends a SENT one again."""

    uid = models.UUIDField(
        "message uid",
        default=uuid.uuid4,
        unique=True,
        editable=False,
        help_text="Used as the Message-ID, so the provider and the recipient can spot repeats.",
    )
    to = models.EmailField("to", help_text="Recipient address.")
    subject = models.CharField("subject", max_length=255, help_text="Rendered subject line.")
    template = models.CharField(
        "template", max_length=100, help_text="Name under templates/emails/."
    )
    context = models.JSONField("context", default=dict, blank=True, help_text="Template variables.")
    attachments = models.JSONField(
        "attachments", default=list, blank=True, help_text="Paths relative to MEDIA_ROOT."
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=EmailStatus.choices,
        default=EmailStatus.QUEUED,
        help_text="Queued, sending, sent, failed or unconfirmed.",
    )
    attempts = models.PositiveIntegerField("attempts", default=0, help_text="Send attempts made.")
    provider_message_id = models.CharField(
        "provider message id",
        max_length=255,
        blank=True,
        default="",
        help_text="Message-ID of the sent message.",
    )
    provider_reply = models.CharField(
        "provider reply", max_length=500, blank=True, default="", help_text="Last SMTP reply."
    )
    error = models.TextField("error", blank=True, default="", help_text="Why it failed (masked).")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="owner",
        help_text="Who asked for it.",
    )
    job_id = models.UUIDField("job id", null=True, blank=True, help_text="The send job.")
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Accepted.")
    sent_at = models.DateTimeField(
        "sent", null=True, blank=True, help_text="Accepted by the server."
    )

    objects = OwnedQuerySet.as_manager()

    class Meta:
        verbose_name = "email message"
        verbose_name_plural = "email messages"
        ordering = ("-created_at",)
        indexes = [models.Index(fields=["status", "created_at"], name="email_status_idx")]

    def __str__(self) -> str:
        return f"{self.template} #{self.pk} ({self.status})"

    def mark(self, status: str, **fields: Any) -> None:
        self.status = status
        for name, value in fields.items():
            setattr(self, name, value)
        self.save(update_fields=["status", *fields])


class CampaignStatus(models.TextChoices):
    DRAFT = "draft", "Draft"  # recipients may still be added
    SENDING = "sending", "Sending"  # fanned out; messages on their way
    DONE = "done", "Done"  # every recipient sent or failed


class Campaign(models.Model):
    """One message template sent to many recipients."""

    name = models.CharField("name", max_length=200, help_text="For operators.")
    subject = models.CharField(
        "subject", max_length=255, blank=True, help_text="Overrides the template's."
    )
    template = models.CharField(
        "template", max_length=100, help_text="Name under templates/emails/."
    )
    context = models.JSONField("context", default=dict, blank=True, help_text="Shared variables.")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="owner",
        help_text="Who created it.",
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=CampaignStatus.choices,
        default=CampaignStatus.DRAFT,
        help_text="Draft, sending or done.",
    )
    job_id = models.UUIDField("fan-out job", null=True, blank=True, help_text="The fan-out job.")
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Created.")
    started_at = models.DateTimeField("started", null=True, blank=True, help_text="Fan-out began.")

    objects = OwnedQuerySet.as_manager()

    class Meta:
        verbose_name = "campaign"
        verbose_name_plural = "campaigns"
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return self.name

    def summary(self) -> dict[str, int]:
        """Recipients by outcome: sent, failed, pending (not yet sent or failed), total."""
        counts = dict(
            self.recipients.values_list("email_message__status").annotate(n=Count("id")).order_by()
        )
        sent = counts.get(EmailStatus.SENT, 0)
        failed = counts.get(EmailStatus.FAILED, 0) + counts.get(EmailStatus.UNCONFIRMED, 0)
        total = sum(counts.values())
        return {"total": total, "sent": sent, "failed": failed, "pending": total - sent - failed}


class CampaignRecipient(models.Model):
    """A recipient of a campaign, unique per campaign: a re-import or re-run adds no one twice."""

    campaign = models.ForeignKey(
        Campaign,
        on_delete=models.CASCADE,
        related_name="recipients",
        verbose_name="campaign",
        help_text="The campaign.",
    )
    email = models.EmailField("email", help_text="Address (stored lower-cased).")
    name = models.CharField("name", max_length=200, blank=True, help_text="For the greeting.")
    data = models.JSONField("data", default=dict, blank=True, help_text="Extra CSV columns.")
    email_message = models.OneToOneField(
        EmailMessage,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="recipient",
        verbose_name="message",
        help_text="The message once fanned out.",
    )

    class Meta:
        verbose_name = "campaign recipient"
        verbose_name_plural = "campaign recipients"
        constraints = [
            models.UniqueConstraint(
                fields=["campaign", "email"], name="recipient_unique_per_campaign"
            )
        ]

    def __str__(self) -> str:
        return f"recipient #{self.pk}"


class ImportStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class RecipientImport(models.Model):
    """A CSV of recipients imported in the background, in chunks, bad rows reported."""

    campaign = models.ForeignKey(
        Campaign,
        on_delete=models.CASCADE,
        related_name="imports",
        verbose_name="campaign",
        help_text="Campaign the recipients join.",
    )
    file = models.CharField(
        "file", max_length=255, help_text="Uploaded CSV, relative to MEDIA_ROOT."
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=ImportStatus.choices,
        default=ImportStatus.QUEUED,
        help_text="Queued, running, done or failed.",
    )
    rows_read = models.PositiveIntegerField("rows read", default=0, help_text="Data rows read.")
    imported = models.PositiveIntegerField("imported", default=0, help_text="New recipients.")
    duplicates = models.PositiveIntegerField("duplicates", default=0, help_text="Already there.")
    skipped = models.PositiveIntegerField("skipped", default=0, help_text="Bad rows skipped.")
    errors = models.JSONField(
        "errors", default=list, blank=True, help_text="First bad rows: {row, reason}."
    )
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name="owner",
        help_text="Who uploaded it.",
    )
    job_id = models.UUIDField("job id", null=True, blank=True, help_text="The import job.")
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Uploaded.")
    finished_at = models.DateTimeField("finished", null=True, blank=True, help_text="Done.")

    class Meta:
        verbose_name = "recipient import"
        verbose_name_plural = "recipient imports"
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return f"import #{self.pk} ({self.status})"
