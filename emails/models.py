"""Outgoing email messages, campaigns, their recipients and CSV imports."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Count, Exists, F, OuterRef, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone

from jobs import OwnedQuerySet
from jobs.core.states import JobState
from jobs.models import Batch, Job

# The fan-out job's name: it is a member of its campaign's batch (keeping it open while it
# fans out), and the summary leaves it out of the recipients' counts.
FAN_OUT_TASK = "emails.campaign_fan_out"


class EmailStatus(models.TextChoices):
    """Where a message is on its way out.

    queued -> sending -> sent; queued/sending -> queued (deferred: retried), -> failed (refused,
    or the job gave up); sending -> unconfirmed (the body may have arrived: never resent);
    queued -> cancelled (its send job was cancelled before the body went out).
    """

    QUEUED = "queued", "Queued"  # accepted, the send job waits (or waits for its next attempt)
    SENDING = "sending", "Sending"  # the SMTP server has the envelope; the body is going out
    SENT = "sent", "Sent"  # the server accepted it (250); never sent again
    FAILED = "failed", "Failed"  # refused for good, or the send job gave up retrying
    UNCONFIRMED = "unconfirmed", "Unconfirmed"  # a worker died mid-send: not resent automatically
    CANCELLED = "cancelled", "Cancelled"  # its send job was cancelled; it never went out


# A message in one of these will not move again on its own: its recipient is no longer pending.
FINISHED_EMAIL_STATUSES = (
    EmailStatus.SENT,
    EmailStatus.FAILED,
    EmailStatus.UNCONFIRMED,
    EmailStatus.CANCELLED,
)


def _move(row: models.Model, sources: Collection[str], **changes: object) -> bool:
    """Apply `changes` to `row` if its status is still one of `sources`; True if it moved.

    One guarded UPDATE, so two workers racing cannot both move the same row; the instance
    follows only when the database did.
    """
    moved = type(row)._default_manager.filter(pk=row.pk, status__in=sources).update(**changes)
    if moved:
        for name, value in changes.items():
            if not hasattr(value, "resolve_expression"):  # an F() expression: set by the caller
                setattr(row, name, value)
    return bool(moved)


class EmailMessageQuerySet(OwnedQuerySet["EmailMessage"]):
    def named(self, email: int | str) -> EmailMessageQuerySet:
        """The message a send job names: by its id (a campaign's or a report's sends), or by
        its uid (POST /api/emails/ and the send form, which insert the message in the job's
        own statement, before its id is known)."""
        if isinstance(email, str) and not email.isdigit():
            return self.filter(uid=email)
        return self.filter(pk=int(email))


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
        help_text="Queued, sending, sent, failed, unconfirmed or cancelled.",
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

    objects = EmailMessageQuerySet.as_manager()

    class Meta:
        verbose_name = "email message"
        verbose_name_plural = "email messages"
        ordering = ("-created_at",)
        indexes = [models.Index(fields=["status", "created_at"], name="email_status_idx")]

    def __str__(self) -> str:
        return f"{self.template} #{self.pk} ({self.status})"

    # --- state changes (each a guarded UPDATE "from X to Y"; True if the row moved) -------
    def count_attempt(self) -> bool:
        """queued: a send attempt starts (attempts + 1)."""
        moved = _move(self, [EmailStatus.QUEUED], attempts=F("attempts") + 1)
        if moved:
            self.attempts += 1
        return moved

    def mark_sending(self) -> bool:
        """queued -> sending: the server took the envelope; the body goes out now."""
        return _move(self, [EmailStatus.QUEUED], status=EmailStatus.SENDING)

    def mark_sent(self, *, provider_message_id: str, provider_reply: str) -> bool:
        """queued/sending -> sent: the server accepted the message (queued: a backend with no
        SMTP conversation, e.g. the console in development)."""
        return _move(
            self,
            [EmailStatus.QUEUED, EmailStatus.SENDING],
            status=EmailStatus.SENT,
            sent_at=timezone.now(),
            provider_message_id=provider_message_id,
            provider_reply=provider_reply,
            error="",
        )

    def mark_deferred(self, *, provider_reply: str) -> bool:
        """queued/sending -> queued: a transient refusal or no server; the job tries again."""
        return _move(
            self,
            [EmailStatus.QUEUED, EmailStatus.SENDING],
            status=EmailStatus.QUEUED,
            provider_reply=provider_reply,
        )

    def mark_refused(self, *, provider_reply: str, error: str) -> bool:
        """queued/sending -> failed: the server refused it for good (5xx)."""
        return _move(
            self,
            [EmailStatus.QUEUED, EmailStatus.SENDING],
            status=EmailStatus.FAILED,
            provider_reply=provider_reply,
            error=error,
        )

    def mark_unconfirmed(self, *, error: str) -> bool:
        """sending -> unconfirmed: the body may have arrived (a worker died, or the connection
        dropped during DATA); an operator checks before anything is sent again."""
        return _move(self, [EmailStatus.SENDING], status=EmailStatus.UNCONFIRMED, error=error)

    def mark_failed(self, *, error: str) -> bool:
        """queued -> failed: the send job gave up (sent and unconfirmed messages stay)."""
        return _move(self, [EmailStatus.QUEUED], status=EmailStatus.FAILED, error=error)

    def mark_cancelled(self) -> bool:
        """queued -> cancelled: its send job was cancelled before the body went out (a sent,
        sending or unconfirmed message stays as it is)."""
        return _move(self, [EmailStatus.QUEUED], status=EmailStatus.CANCELLED)


class CampaignStatus(models.TextChoices):
    """Where a campaign is: draft -> sending (started) -> done (no recipient pending), or
    sending -> cancelled (stopped: recipients sent stay sent, the pending ones are cancelled)."""

    DRAFT = "draft", "Draft"  # recipients may still be added; not started
    SENDING = "sending", "Sending"  # started: the fan-out job queues one message per recipient
    DONE = "done", "Done"  # every recipient sent or failed (the batch's on_complete callback)
    CANCELLED = "cancelled", "Cancelled"  # stopped before every recipient was sent
    FAILED = "failed", "Failed"  # its fan-out job gave up: see `error` (those sent stay sent)


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
        help_text="Draft, sending, done, cancelled or failed.",
    )
    error = models.TextField(
        "error", blank=True, default="", help_text="Why it failed: its fan-out job's last error."
    )
    job_id = models.UUIDField("fan-out job", null=True, blank=True, help_text="The fan-out job.")
    batch_id = models.UUIDField(
        "batch",
        null=True,
        blank=True,
        help_text="The batch of its fan-out and send jobs; its counters are the summary.",
    )
    created_at = models.DateTimeField("created", default=timezone.now, help_text="Created.")
    started_at = models.DateTimeField("started", null=True, blank=True, help_text="Fan-out began.")
    remind_after = models.PositiveIntegerField(
        "remind after",
        null=True,
        blank=True,
        help_text="Seconds after the campaign is done to send its recipients a reminder.",
    )
    reminder_job_id = models.UUIDField(
        "reminder job",
        null=True,
        blank=True,
        help_text="The job that sleeps until the reminder is due, then sends it.",
    )

    objects = OwnedQuerySet.as_manager()

    class Meta:
        verbose_name = "campaign"
        verbose_name_plural = "campaigns"
        ordering = ("-created_at",)

    def __str__(self) -> str:
        return self.name

    def mark_sending(self, *, job_id: str, batch_id: uuid.UUID | None = None) -> bool:
        """draft -> sending: started, fanned out by the job `job_id`, a member of the batch
        `batch_id` that its send jobs join."""
        return _move(
            self,
            [CampaignStatus.DRAFT],
            status=CampaignStatus.SENDING,
            started_at=timezone.now(),
            job_id=job_id,
            batch_id=batch_id,
        )

    def mark_cancelled(self) -> bool:
        """sending -> cancelled: someone cancelled it; no more messages are fanned out or sent
        (those already sent stay sent)."""
        return _move(self, [CampaignStatus.SENDING], status=CampaignStatus.CANCELLED)

    def mark_failed(self, *, error: str) -> bool:
        """sending -> failed: its fan-out job gave up (dead-lettered); the messages it queued
        go on, the recipients it never reached stay unsent."""
        return _move(self, [CampaignStatus.SENDING], status=CampaignStatus.FAILED, error=error)

    def mark_done(self) -> bool:
        """sending -> done: the campaign's batch completed (every send job and the fan-out job
        ended), so no recipient is pending, unless the fan-out gave up before every recipient
        had a message: then it stays sending (the summary shows them pending).

        Called by the batch's on_complete callback, which fires exactly once. A campaign
        started before batches (no batch_id) is settled after each message's outcome instead:
        its EXISTS stops at the first pending recipient.
        """
        unfanned = CampaignRecipient.objects.filter(campaign=OuterRef("pk"))
        if self.batch_id is None:
            unfanned = unfanned.exclude(email_message__status__in=FINISHED_EMAIL_STATUSES)
        else:
            unfanned = unfanned.filter(email_message__isnull=True)
        moved = (
            Campaign.objects.filter(pk=self.pk, status=CampaignStatus.SENDING)
            .exclude(Exists(unfanned))
            .update(status=CampaignStatus.DONE)
        )
        if moved:
            self.status = CampaignStatus.DONE
        return bool(moved)

    def status_shown(self, summary: dict[str, int]) -> str:
        """The status to show: a sending campaign with no recipient pending reads as done.

        Derived on read from `summary()`, never saved by the read: it covers the moment between
        the last message's outcome and the send job's mark_done().
        """
        if self.status == CampaignStatus.SENDING and summary["total"] and not summary["pending"]:
            return CampaignStatus.DONE
        return self.status

    def summary(self) -> dict[str, int]:
        """Recipients by outcome: sent, failed, cancelled, pending (none of those yet), total.

        Read from the campaign's batch: its counters move in the same transaction as each send
        job's finish, so they never drift. sent = members succeeded, failed = dead (refused,
        unconfirmed, out of attempts), cancelled = cancelled, each without the fan-out job;
        total is the recipients, so those not fanned out yet are pending. A campaign started
        before batches counts its messages' statuses instead.
        """
        if self.batch_id is None:
            return self._summary_from_messages()
        total = self.recipients.count()
        # The counters and the fan-out job's state in one statement, so one snapshot: the
        # fan-out's end moves both in one transaction, and two reads could straddle it (the
        # counters read before it, the job after: "sent" -1 and one recipient too many pending).
        ended = [state.value for state in (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)]
        fan_out = Job.objects.filter(batch_id=OuterRef("id"), task_name=FAN_OUT_TASK).order_by()
        row = (
            Batch.objects.filter(id=self.batch_id)
            .annotate(
                **{
                    f"fan_out_{state}": Coalesce(
                        Subquery(
                            fan_out.filter(state=state)
                            .values("batch_id")
                            .annotate(n=Count("id"))
                            .values("n")
                        ),
                        0,
                    )
                    for state in ended
                }
            )
            .values("succeeded", "dead", "cancelled", *(f"fan_out_{state}" for state in ended))
            .first()
        )
        if row is None:  # the batch was purged: the messages still know
            return self._summary_from_messages()
        sent, failed, cancelled = (
            row[outcome] - row[f"fan_out_{state}"]
            for outcome, state in zip(("succeeded", "dead", "cancelled"), ended, strict=True)
        )
        return self._summarised(total=total, sent=sent, failed=failed, cancelled=cancelled)

    def _summary_from_messages(self) -> dict[str, int]:
        counts = dict(
            self.recipients.values_list("email_message__status").annotate(n=Count("id")).order_by()
        )
        return self._summarised(
            total=sum(counts.values()),
            sent=counts.get(EmailStatus.SENT, 0),
            failed=counts.get(EmailStatus.FAILED, 0) + counts.get(EmailStatus.UNCONFIRMED, 0),
            cancelled=counts.get(EmailStatus.CANCELLED, 0),
        )

    def _summarised(self, *, total: int, sent: int, failed: int, cancelled: int) -> dict[str, int]:
        if self.status == CampaignStatus.CANCELLED:
            cancelled = total - sent - failed  # nothing pending: the rest never goes out
        return {
            "total": total,
            "sent": sent,
            "failed": failed,
            "cancelled": cancelled,
            "pending": total - sent - failed - cancelled,
        }


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
    reminder_message = models.OneToOneField(
        EmailMessage,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="reminded",
        verbose_name="reminder",
        help_text="The reminder's message once sent out.",
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
    """Where a CSV import is: queued -> running -> done or failed (a rerun starts it again)."""

    QUEUED = "queued", "Queued"  # uploaded; the import job waits
    RUNNING = "running", "Running"  # reading the file in chunks; the counts rise as it goes
    DONE = "done", "Done"  # every row read: imported, duplicate or skipped (see `errors`)
    FAILED = "failed", "Failed"  # cannot be imported (see the last error's row and reason), or
    # its job was dead-lettered or cancelled


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

    # --- state changes (each a guarded UPDATE "from X to Y"; True if the row moved) -------
    def mark_running(self) -> bool:
        """queued/running/failed -> running, counts reset: an attempt (or a replay) starts."""
        return _move(
            self,
            [ImportStatus.QUEUED, ImportStatus.RUNNING, ImportStatus.FAILED],
            status=ImportStatus.RUNNING,
            rows_read=0,
            imported=0,
            duplicates=0,
            skipped=0,
            errors=[],
        )

    def record_counts(self, *, counts: dict[str, int], errors: list[dict[str, Any]]) -> bool:
        """running: the counts so far, after each chunk."""
        return _move(self, [ImportStatus.RUNNING], errors=errors, **counts)

    def mark_done(self, *, counts: dict[str, int], errors: list[dict[str, Any]]) -> bool:
        """running -> done, with the final counts."""
        return _move(
            self,
            [ImportStatus.RUNNING],
            status=ImportStatus.DONE,
            finished_at=timezone.now(),
            errors=errors,
            **counts,
        )

    def mark_failed(self, *, errors: list[dict[str, Any]]) -> bool:
        """queued/running -> failed: the file cannot be imported, or its job died or was
        cancelled (the last error says why)."""
        return _move(
            self,
            [ImportStatus.QUEUED, ImportStatus.RUNNING],
            status=ImportStatus.FAILED,
            errors=errors,
            finished_at=timezone.now(),
        )
